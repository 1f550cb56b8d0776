"""The ``arborl`` command."""

from __future__ import annotations

import json
import os

import typer
from rich.console import Console

from arborl.bench import BENCHMARKS, get_benchmark

app = typer.Typer(
    help="arborl: agentic reinforcement learning for LLMs (fast rollout, prefix-tree training).",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from local files only


@app.command()
def bench(
    name: str = typer.Argument(..., help=f"benchmark to run: {', '.join(BENCHMARKS)}"),
    quick: bool = typer.Option(False, "--quick", help="smaller workload (minutes, not tens of minutes)"),
) -> None:
    """Run a benchmark: a table of figures, then one JSON object as the last line."""
    console = Console(stderr=True)
    try:
        run = get_benchmark(name)
    except KeyError:
        console.print(f"[red]unknown benchmark {name!r}[/red]; choose one of: {', '.join(BENCHMARKS)}")
        raise typer.Exit(2) from None
    figures = run(quick=quick, console=console)
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    app()
