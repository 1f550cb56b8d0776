"""The ``arborl`` command."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

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


@app.command()
def serve(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (defaults when omitted)"),
    host: Optional[str] = typer.Option(None, "--host", help="address to bind (default: gateway.host, 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="TCP port (default: gateway.port; 0 = any free port)"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Start engine(s) and the OpenAI-compatible gateway, print the base URL, serve until Ctrl-C."""
    from arborl.serve import run_serve
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        run_serve(config, host, port, overrides, console)
    except (ArborlError, OSError) as e:  # bad config, model not loadable, port taken
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None


@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (default job when omitted)"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in runs/<name>/ from its checkpoint"),
) -> None:
    """Train a policy with agentic RL (default: the calculator task on SmolLM2-135M-Instruct, CPU)."""
    from arborl.config import load_config
    from arborl.job import train as run_train
    from arborl.types import ArborlError

    console = Console()
    try:
        run_train(load_config(config, overrides), resume=resume, console=console)
    except ArborlError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None


@app.command("eval")
def eval_cmd(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (defaults when omitted)"),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="checkpoint directory to evaluate"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Held-out success of the configured model or of a checkpoint; prints a table and a JSON line."""
    from arborl.config import load_config
    from arborl.job import evaluate
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        result = evaluate(load_config(config, overrides), checkpoint, console=console)
    except ArborlError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    print(json.dumps(result, sort_keys=True))


@app.command()
def simulate(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (defaults: the Seer-like workload of `sim`)"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
    full: bool = typer.Option(False, "--full", help="every figure of every policy, not only the headline ones"),
) -> None:
    """Simulate a rollout cluster under each policy of sim.policies; prints one JSON object of figures."""
    from arborl.config import load_config
    from arborl.sim import SimDeadlock
    from arborl.sim import simulate as run_simulation
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        cfg = load_config(config, overrides)
        result = run_simulation(cfg, full=full, progress=lambda v, f: console.print(
            f"  {v}: {f['time_s']:.0f} s simulated, {f['train_tokens_per_s']:.0f} trained tokens/s ({f['wall_s']:.1f} s)"))
    except (ArborlError, ValueError, SimDeadlock) as e:  # bad config, unknown policy name, stuck workload
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    app()
