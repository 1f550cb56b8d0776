"""Run directories as the dashboard, ``arborl runs`` and ``arborl compare`` see them: found under the
paths given, their metrics rows (re-read on every call: a running job appends to them), their config
and their headline figures."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from arborl.config import ConfigError
from arborl.run_config import CHANGES_FILE, CONFIG_FILE, run_config
from arborl.run.rundir import METRICS_FILE
from arborl.types import ArborlError

SPANS = Path("timeline") / "spans.jsonl"

# metrics shown first, in this order; every other numeric column of metrics.jsonl follows, sorted
WELL_KNOWN = (
    "reward", "success", "tool_use", "eval_success", "eval_reward", "heldout_nll", "loss/total", "loss/pg", "loss/kl",
    "loss/approx_kl", "loss/entropy", "loss/clip_frac", "loss/clip_frac_high", "loss/clip_frac_low",
    "mismatch/k3_kl", "mismatch/logp_abs_diff_mean", "mismatch/masked_frac", "rollout_tokens_per_s",
    "rollout_s", "train_s", "publish_s", "step_s", "memory/peak_rss_gb", "sched/max_version_gap", "spec/spec_mean_acceptance_length",
    "spec/spec_acceptance_rate",
    "train/grad_norm", "generated_tokens", "samples", "zero_variance_groups",
)

# a step's time by part, as its metrics row records them (column, label), stacked; "other" is step_s less their
# sum. No row records reward scoring (inside rollout_s: episodes are scored as they finish) or idle time apart
# (under an async policy rollout_s is the trainer's wait for a batch); peak memory is a curve of its own.
TIME_PARTS = (("rollout_s", "rollout"), ("train_s", "train"), ("mtp/step_s", "MTP draft training"),
              ("publish_s", "weight sync"))


class RunNotFoundError(ArborlError):
    """A path given is neither a run directory nor a directory holding run directories."""


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / CONFIG_FILE).is_file() or (path / METRICS_FILE).is_file())


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Each path that is a run directory, and the run directories directly inside the others."""
    out: list[Path] = []
    for p in map(Path, paths):
        if is_run_dir(p):
            out.append(p)
        elif p.is_dir():
            out += sorted(c for c in p.iterdir() if is_run_dir(c))
        else:
            raise RunNotFoundError(f"{p} does not exist: give a run directory (runs/NAME) or a directory of runs "
                                   "(runs)")
    return list(dict.fromkeys(out))


def run_keys(runs: list[Path]) -> dict[str, Path]:
    """A short unique key per run (its directory name; its parent's too where two names clash)."""
    keys: dict[str, Path] = {}
    for p in runs:
        key = p.name
        if key in keys or sum(q.name == p.name for q in runs) > 1:
            key = f"{p.parent.name}/{p.name}"
        n, base = 2, key
        while key in keys:
            key, n = f"{base}~{n}", n + 1
        keys[key] = p
    return keys


