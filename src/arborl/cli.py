"""The ``arborl`` command."""

from __future__ import annotations

import json
import shlex
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from arborl import __version__
from arborl.registry import RegistryError

app = typer.Typer(
    help="arborl: agentic reinforcement learning for LLMs (fast rollout, prefix-tree training).",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        print(f"arborl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print arborl's version and exit"),
) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from local files only


def _fail(console: Console, error: BaseException, code: int = 2) -> typer.Exit:
    """Print ``error`` in red, unwrapped (rich would break long messages mid-phrase); the Exit to raise."""
    console.print(escape(str(error)), style="red", soft_wrap=True, highlight=False)
    return typer.Exit(code)


@app.command()
def bench(
    name: str = typer.Argument(..., help="benchmark to run: engine, gateway, tree-packing, scheduling, vs-trl, envs, "
                               "backends, specdec, credit, cluster, parallel, memory, progress, faults (arborl_bench.BENCHMARKS, in benchmarks/); "
                               "all: each of them in its own process, the figures recorded with the machine "
                               "(docs/figures.md); or module:attr / file.py:attr of your own run(quick, console)"),
    quick: bool = typer.Option(False, "--quick", help="smaller workload (minutes, not tens of minutes)"),
    repeats: int = typer.Option(1, "--repeats", min=1, help="bench all: runs of each benchmark (median and spread)"),
    only: Optional[str] = typer.Option(None, "--only", help="bench all: these benchmarks (a,b), the other entries of "
                                       "--out kept"),
    out: Path = typer.Option(Path("docs/figures.json"), "--out", help="bench all: the record to write"),
    append: bool = typer.Option(False, "--append", help="bench all: add this run's values to the entries of --out "
                                "(same machine), so median and spread cover every invocation"),
    timeout_s: float = typer.Option(2400.0, "--timeout-s", min=0, help="bench all: a run of one benchmark is killed "
                                    "(and recorded as failed) after this many seconds; 0: no limit"),
) -> None:
    """Run a benchmark: a table of figures, then one JSON object as the last line.
    `arborl bench all` runs every one and writes docs/figures.json (`make figures` also renders README's table)."""
    console = Console(stderr=True)
    benches = _benchmarks(console)
    if name == "all":
        return _bench_all(console, quick=quick, repeats=repeats, only=only, out=out, timeout_s=timeout_s or None,
                          append=append)
    if repeats != 1 or only is not None or append:
        raise _fail(console, "--repeats, --only and --append are options of `arborl bench all`")
    try:
        run = benches.get_benchmark(name)
    except KeyError:
        raise _fail(console, f"unknown benchmark {name!r}; choose one of: all, {', '.join(benches.BENCHMARKS)}, "
                    "or module:attr / file.py:attr") from None
    except RegistryError as e:
        raise _fail(console, e) from None
    figures = run(quick=quick, console=console)
    print(json.dumps(figures, sort_keys=True))


def _benchmarks(console: Console):  # noqa: ANN202 - the arborl_bench module
    """The benchmarks (benchmarks/arborl_bench: the lab, outside the product package), imported on use."""
    try:
        import arborl_bench
    except ModuleNotFoundError as e:
        if e.name != "arborl_bench":
            raise
        raise _fail(console, "the benchmarks are not installed: they live in benchmarks/ of a clone of arborl; "
                    "install it with pip install -e '.[bench]' from the clone") from None
    return arborl_bench


def _bench_all(console: Console, *, quick: bool, repeats: int, only: Optional[str], out: Path,
               timeout_s: float | None, append: bool) -> None:
    import shlex
    import sys

    from arborl_bench.all_bench import RecordError, run_all, select, summary_table

    prog = "arborl" if Path(sys.argv[0]).name == "arborl" else "python -m arborl.cli"
    command = f"{prog} {shlex.join(sys.argv[1:])}"
    try:
        names = select(only)
        record = run_all(names, quick=quick, repeats=repeats, out=out, command=command, merge=only is not None,
                         say=lambda m: console.print(escape(m), highlight=False, soft_wrap=True),
                         echo=lambda line: print(f"  | {line}", file=sys.stderr, flush=True), timeout_s=timeout_s, append=append)
    except RecordError as e:
        raise _fail(console, e) from None
    console.print(summary_table(record, names, out))
    print(json.dumps({"out": str(out), "ok": [n for n in names if record["benches"][n]["ok"]],
                      "failed": [n for n in names if not record["benches"][n]["ok"]]}))


