"""``arborl bench envs``: real SmolLM2 code-repair episodes, and what training does to them.

* episodes: the white-box code agent and the black-box CLI agent (examples/code_repair_agent.py, run in
  each episode's sandbox) on easy-tier tasks -> ``whitebox_episodes_per_min``, ``blackbox_episodes_per_min``;
* training (full mode only; it takes tens of minutes): ``configs/code_repair.yaml`` shortened to the
  bench's budget -> ``code_repair_success_before`` / ``_after`` on held-out easy tasks.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arborl.assemble import build_gateway
from arborl.config import Config, load_config
from arborl.controller import Controller
from arborl.tasks import make_suite

REPO = Path(__file__).resolve().parents[3]


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


def training_section(quick: bool, console) -> dict[str, Any]:  # noqa: ANN001
    if quick:
        return {"code_repair_success_before": None, "code_repair_success_after": None,
                "code_repair_training": "not run in --quick (tens of minutes): run `arborl bench envs`"}
    from arborl.job import train

    with tempfile.TemporaryDirectory(prefix="arborl-bench-train-") as d:
        cfg = _cfg(Path(d), "rollout.steps=8", "rollout.eval_tasks=16")
        console.print("code_repair training: configs/code_repair.yaml, 8 steps, 16 held-out easy tasks ...")
        t0 = time.perf_counter()
        summary = train(cfg)
    return {"code_repair_success_before": summary.get("eval_success_before"),
            "code_repair_success_after": summary.get("eval_success_after"),
            "code_repair_train_min": round((time.perf_counter() - t0) / 60, 1)}