@dataclass
class Run:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def rows(self) -> list[dict[str, Any]]:
        """metrics.jsonl as it is now (a partly written last line of a running job is skipped)."""
        f = self.path / METRICS_FILE
        if not f.is_file():
            return []
        rows = []
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def summary(self) -> dict[str, Any]:
        f = self.path / "summary.json"
        try:
            return json.loads(f.read_text()) if f.is_file() else {}
        except json.JSONDecodeError:
            return {}

    def config_data(self) -> dict[str, Any]:
        """config.yaml as written (unvalidated: an older run's config still shows)."""
        f = self.path / CONFIG_FILE
        return (yaml.safe_load(f.read_text()) or {}) if f.is_file() else {}

    def changes(self) -> list[dict[str, Any]]:
        f = self.path / CHANGES_FILE
        return (yaml.safe_load(f.read_text()) or []) if f.is_file() else []

    def tempered(self) -> bool:
        """Whether the run's trainer scores tempered log-probs (rollout.temperature != 1): it then
        compares them with the sampling log-probs, else with the raw ones (train/trainer.py)."""
        try:
            return run_config(self.path).rollout.temperature != 1.0
        except ConfigError:
            return float((self.config_data().get("rollout") or {}).get("temperature", 1.0)) != 1.0

    def datapool_file(self) -> Path:
        try:
            name = run_config(self.path).datapool.filename
        except ConfigError:
            name = (self.config_data().get("datapool") or {}).get("filename", "datapool.sqlite")
        return self.path / name

    def headline(self) -> dict[str, Any]:
        """The figures `arborl runs` lists and `arborl compare` sets side by side."""
        rows = self.rows()
        steps = [r for r in rows if r.get("kind") == "step"]
        # held-out success on the eval split (not eval_perturbed, not SFT's held-out NLL rows)
        evals = [r for r in rows
                 if r.get("kind") == "eval" and r.get("split", "eval") == "eval" and "eval_success" in r]
        cfg = self.config_data()
        summary = self.summary()
        rollout = cfg.get("rollout") or {}
        # what a job writes as it goes (a reader's -wal / -shm files would say the run moved)
        written = [self.path / n for n in (METRICS_FILE, "summary.json", CONFIG_FILE, SPANS)] + [self.datapool_file()]
        mtime = max((p.stat().st_mtime for p in written if p.exists()), default=self.path.stat().st_mtime)

        def mean(key: str) -> float | None:
            vals = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
            return sum(vals) / len(vals) if vals else None

        return {
            "run": self.name,
            "task": rollout.get("task"),
            "model": (cfg.get("model") or {}).get("source"),
            "steps": f"{len(steps)}/{rollout.get('steps', '?')}",
            "state": "done" if summary and "stopped" not in summary else (
                f"stopped ({summary['stopped']})" if summary else
                ("running" if time.time() - mtime < 120 else "stopped")),
            "reward_first": steps[0].get("reward") if steps else None,
            "reward_last": steps[-1].get("reward") if steps else None,
            "success_last": steps[-1].get("success") if steps else None,
            "eval_success_first": evals[0].get("eval_success") if evals else None,
            "eval_success_last": evals[-1].get("eval_success") if len(evals) > 1 else None,
            "loss_last": steps[-1].get("loss/total") if steps else None,
            "mean_step_s": mean("step_s"),
            "mean_tokens_per_s": mean("rollout_tokens_per_s"),
            "updated": time.strftime("%H:%M" if time.time() - mtime < 20 * 3600 else "%Y-%m-%d", time.localtime(mtime)),
        }


def metric_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every numeric column of the rows: the well-known ones first, then the others sorted."""
    seen = {k for r in rows for k, v in r.items()
            if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return [k for k in WELL_KNOWN if k in seen] + sorted(seen - set(WELL_KNOWN))


def eval_series(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out rows as the curves draw them: a line per split (eval; code_repair's eval_perturbed) through
    the RL stages (before, every rollout.eval_every steps, after), and the evaluation after the SFT warm start
    (stage after_sft, at step 0) a series of its own, so that neither the splits nor the SFT point join into
    one line. A row without a split (a rollout.eval_every one) is the eval split's; SFT's held-out NLL rows
    (heldout_nll, no split) are "SFT held-out"."""
    series: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("kind") != "eval":
            continue
        split = r.get("split") or ("SFT held-out" if "heldout_nll" in r else "eval")
        stage = "after_sft" if r.get("stage") == "after_sft" else "rl"
        name = f"{split} after SFT" if stage == "after_sft" else split
        series.setdefault(name, {"name": name, "split": split, "stage": stage, "rows": []})["rows"].append(r)
    return list(series.values())


def time_split(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each step's seconds by part (TIME_PARTS that a step row records; a row lacking one counts 0 there) and
    "other": step_s less the parts (building samples, recording, the timeline; never below 0)."""
    steps = [r for r in rows if r.get("kind") == "step"]

    def num(r: dict[str, Any], k: str) -> float:
        return float(r[k]) if isinstance(r.get(k), (int, float)) else 0.0

    parts = [{"key": k, "name": label, "y": [num(r, k) for r in steps]}
             for k, label in TIME_PARTS if any(isinstance(r.get(k), (int, float)) for r in steps)]
    if parts and any(isinstance(r.get("step_s"), (int, float)) for r in steps):
        parts.append({"key": "other", "name": "other", "y": [
            max(0.0, num(r, "step_s") - sum(p["y"][i] for p in parts)) for i, r in enumerate(steps)]})
    return {"x": [r.get("step") for r in steps], "parts": parts}


def format_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