@app.command()
def serve(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (defaults when omitted)"),
    host: Optional[str] = typer.Option(None, "--host", help="address to bind (default: gateway.host, 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="TCP port (default: gateway.port; 0 = any free port)"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Start engine(s) and the OpenAI-compatible gateway, print the base URL, serve until Ctrl-C.
    A trained policy: --set model.source=hf --set model.path=runs/NAME/checkpoint."""
    from arborl.serve import run_serve
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        run_serve(config, host, port, overrides, console)
    except (ArborlError, OSError) as e:  # bad config, model not loadable, port taken
        raise _fail(console, e) from None


@app.command()
def train(
    config: Optional[Path] = typer.Argument(
        None, help="YAML config file (default job when omitted); with --resume also a run directory (runs/NAME) "
        "or a run's name"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
    resume: bool = typer.Option(
        False, "--resume",
        help="continue the run (given as CONFIG: runs/NAME or NAME; or by --set name=NAME) from its checkpoint, "
        "with its own config.yaml; --set on top changes steps, lr, evaluation, ... (recorded in config.changes.yaml)"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="delete the outputs of an earlier run of the same name, then start afresh"),
) -> None:
    """Train a policy with agentic RL (default: the calculator task on SmolLM2-135M-Instruct, CPU).
    Ctrl-C or SIGTERM stops after the step in flight with a checkpoint (exit status 130 / 143)."""
    from arborl.config import ConfigError, load_config
    from arborl.run.job import train as run_train
    from arborl.run_config import resume_config
    from arborl.run.stopping import RunStopped
    from arborl.types import ArborlError

    console = Console()
    try:
        if resume:
            cfg = resume_config(config, overrides)
        elif config is not None and config.is_dir():
            raise ConfigError(f"{config} is a directory: continue the run there with --resume, or pass a YAML file")
        else:
            cfg = load_config(config, overrides)
        run_train(cfg, resume=resume, overwrite=overwrite, console=console)
    except RunStopped as e:  # checkpoint saved and the way to resume printed
        raise typer.Exit(e.exit_code) from None
    except ArborlError as e:
        raise _fail(console, e) from None
    except KeyboardInterrupt:
        raise _fail(console, "interrupted: stopped at once, nothing saved since the last checkpoint", 130) from None


@app.command("eval")
def eval_cmd(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (defaults when omitted)"),
    checkpoint: Optional[Path] = typer.Option(
        None, "--checkpoint",
        help="checkpoint directory to evaluate; runs/NAME/checkpoint is evaluated under that run's config"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Held-out success of the configured model or of a checkpoint; prints a table and a JSON line."""
    from arborl.run.job import evaluate
    from arborl.run_config import eval_config
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        result = evaluate(eval_config(config, overrides, checkpoint), checkpoint, console=console)
    except ArborlError as e:
        raise _fail(console, e) from None
    print(json.dumps(result, sort_keys=True))


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="run directory (runs/NAME) or checkpoint directory"),
    out: Optional[Path] = typer.Option(None, "--out", help="directory to write (default: RUN_DIR/export)"),
) -> None:
    """Write the run's policy as a Hugging Face model directory (LoRA merged); load it with
    from_pretrained, or train / eval / serve it with --set model.source=hf --set model.path=DIR."""
    from arborl.export import export_run
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        dest = export_run(run_dir, out)
    except ArborlError as e:
        raise _fail(console, e) from None
    print(dest)


