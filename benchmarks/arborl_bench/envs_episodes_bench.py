"""``arborl bench envs``: real SmolLM2 code-repair episodes, and what training does to them.

* episodes: the white-box code agent and the black-box CLI agent (examples/code_repair_agent.py, run in
  each episode's sandbox) on easy-tier tasks -> ``whitebox_episodes_per_min``, ``blackbox_episodes_per_min``;
* training: the code-repair job (``configs/code_repair.yaml``: SFT on train demos, then GRPO) ->
  ``code_repair_success_before`` / ``_after_sft`` / ``_after`` on the held-out easy tasks, and
  ``code_repair_perturbed_success_*`` on their perturbed variants. ``--quick`` reads the job's recorded
  run (runs/code-repair/summary.json); the full bench runs the whole job (~45 min) itself.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arborl.run.assemble import build_gateway
from arborl.config import Config, load_config
from arborl.run.controller import Controller
from arborl.tasks import make_suite

REPO = Path(__file__).resolve().parents[2]  # benchmarks/arborl_bench/ -> the checkout


def _cfg(tmp: Path, *extra: str) -> Config:
    return load_config(REPO / "configs" / "code_repair.yaml", [
        f"runs_dir={tmp}", "name=bench-envs", f"rollout.code_repair.suite_dir={tmp / 'suite'}",
        "rollout.code_repair.per_template=2", "rollout.code_repair.require_validated=false",
        f"rollout.envs.root_dir={tmp / 'ws'}", "scheduling.timeline=false", *extra])


def _episodes_per_min(cfg: Config, n_tasks: int, group: int) -> tuple[float, dict[str, Any]]:
    built = build_gateway(cfg)
    ctl = Controller(cfg, built.gateway, built.engines, built.pool, None, make_suite(cfg.rollout))

    async def main():
        try:
            tasks = ctl.suite.tasks("train", n_tasks, seed=1)
            t0 = time.perf_counter()
            eps = await ctl.run_groups(tasks, group, temperature=cfg.rollout.temperature, tag="bench")
            return eps, time.perf_counter() - t0
        finally:
            await ctl.close()

    try:
        episodes, secs = asyncio.run(main())
    finally:
        built.close()
    n = len(episodes)
    calls = sum(len(e.calls) for e in episodes)
    return 60.0 * n / secs, {"episodes": n, "calls_per_episode": round(calls / max(1, n), 2),
                             "success": sum(e.reward_components.get("outcome", 0.0) for e in episodes) / max(1, n)}


def episodes_section(quick: bool, console) -> dict[str, Any]:  # noqa: ANN001 - a rich Console
    n_tasks, group = (2, 2) if quick else (4, 4)
    short = ["rollout.max_turns=3", "rollout.max_tokens=96"] if quick else []
    with tempfile.TemporaryDirectory(prefix="arborl-bench-episodes-") as d:
        tmp = Path(d)
        console.print(f"code_repair episodes: {n_tasks} tasks x {group} with SmolLM2, white-box then black-box ...")
        white, wi = _episodes_per_min(_cfg(tmp, "rollout.workers=0", *short), n_tasks, group)
        black, bi = _episodes_per_min(_cfg(tmp, "rollout.workers=1", "rollout.agent=command",
                                           f"rollout.agent_command={json.dumps([sys.executable, str(REPO / 'examples/code_repair_agent.py')])}",
                                           f"rollout.envs.ro_binds=[{REPO / 'examples'}]", *short), n_tasks, group)
    return {"whitebox_episodes_per_min": round(white, 2), "blackbox_episodes_per_min": round(black, 2),
            "whitebox_calls_per_episode": wi["calls_per_episode"], "blackbox_calls_per_episode": bi["calls_per_episode"],
            "whitebox_success_untrained": wi["success"], "blackbox_success_untrained": bi["success"]}


JOB = REPO / "configs" / "code_repair.yaml"
STAGES = ("before", "after_sft", "after")


def job_figures(summary: dict[str, Any], source: str) -> dict[str, Any]:
    """The code-repair job's held-out figures (``summary.json`` of configs/code_repair.yaml's run), as
    ``code_repair_success_<stage>`` (eval split) and ``code_repair_perturbed_success_<stage>``."""
    out: dict[str, Any] = {}
    for split, name in (("eval", "code_repair_success"), ("eval_perturbed", "code_repair_perturbed_success")):
        for stage in STAGES:
            out[f"{name}_{stage}"] = summary.get(f"{split}_success_{stage}")
    wall = summary.get("wall_s")
    out["code_repair_job_min"] = round(wall / 60, 1) if wall is not None else None
    out["code_repair_source"] = source
    return out


def training_section(quick: bool, console, run_dir: Path | None = None) -> dict[str, Any]:  # noqa: ANN001
    """--quick reads the figures of the job's recorded run (runs/<name>/summary.json of configs/code_repair.yaml:
    `make code-repair` or `arborl train configs/code_repair.yaml`); the full bench runs that job itself (~45 min:
    the suite validated and the demos made first, `make code-repair-demos`) as run bench-code-repair."""
    cfg = load_config(JOB, [])
    recorded = Path(run_dir) if run_dir is not None else cfg.run_dir
    if quick:
        summary_file = recorded / "summary.json"
        if not summary_file.is_file():
            return {**job_figures({}, "none"), "code_repair_training": f"no recorded run: {summary_file} is missing; "
                    "run `make code-repair` (or `arborl train configs/code_repair.yaml`) first"}
        console.print(f"code_repair training: the recorded job {recorded} (summary.json) ...")
        return job_figures(json.loads(summary_file.read_text()), f"recorded run {summary_file}")
    from arborl.run.job import train

    cfg = load_config(JOB, ["name=bench-code-repair"])
    console.print("code_repair training: the whole job (configs/code_repair.yaml: evals, SFT, evals, GRPO, evals) ...")
    summary = train(cfg, overwrite=True)
    return job_figures(summary, f"this bench's run {cfg.run_dir}")
