"""E5: variants that multiply a suite. Each takes a task (buggy repo, gold, hidden tests, facts) and
changes what an agent sees while keeping what the task asks; every variant is re-validated (E3)
before it is used, since a perturbation can break a task.

* ``rename``: the function and its module / package get other names (files, tests, statement);
* ``reorder``: the top-level definitions of each module in reverse order;
* ``reword``: the statement in another phrasing;
* ``layout``: the repository moved under ``src/``, or out of it;
* ``nodep``: the buggy module imports an optional accelerated backend first and falls back to its
  own code when it is missing; the backend is not shipped, so the code takes its fallback path.
"""

from __future__ import annotations

import ast
import copy
import random
import re
from typing import Any, Callable

from arborl.registry import Registry
from arborl.tasks.code_repair.generate import _MODULES, _PACKAGES, TaskFiles
from arborl.tasks.code_repair.statement import PHRASINGS
from arborl.tasks.code_repair.templates import BUG_TEMPLATES

Perturbation = Callable[[TaskFiles, random.Random], "TaskFiles | None"]
PERTURBATIONS: Registry[Perturbation] = Registry("perturbation")


def _map_strings(obj: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_strings(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: _map_strings(v, fn) for k, v in obj.items()}
    return obj


def _all_text(tf: TaskFiles) -> str:
    return "\n".join([*tf.repo, *tf.repo.values(), *tf.tests.values(), repr(tf.meta)])


@PERTURBATIONS.register("rename")
def rename(tf: TaskFiles, rng: random.Random) -> TaskFiles | None:
    text = _all_text(tf)

    def unused(names: list[str] | tuple[str, ...]) -> list[str]:  # new names must not clash with any word there
        return [n for n in names if not re.search(rf"\b{re.escape(n)}\b", text)]

    m = tf.meta
    mapping = {m["function"]: rng.choice(unused(BUG_TEMPLATES.get(m["template"])(random.Random(0)).names)
                                         or [m["function"] + "_fn"])}
    for old in m["packages"] or [m["module"]]:
        mapping[old] = rng.choice(unused(_PACKAGES if m["packages"] else _MODULES) or [old + "_x"])
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, mapping)) + r")\b")

    def sub(s: str) -> str:
        return pattern.sub(lambda mt: mapping[mt.group(1)], s)

    out = TaskFiles({sub(p): sub(t) for p, t in tf.repo.items()}, {sub(p): sub(t) for p, t in tf.gold.items()},
                    {p: sub(t) for p, t in tf.tests.items()}, _map_strings(tf.meta, sub))
    return out


def _reverse_defs(text: str) -> str:
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.startswith(("def ", "class ", "@"))
              and not (i and lines[i - 1].startswith("@"))]
    if len(starts) < 2:
        return text
    head = "".join(lines[: starts[0]])
    blocks = ["".join(lines[a:b]).strip("\n") for a, b in zip(starts, starts[1:] + [len(lines)])]
    return head + "\n\n\n".join(reversed(blocks)) + "\n"


@PERTURBATIONS.register("reorder")
def reorder(tf: TaskFiles, rng: random.Random) -> TaskFiles | None:
    repo = {p: _reverse_defs(t) if p.endswith(".py") else t for p, t in tf.repo.items()}
    if repo == tf.repo:
        return None  # one definition per module: nothing to reorder
    return TaskFiles(repo, {p: _reverse_defs(t) for p, t in tf.gold.items()}, dict(tf.tests), copy.deepcopy(tf.meta))


@PERTURBATIONS.register("reword")
def reword(tf: TaskFiles, rng: random.Random) -> TaskFiles | None:
    meta = copy.deepcopy(tf.meta)
    meta["phrasing"] = (meta.get("phrasing", 0) + 1 + rng.randrange(PHRASINGS - 1)) % PHRASINGS
    return TaskFiles(dict(tf.repo), dict(tf.gold), dict(tf.tests), meta)


@PERTURBATIONS.register("layout")
def layout(tf: TaskFiles, rng: random.Random) -> TaskFiles | None:
    to_src = tf.meta["layout"] != "src"
    move = (lambda p: "src/" + p) if to_src else (lambda p: p.removeprefix("src/"))
    meta = copy.deepcopy(tf.meta)
    meta["layout"] = "src" if to_src else "flat"
    for key in ("bug_file", "entry_file"):
        meta[key] = move(meta[key])
    return TaskFiles({move(p): t for p, t in tf.repo.items()}, {move(p): t for p, t in tf.gold.items()},
                     dict(tf.tests), meta)


def _with_optional_backend(text: str, fname: str, backend: str) -> str:
    """``text`` with a guarded import of ``backend`` and, first thing in ``fname``, a call to it when present."""
    tree = ast.parse(text)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fname)
    a = fn.args
    call = [x.arg for x in a.posonlyargs + a.args] + ([f"*{a.vararg.arg}"] if a.vararg else [])
    call += [f"{x.arg}={x.arg}" for x in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    body0 = fn.body[1] if (isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
                           and len(fn.body) > 1) else fn.body[0]
    lines = text.splitlines(keepends=True)
    pad = " " * body0.col_offset
    dispatch = [f"{pad}if _accel is not None:  # the optional backend, when installed\n",
                f"{pad}    return _accel.{fname}({', '.join(call)})\n"]
    lines[body0.lineno - 1: body0.lineno - 1] = dispatch
    first = tree.body[0]
    at = first.end_lineno if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)) else 0
    guard = ["try:  # optional accelerated backend; the code below is the fallback\n",
             f"    import {backend} as _accel\n", "except ImportError:\n", "    _accel = None\n", "\n\n"]
    lines[at:at] = guard
    return "".join(lines)


@PERTURBATIONS.register("nodep")
def nodep(tf: TaskFiles, rng: random.Random) -> TaskFiles | None:
    m = tf.meta
    backend = f"_{(m['packages'] or [m['module']])[0]}_speedups"
    bug_file, fname = m["bug_file"], m["function"]
    repo, gold = dict(tf.repo), dict(tf.gold)
    repo[bug_file] = _with_optional_backend(repo[bug_file], fname, backend)
    gold[bug_file] = _with_optional_backend(gold[bug_file], fname, backend)
    meta = copy.deepcopy(m)
    meta["optional_dependency"] = backend
    return TaskFiles(repo, gold, dict(tf.tests), meta)


def variants(tf: TaskFiles, seed: int, kinds: list[str] | None = None) -> list[TaskFiles]:
    """One variant of ``tf`` per perturbation kind that applies (each marked with its origin)."""
    out = []
    for kind in kinds or PERTURBATIONS.names():
        v = PERTURBATIONS.get(kind)(tf, random.Random(f"{seed}:{kind}:{tf.hash}"))
        if v is None:
            continue
        v.meta.update(perturbation=kind, variant_of=tf.hash)
        out.append(v)
    return out