@app.command()
def audit(
    run_dir: Path = typer.Argument(..., help="run directory, runs/NAME"),
    max_drift_rate: Optional[float] = typer.Option(
        None, "--max-drift-rate", min=0, max=1, help="exit 1 when more than this share of the audited calls drifted"),
    examples: int = typer.Option(5, "--examples", min=0, help="drifted calls to show"),
) -> None:
    """Re-render every recorded conversation with the run's chat template and compare it with the token ids
    the engine consumed and the trainer used: drifted calls (first differing tokens shown) and unfaithful
    ones (a prompt that does not extend the episode's earlier tokens). Last line: JSON."""
    from arborl.audit import audit_run, decoded_examples
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        report, tokenizer = audit_run(run_dir, examples=examples)
    except ArborlError as e:
        raise _fail(console, e) from None
    out = {**report.summary(), "examples": decoded_examples(report, tokenizer)}
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(report.unfaithful_reasons.items()))
    console.print(f"{report.audited} of {report.calls} calls re-rendered: {report.drift_calls} drifted "
                  f"({report.drift_rate:.1%}; {report.retokenized_calls} re-render differently), "
                  f"{report.unfaithful_calls} unfaithful{f' ({reasons})' if reasons else ''}; {report.not_recorded} "
                  f"without their request, {report.token_calls} token-in", markup=False)
    for e in out["examples"]:
        console.print(f"  {e['call_id']} at token {e['position']}: engine {e['engine']!r} | re-render {e['rerender']!r}"
                      + (" (stitched: trained on the engine's tokens)" if e["stitched"] else ""), markup=False)
    print(json.dumps(out, sort_keys=True))
    if max_drift_rate is not None and report.drift_rate > max_drift_rate:
        console.print(f"drift rate {report.drift_rate:.1%} > --max-drift-rate {max_drift_rate}", markup=False)
        raise typer.Exit(1)


@app.command()
def show(
    run_dir: Path = typer.Argument(..., help="run directory, runs/NAME"),
    step: Optional[int] = typer.Option(None, "--step", help="training step to show (default: the last one)"),
    n: int = typer.Option(4, "--n", min=1, help="episodes to show"),
) -> None:
    """Print sample generations of a training step, decoded with the run's tokenizer, with task ids and rewards."""
    from arborl.show import show_run
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        show_run(run_dir, step, n)
    except ArborlError as e:
        raise _fail(console, e) from None


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
        raise _fail(console, e) from None
    print(json.dumps(result, sort_keys=True))


@app.command()
def dashboard(
    run_dirs: list[Path] = typer.Argument(None, help="run directories, or directories holding them (default: runs)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind"),
    port: int = typer.Option(8265, "--port", help="TCP port (0 = any free port)"),
) -> None:
    """Web dashboard of runs: curves (several runs overlaid), rollout timeline per step, token-level
    trajectories from the data pool, config; it re-reads the runs, so a running job shows live."""
    import uvicorn

    from arborl.dashboard import create_app
    from arborl.dashboard.app import plotly_js
    from arborl.gateway.server import bind
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        plotly_js()  # the charts' JavaScript: a clear error now rather than blank pages
        web = create_app(run_dirs or [Path("runs")])
        sock = bind(host, port)
    except (ArborlError, OSError) as e:
        raise _fail(console, e) from None
    shown = f"[{host}]" if ":" in host else host
    print(f"http://{shown}:{sock.getsockname()[1]}/", flush=True)
    console.print("arborl dashboard; Ctrl-C stops")
    try:
        uvicorn.Server(uvicorn.Config(web, log_level="warning", access_log=False)).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()


@app.command()
def runs(
    run_dirs: list[Path] = typer.Argument(None, help="run directories, or directories holding them (default: runs)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per run instead of a table"),
) -> None:
    """List run directories with their headline figures (steps, reward, success, held-out score, speed)."""
    from arborl.dashboard.listing import runs_table
    from arborl.dashboard.runs import Run, find_runs
    from arborl.types import ArborlError

    console = Console()
    if not console.is_terminal:  # a pipe or a log file: whole rows rather than rich's squeezed 80 columns
        console = Console(width=160)
    try:
        found = [Run(p) for p in find_runs(run_dirs or [Path("runs")])]
    except ArborlError as e:
        raise _fail(Console(stderr=True), e) from None
    if as_json:
        for r in found:
            print(json.dumps(r.headline(), sort_keys=True))
    elif not found:
        console.print("no run directories found")
    else:
        console.print(runs_table(found))


@app.command()
def compare(
    run_dirs: list[Path] = typer.Argument(..., help="two or more run directories (runs/NAME)"),
) -> None:
    """Print runs' headline figures and last-step metrics side by side."""
    from arborl.dashboard.listing import compare_table
    from arborl.dashboard.runs import Run, is_run_dir

    console = Console() if Console().is_terminal else Console(width=160)
    bad = [str(p) for p in run_dirs if not is_run_dir(p)]
    if bad or len(run_dirs) < 2:
        why = (f"not a run directory (no config.yaml or metrics.jsonl): {', '.join(bad)}" if bad
               else "give two or more run directories to compare")
        raise _fail(Console(stderr=True), why)
    console.print(compare_table([Run(p) for p in run_dirs]))


