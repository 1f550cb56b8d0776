"""E5 variants: each perturbation changes what the agent sees and keeps the task; every kind's variants
validate in the real sandbox (gold passes, no-op fails). ~15 s."""

from __future__ import annotations

import asyncio
import re

from arborl.config import EnvsConfig
from arborl.envs import make_runtime
from arborl.tasks.code_repair import PERTURBATIONS, load_task, make_task, validate_tasks, variants, write_task
from arborl.tasks.code_repair.statement import render


def by_kind(tf):
    return {v.meta["perturbation"]: v for v in variants(tf, 0)}


def test_every_kind_changes_what_the_agent_sees():
    tf = make_task("swapped_arguments", 0, 1, "hard")
    vs = by_kind(tf)
    assert set(vs) == set(PERTURBATIONS.names()) == {"rename", "reorder", "reword", "layout", "nodep"}
    for kind, v in vs.items():
        assert v.hash != tf.hash and v.meta["variant_of"] == tf.hash, kind
        assert v.tests == tf.tests or kind == "rename", kind  # hidden tests change only with the names

    ren = vs["rename"]
    old_fn, new_fn = tf.meta["function"], ren.meta["function"]
    old_pkg, new_pkg = tf.meta["package"], ren.meta["package"]
    assert new_fn != old_fn and new_pkg != old_pkg
    for text in [*ren.repo, *ren.repo.values(), *ren.tests.values(), *ren.gold.values(), render(ren.meta)]:
        assert not re.search(rf"\b({old_fn}|{old_pkg})\b", text)
    assert f"from {new_pkg} import {new_fn}" in ren.tests["test_hidden.py"]

    bug_file = tf.meta["bug_file"]
    defs = lambda text: re.findall(r"^def (\w+)", text, re.M)  # noqa: E731
    assert defs(vs["reorder"].repo[bug_file]) == defs(tf.repo[bug_file])[::-1]
    assert defs(vs["reorder"].gold[bug_file]) == defs(tf.gold[bug_file])[::-1]

    assert render(vs["reword"].meta) != render(tf.meta) and vs["reword"].repo == tf.repo

    moved = vs["layout"]
    assert {p.removeprefix("src/") for p in moved.repo} == {p.removeprefix("src/") for p in tf.repo}
    assert all(p.startswith("src/") for p in moved.repo) != all(p.startswith("src/") for p in tf.repo)

    nd = vs["nodep"]
    backend = nd.meta["optional_dependency"]
    assert f"import {backend} as _accel" in nd.repo[bug_file] and f"import {backend}" in nd.gold[bug_file]
    assert not any(backend in p for p in nd.repo)  # not shipped: the fallback path runs


def test_reorder_does_not_apply_to_one_function_files():
    assert "reorder" not in by_kind(make_task("wrong_index", 0, 0, "easy"))


def test_nodep_variant_takes_the_backend_when_present_and_the_fallback_when_not():
    v = by_kind(make_task("sort_order_reversed", 0, 0, "easy"))["nodep"]
    ns: dict = {}
    exec(v.gold[v.meta["bug_file"]], ns)  # noqa: S102 - our own generated code
    f = ns[v.meta["function"]]
    assert ns["_accel"] is None and f([3, 1, 2], 2) == [3, 2]
    ns["_accel"] = type("Backend", (), {v.meta["function"]: staticmethod(lambda scores, k: "fast")})
    assert f([3, 1, 2], 2) == "fast"


def test_variants_validate_in_the_sandbox(tmp_path):
    """Every kind on one task (a stateful bug in a 4-file package); the bench validates more."""
    runtime = make_runtime(EnvsConfig(root_dir=str(tmp_path / "envs")))
    tf = make_task("mutable_default", 0, 2, "hard")
    tasks = [load_task(write_task(v, tmp_path / "tasks")) for v in variants(tf, 0)]
    assert len(tasks) == 5
    report = asyncio.run(validate_tasks(runtime, tasks, k=1, jobs=2))
    assert report.counts()["validated_tasks"] == 5, report.dropped()
