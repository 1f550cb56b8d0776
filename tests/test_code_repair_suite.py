"""The registered code_repair suite: disjoint splits, tier / validation / variants knobs, and episodes on
a live gateway whose workspace is a real sandbox: hidden tests scored per test after the agent. ~40 s."""

from __future__ import annotations

import asyncio
import json

import pytest

from arborl.agents import AgentOutcome, run_agent
from arborl.config import CodeRepairConfig, EnvsConfig, RolloutConfig
from arborl.envs import make_runtime
from arborl.envs.base import EnvError
from arborl.tasks import TASK_SUITES, make_suite
from arborl.tasks.code_repair import CodeRepairSuite, RepairEnv
from arborl.tasks.code_repair.suite import submit_unchanged
from arborl.tasks.code_repair.catalog import suite_root
from arborl.types import EpisodeStatus

from helpers.blackbox_gateway import start_harness


def mark(cr: CodeRepairConfig, statuses: dict[str, str]) -> None:
    """Write validation verdicts into the suite's cache (what `arborl envs validate` leaves there)."""
    path = suite_root(cr) / "validation.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update({h: {"hash": h, "status": s, "k": 3} for h, s in statuses.items()})
    path.write_text(json.dumps(data))


@pytest.fixture
def cr(tmp_path):
    return CodeRepairConfig(suite_dir=str(tmp_path / "suite"), per_template=3, require_validated=False)


def test_registered_and_built_from_the_rollout_section(tmp_path, cr):
    assert "code_repair" in TASK_SUITES
    suite = make_suite(RolloutConfig(task="code_repair", code_repair=cr))
    assert suite.name == "code_repair" and len(suite.all_tasks) == 75
    assert (tmp_path / "suite" / "index.json").is_file()


def test_splits_are_disjoint_and_draws_deterministic(cr):
    suite = CodeRepairSuite(cr)
    train, evals = suite.pool("train"), suite.pool("eval")
    assert train and evals and not {t.hash for t in train} & {t.hash for t in evals}
    assert [t.task_id for t in suite.tasks("train", 10, seed=4)] == [t.task_id for t in suite.tasks("train", 10, seed=4)]
    assert [t.task_id for t in suite.tasks("train", 10, seed=4)] != [t.task_id for t in suite.tasks("train", 10, seed=5)]
    drawn = suite.tasks("train", len(train) + 3, seed=1)  # more than the pool: repeats get ~k ids
    assert len({t.task_id for t in drawn}) == len(drawn) and sum("~" in t.task_id for t in drawn) == 3
    assert {t.metadata["hash"] for t in suite.tasks("eval", 100)} == {t.hash for t in evals}
    with pytest.raises(ValueError, match="split must be"):
        suite.tasks("test", 1)


def test_tier_knob_filters(cr):
    for tier in ("easy", "medium", "hard"):
        suite = CodeRepairSuite(cr.model_copy(update={"tier": tier}))
        assert {t.metadata["tier"] for t in suite.tasks("train", 30, seed=0)} == {tier}
    assert len({t.metadata["tier"] for t in CodeRepairSuite(cr).tasks("train", 60, seed=0)}) == 3


def test_require_validated_draws_only_validated_tasks(cr):
    suite = CodeRepairSuite(cr.model_copy(update={"require_validated": True}))
    with pytest.raises(EnvError, match=r"no validated code-repair tasks .* run `arborl envs validate code_repair` first"):
        suite.tasks("train", 4)
    pool = CodeRepairSuite(cr).pool("train")
    good, bad = pool[:5], pool[5:8]
    mark(cr, {t.hash: "validated" for t in good} | {t.hash: "gold_fails" for t in bad})
    assert {t.metadata["hash"] for t in suite.tasks("train", 40)} == {t.hash for t in good}
    loose = CodeRepairSuite(cr)  # require_validated=False: the never-validated too, the dropped never
    hashes = {t.hash for t in loose.pool("train")}
    assert {t.hash for t in good} <= hashes and not {t.hash for t in bad} & hashes and len(hashes) == len(pool) - 3


def test_variants_knob_adds_perturbed_tasks_in_their_origin_split(cr):
    base = CodeRepairSuite(cr)
    with_variants = CodeRepairSuite(cr.model_copy(update={"variants": True}))
    assert len(with_variants.all_tasks) > 4 * len(base.all_tasks)
    split = {t.hash: t.split for t in base.all_tasks}
    kinds = set()
    for t in with_variants.all_tasks:
        if t.meta.get("perturbation"):
            kinds.add(t.meta["perturbation"])
            assert t.split == split[t.meta["variant_of"]]
    assert kinds == {"rename", "reorder", "reword", "layout", "nodep"}
    # the knob adds variants to what trains; eval stays the held-out base tasks, comparable with a run without
    # the knob, and the held-out variants are eval_perturbed's alone
    trained = with_variants.pool("train")
    assert {t.hash for t in base.pool("train")} < {t.hash for t in trained}
    assert any(t.meta.get("perturbation") for t in trained)
    assert [t.hash for t in with_variants.pool("eval")] == [t.hash for t in base.pool("eval")]
    perturbed = with_variants.pool("eval_perturbed")
    assert perturbed and all(t.meta.get("perturbation") and t.split == "eval" for t in perturbed)