envs_app = typer.Typer(help="environments: validate a task suite (E3), make perturbed variants (E5)", no_args_is_help=True)
app.add_typer(envs_app, name="envs")


@envs_app.command("validate")
def envs_validate(
    suite: str = typer.Argument(..., help="task suite to validate: code_repair or harbor"),
    config: Optional[Path] = typer.Argument(None, help="YAML config file (rollout.code_repair / rollout.harbor and rollout.envs are read)"),
    tasks_dir: Optional[Path] = typer.Option(None, "--tasks-dir", help="harbor: the folder of task folders (rollout.harbor.tasks_dir)"),
    tier: str = typer.Option("all", "--tier", help="easy, medium, hard or all"),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="runs of gold and no-op per task (default: rollout.code_repair.validation_k)"),
    jobs: int = typer.Option(2, "--jobs", min=1, help="tasks validated at once"),
    which: str = typer.Option("base", "--which", help="base tasks, their perturbed variants, or all"),
    split: str = typer.Option("all", "--split", help="train, eval (the held-out tasks and their variants) or all"),
    limit: int = typer.Option(0, "--limit", min=0, help="validate only this many tasks, spread over the suite (0 = all)"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Run every task's gold patch (must pass), the no-op (must fail) and both k times (must agree) in the
    sandbox; cache the verdicts; training and evaluation draw only validated tasks. Last line: JSON counts."""
    from arborl.config import load_config
    from arborl.tasks.code_repair.commands import validate_suite
    from arborl.types import ArborlError

    console = Console(stderr=True)
    if which not in ("base", "variants", "all"):
        raise _fail(console, f"--which must be base, variants or all, got {which!r}")
    if suite == "harbor":
        return _validate_harbor(console, config, overrides, tasks_dir, k or 2, jobs)
    try:
        cfg = load_config(config, overrides)
        out = validate_suite(cfg, suite, tier=tier, k=k or cfg.rollout.code_repair.validation_k, jobs=jobs,
                             which=which, limit=limit, console=console, split=split)
    except ArborlError as e:
        raise _fail(console, e) from None
    print(json.dumps(out, sort_keys=True))


def _harbor_suite(config: Optional[Path], overrides: list[str], tasks_dir: Optional[Path]):  # noqa: ANN202
    from arborl.config import load_config
    from arborl.tasks.harbor import HarborSuite

    extra = [f"rollout.harbor.tasks_dir={tasks_dir.absolute()}"] if tasks_dir is not None else []
    cfg = load_config(config, [*overrides, *extra])
    return HarborSuite(cfg.rollout.harbor, envs=cfg.rollout.envs, max_turns=cfg.rollout.max_turns,
                       command_timeout_s=cfg.rollout.envs.wall_s)


def _validate_harbor(console: Console, config: Optional[Path], overrides: list[str], tasks_dir: Optional[Path],
                     k: int, jobs: int) -> None:
    from arborl.tasks.harbor.validate import validate_harbor
    from arborl.types import ArborlError

    try:
        out = validate_harbor(_harbor_suite(config, overrides, tasks_dir), k=k, jobs=jobs)
    except ArborlError as e:
        raise _fail(console, e) from None
    for r in out["results"]:
        console.print(f"  {r['status']:<12} {r['task']} ({r['split']})" + (f": {r['reason']}" if r.get("reason") else ""),
                      markup=False)
    print(json.dumps(out, sort_keys=True))
    bad = [r for r in out["results"] if r["status"] not in ("validated", "refused")]
    if bad:
        raise typer.Exit(1)


@envs_app.command("perturb")
def envs_perturb(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (rollout.code_repair and rollout.envs are read)"),
    validate: bool = typer.Option(False, "--validate", help="also validate the variants in the sandbox (E3)"),
    jobs: int = typer.Option(2, "--jobs", min=1, help="with --validate: tasks validated at once"),
    limit: int = typer.Option(0, "--limit", min=0, help="with --validate: only this many variants, spread (0 = all)"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Make the perturbed variants of every code_repair task (renamed, reordered, reworded, moved, optional
    dependency removed; E5). Each is validated on its own (--validate, or `arborl envs validate code_repair
    --which variants`); rollout.code_repair.variants=true trains on the validated ones of the train split."""
    from arborl.config import load_config
    from arborl.tasks.code_repair.commands import perturb_suite, validate_suite
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        cfg = load_config(config, overrides)
        out = perturb_suite(cfg, console)
        if validate:
            out["validation"] = validate_suite(cfg, "code_repair", tier="all", k=cfg.rollout.code_repair.validation_k,
                                               jobs=jobs, which="variants", limit=limit, console=console)
    except ArborlError as e:
        raise _fail(console, e) from None
    print(json.dumps(out, sort_keys=True))


@envs_app.command("demos")
def envs_demos(
    suite: str = typer.Argument(..., help="task suite: code_repair or harbor (each task's solution/solve.sh)"),
    config: Optional[Path] = typer.Argument(None, help="YAML config file (rollout.code_repair / rollout.harbor, rollout.envs, max_turns)"),
    tasks_dir: Optional[Path] = typer.Option(None, "--tasks-dir", help="harbor: the folder of task folders (rollout.harbor.tasks_dir)"),
    out: Path = typer.Option(Path("demos.jsonl"), "--out", help="JSONL file of transcripts to write ({messages, tools})"),
    split: str = typer.Option("train", "--split", help="train (what SFT may see) or eval"),
    per_task: int = typer.Option(2, "--per-task", min=1, help="demonstrations per task (each takes another path)"),
    limit: int = typer.Option(0, "--limit", min=0, help="only the first N tasks of the split (0 = all)"),
    render_command: Optional[str] = typer.Option(
        None, "--render-command", help="code_repair: a program (shell words) run in each demo's sandbox that renders "
        "the expert's steps in another harness's format, e.g. '.venv-mswea/bin/python examples/mini_swe_agent/demo.py "
        "--config examples/mini_swe_agent/config.yaml' (its folders in rollout.envs.ro_binds)"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Demonstrations from the suite itself: a scripted expert reaches each task's gold patch through the code
    agent's tools in the sandbox; only demos whose workspace passes the hidden tests are written. Last line: JSON."""
    from arborl.config import load_config
    from arborl.tasks.code_repair.demos import write_demos
    from arborl.types import ArborlError

    console = Console(stderr=True)
    if suite == "harbor":
        from arborl.tasks.harbor.validate import write_demos as harbor_demos

        try:
            res = harbor_demos(_harbor_suite(config, overrides, tasks_dir), out, split=split)
        except (ArborlError, ValueError) as e:
            raise _fail(console, e) from None
        console.print(f"wrote {res['kept']} demonstrations of {res['tasks']} {split} tasks to {out}", markup=False)
        print(json.dumps(res, sort_keys=True))
        return
    if suite != "code_repair":
        raise _fail(console, f"demonstrations are generated for the code_repair and harbor suites, not {suite!r}")
    try:
        res = write_demos(load_config(config, overrides), out, split=split, per_task=per_task, limit=limit,
                          render=shlex.split(render_command) if render_command else ())
    except (ArborlError, ValueError) as e:
        raise _fail(console, e) from None
    console.print(f"wrote {res['kept']} demonstrations of {res['tasks']} {split} tasks to {out}; dropped "
                  f"{res['dropped']} whose workspace failed the hidden tests", markup=False)
    print(json.dumps(res, sort_keys=True))


@app.command()
def sft(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (model, train.*, train.sft.*)"),
    data: list[Path] = typer.Option([], "--data", help="JSONL / Parquet transcripts (default: train.sft.files; repeatable)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="delete an earlier run's outputs in runs/NAME first"),
    overrides: list[str] = typer.Option([], "--set", help="override a knob, key.path=value (repeatable)"),
) -> None:
    """Supervised fine-tuning on chat transcripts (OpenAI messages + tools), loss on assistant tokens only;
    writes runs/NAME/ like `arborl train` (checkpoint/ is a Hugging Face model directory)."""
    from arborl.config import load_config
    from arborl.run.sft import sft as run_sft
    from arborl.types import ArborlError

    console = Console(stderr=True)
    try:
        summary = run_sft(load_config(config, overrides), files=[str(p) for p in data] or None, overwrite=overwrite,
                          console=console)
    except (ArborlError, OSError) as e:
        raise _fail(console, e) from None
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    app()
