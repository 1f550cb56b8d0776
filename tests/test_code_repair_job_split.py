"""The code-repair job's splits (configs/code_repair.yaml: the same seed, per_template, tier and
eval_perturbed) share no task: train, eval and eval_perturbed are disjoint by task id and content hash,
no held-out task has the same buggy source or gold patch as a trained one, every perturbed held-out task
is a variant of an eval task, and the demonstrations the job fine-tunes on come from train tasks only.

The split is per task (fixed by each task's hash): a bug template gives tasks on both sides, as different
repositories (names, values, layout), so the held-out figure measures the skill on unseen code."""

from __future__ import annotations

from pathlib import Path

import pytest

from arborl.config import load_config
from arborl.tasks.code_repair import CodeRepairSuite
from arborl.tasks.code_repair.store import read_files

JOB = Path(__file__).resolve().parents[1] / "configs" / "code_repair.yaml"


pytestmark = pytest.mark.slow  # materialises the job's whole suite with its variants (~40 s)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    suite_dir = tmp_path_factory.mktemp("job-suite")
    cfg = load_config(JOB, [f"rollout.code_repair.suite_dir={suite_dir}", "rollout.code_repair.require_validated=false"])
    assert cfg.rollout.code_repair.eval_perturbed, "the job evaluates the perturbed held-out split too"
    return cfg, CodeRepairSuite(cfg.rollout.code_repair, envs=cfg.rollout.envs)


def _source(t) -> tuple:
    return tuple(sorted(read_files(t.repo).items()))


def _patch(t) -> tuple:
    return tuple(sorted(t.gold_files().items()))


def test_the_jobs_train_eval_and_perturbed_splits_share_no_task(job):
    _, suite = job
    pools = {s: suite.pool(s) for s in ("train", "eval", "eval_perturbed")}
    assert all(pools.values())
    for a, b in (("train", "eval"), ("train", "eval_perturbed"), ("eval", "eval_perturbed")):
        assert not {t.id for t in pools[a]} & {t.id for t in pools[b]}, (a, b)
        assert not {t.hash for t in pools[a]} & {t.hash for t in pools[b]}, (a, b)
    for held in ("eval", "eval_perturbed"):  # no held-out task has a train task's code (a template can draw the
        # same repository and fix with other test values: such a task is left out of the held-out pools)
        train_code = {(_source(t), _patch(t)) for t in suite.all_tasks if t.split == "train"}
        assert not {(_source(t), _patch(t)) for t in pools[held]} & train_code, f"{held} task with a train task's code"
    evals = {t.hash for t in pools["eval"]}
    train_all = {t.hash for t in suite.all_tasks if t.split == "train"}  # train tasks and their variants
    for t in pools["eval_perturbed"]:
        assert t.meta["perturbation"] and t.meta["variant_of"] in evals and t.meta["variant_of"] not in train_all
    # what RL draws comes from the train pool alone
    drawn = {t.metadata["hash"] for t in suite.tasks("train", 3 * len(pools["train"]), seed=3)}
    assert drawn <= {t.hash for t in pools["train"]}


def test_the_jobs_demonstrations_come_from_train_tasks_only(job):
    """`make code-repair-demos` writes the job's train.sft.files from the train split (arborl envs demos
    --split train); every transcript names its task, and none is held out."""
    cfg, suite = job
    assert cfg.train.sft.files, "the job warm-starts from demonstrations (train.sft.files)"
    make = (JOB.parents[1] / "Makefile").read_text()
    target = make.split("\ncode-repair-demos:", 1)[1].split("\n\n", 1)[0]
    assert "--split train" in target and cfg.train.sft.files[0] in target
    held = {t.hash for t in suite.all_tasks if t.split == "eval"}
    demos = Path(cfg.train.sft.files[0])
    if demos.is_file():  # once made: check the file the job will read
        import json

        rows = [json.loads(x) for x in demos.read_text().splitlines() if x.strip()]
        assert rows and all(r["split"] == "train" and r["hash"] not in held for r in rows)