def test_seed_and_per_template_knobs_change_the_tasks(tmp_path):
    a = CodeRepairSuite(CodeRepairConfig(suite_dir=str(tmp_path / "a"), per_template=1, require_validated=False))
    b = CodeRepairSuite(CodeRepairConfig(suite_dir=str(tmp_path / "b"), per_template=1, seed=7, require_validated=False))
    c = CodeRepairSuite(CodeRepairConfig(suite_dir=str(tmp_path / "c"), per_template=2, require_validated=False))
    assert not {t.hash for t in a.all_tasks} & {t.hash for t in b.all_tasks}
    assert len(c.all_tasks) == 2 * len(a.all_tasks) and {t.hash for t in a.all_tasks} <= {t.hash for t in c.all_tasks}


def test_score_needs_the_episode_wrapper(cr):
    suite = CodeRepairSuite(cr)
    task = suite.tasks("train", 1)[0]
    with pytest.raises(EnvError, match="no hidden-test results"):
        suite.score(task, AgentOutcome(answer="done"), [])
    info = {"code_repair": {"tests": {}, "passed": 2, "total": 4}}
    assert suite.score(task, AgentOutcome(info=info), []) == {"outcome": 0.0, "tests_passed_frac": 0.5}


async def apply_gold(task, client, env: RepairEnv) -> AgentOutcome:
    """A test agent: asks the model once, then writes the gold patch from inside the sandbox."""
    await client.chat([{"role": "user", "content": task.prompt}], max_tokens=4)
    for rel, text in env.task.gold_files().items():
        res = await env.run(["python", "-c", "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())", rel],
                            stdin=text)
        assert res.returncode == 0, res.stderr
    return AgentOutcome(answer="fixed")


def test_episodes_score_the_final_workspace_with_hidden_tests(tmp_path, cr):
    runtime = make_runtime(EnvsConfig(root_dir=str(tmp_path / "envs")))
    fixer = CodeRepairSuite(cr, runtime=runtime, inner=apply_gold)
    noop = CodeRepairSuite(cr, runtime=runtime, inner=submit_unchanged)  # submits unchanged
    task = next(t for t in fixer.tasks("eval", 100) if t.metadata["template"] == "off_by_one")
    h = start_harness()
    try:
        good = asyncio.run(run_agent(h.gateway, fixer.agent({}), task, group_id="g"))
        bad = asyncio.run(run_agent(h.gateway, noop.agent({}), task, group_id="g"))
        assert good.status == bad.status == EpisodeStatus.FINISHED, (good.error, bad.error)
        assert fixer.score(task, good.outcome, []) == {"outcome": 1.0, "tests_passed_frac": 1.0}
        s = noop.score(task, bad.outcome, [])
        assert s["outcome"] == 0.0 and 0.0 < s["tests_passed_frac"] < 1.0  # off_by_one: 2 of its 4 tests pass
        tests = bad.outcome.info["code_repair"]["tests"]
        rt = fixer.repair_task(task)
        assert [n for n, v in tests.items() if v != "passed"] == rt.meta["failing_tests"]
        ep = h.pool.get_episode(good.episode_id)  # the per-test results are kept with the episode
        assert ep.meta["outcome"]["info"]["code_repair"]["tests"] == {n: "passed" for n in rt.tests}
        assert len(ep.calls) == 1
    finally:
        h.close()
    assert [p.name for p in (tmp_path / "envs").iterdir() if not p.name.startswith(".")] == [], \
        "the episode's workspace and the evaluation's scratch copy are gone"


def test_test_timeout_knob_bounds_the_hidden_tests(tmp_path, cr):
    runtime = make_runtime(EnvsConfig(root_dir=str(tmp_path / "envs")))
    suite = CodeRepairSuite(cr.model_copy(update={"test_timeout_s": 2.0}), runtime=runtime)
    task = suite.tasks("train", 1)[0]
    rt = suite.repair_task(task)
    (rt.tests_dir / "test_hidden.py").write_text(
        (rt.tests_dir / "test_hidden.py").read_text() + "\n\nimport time\ntime.sleep(20)\n")  # collection hangs

    async def episode():
        ws = await suite.prepare(task, episode_id="timeout-knob")
        try:
            return await suite.evaluate(task, ws)
        finally:
            await suite.close(ws)

    v = asyncio.run(episode())
    assert v.timed_out and set(v.results.values()) == {"missing"} and v.frac == 0.0


def test_a_stored_task_reads_back_as_the_same_content(cr):
    t = CodeRepairSuite(cr).all_tasks[0]
    assert t.files().hash == t.hash
