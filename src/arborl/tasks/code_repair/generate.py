"""Instantiate bug templates into task files: a buggy repo, hidden tests, a gold patch, a statement.

Every draw comes from ``random.Random(f"{seed}:{template}:{index}")``, so the suite is the same for a
seed on every machine. A task is plain data (``TaskFiles``) until ``store.py`` writes it to disk; its id
is the hash of its content. Tiers:

* easy: one file, one function; the statement names the file, the function and the failing tests;
* medium: a package of 3 files; the tests call the public entry point in ``api``-like module, the bug
  is in another module; the statement names the entry point and the failing tests;
* hard: a package of 4 files; the statement says only the symptom.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from arborl.tasks.code_repair.templates import BUG_TEMPLATES, Bug, Check

TIERS = ("easy", "medium", "hard")
GENERATOR_VERSION = 1  # bump when generated content changes: the cache directory is keyed by it
TEST_FILE = "test_hidden.py"

_MODULES = ["stats", "textutil", "ledger", "inventory", "metrics", "scoring", "records", "calc", "reporting",
            "eventlog", "pricing", "gradebook", "tally", "catalog"]
_PACKAGES = ["shopkit", "datatools", "ledgerly", "metricsx", "textkit", "orderbook", "trackr", "gradekit",
             "stockpile", "scorecard", "wareflow", "notebin"]
_CORE = ["core", "engine", "logic", "compute", "ops", "impl"]
_API = ["api", "service", "public", "facade"]
_UTIL = ["util", "helpers", "common", "support"]

# correct helper functions that sit next to the buggy one in medium / hard repos
_DECOYS = {
    "chunked": '''def chunked(items, size):
    """Consecutive chunks of `size` items (the last may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
''',
    "first_or": '''def first_or(items, default=None):
    """The first item, or `default` for no items."""
    return items[0] if items else default
''',
    "flatten": '''def flatten(rows):
    """The items of a list of lists, in order."""
    return [x for row in rows for x in row]
''',
    "clip": '''def clip(x, low, high):
    """x limited to [low, high]."""
    return max(low, min(x, high))
''',
    "is_blank": '''def is_blank(text):
    """True for None, "" and whitespace-only text."""
    return text is None or not text.strip()
''',
    "dedupe": '''def dedupe(items):
    """The items without repeats, first occurrence kept."""
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
''',
}

# the hidden tests' own pytest config (scoring.py passes it with -c): import the repo from its root or src/
PYTEST_INI = "[pytest]\npythonpath = ../src ..\n"


class GenerationError(RuntimeError):
    """A template does not produce a valid task (a bug in the template, not in the caller's input)."""


@dataclass
class TaskFiles:
    """One task before it is written: relative path -> text for each part."""

    repo: dict[str, str]  # the buggy repository (no tests)
    gold: dict[str, str]  # the fixed versions of the files the gold patch changes
    tests: dict[str, str]  # the hidden tests
    meta: dict[str, Any] = field(default_factory=dict)  # template, tier, layout, names, statement facts

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for part in ("repo", "gold", "tests"):
            for path, text in sorted(getattr(self, part).items()):
                h.update(f"{part}/{path}\0{text}\0".encode())
        h.update(json.dumps(self.meta, sort_keys=True).encode())
        return h.hexdigest()

    def diff(self) -> str:
        """The gold patch as a unified diff against the buggy repo."""
        out = []
        for path, fixed in sorted(self.gold.items()):
            out += difflib.unified_diff(self.repo.get(path, "").splitlines(True), fixed.splitlines(True),
                                        f"a/{path}", f"b/{path}")
        return "".join(out)


class _Raises:
    """``pytest.raises`` for the in-process check at generation time (pytest need not be importable)."""

    @staticmethod
    @contextlib.contextmanager
    def raises(exc: type[BaseException]):
        try:
            yield
        except exc:
            return
        raise AssertionError(f"did not raise {exc.__name__}")


def _module_code(bug: Bug, fname: str, buggy: bool, decoys: list[str]) -> str:
    fixed = bug.code.replace("$f", fname)
    if buggy:
        old, new = bug.bug
        if fixed.count(old) != 1:
            raise GenerationError(f"template {bug.kind}: the bug fragment {old!r} must occur once in its code")
        fixed = fixed.replace(old, new)
    parts = ["\n".join(bug.imports) + "\n"] if bug.imports else []
    parts += [_DECOYS[d] for d in decoys[:1]] + ([bug.helpers] if bug.helpers else []) + [fixed]
    parts += [_DECOYS[d] for d in decoys[1:]]
    return "\n\n".join(parts)


def _test_body(check: Check, fname: str, namespace: dict[str, Any] | None) -> str:
    """The body of one hidden test; the expected value comes from the fixed code in ``namespace``."""
    if check.body is not None:
        return check.body.replace("$f", fname)
    call = f"{fname}({check.args})"
    if check.raises:
        return f"    with pytest.raises({check.raises}):\n        {call}\n"
    expected = eval(call, dict(namespace or {}))  # noqa: S307 - our own template code, at generation time
    return f"    assert {call} == {expected!r}\n"


def _run_checks(code: str, tests: dict[str, str], fname: str) -> dict[str, bool]:
    """Run the test bodies against ``code`` in-process, in order and in one module as pytest does (state a
    test leaves, e.g. in a mutable default, is seen by the next): test name -> passed."""
    out = {}
    ns: dict[str, Any] = {"pytest": _Raises}
    exec(compile(code, "<task>", "exec"), ns)  # noqa: S102 - our own template code
    for name, body in tests.items():
        try:
            exec(f"def {name}():\n{body}", ns)  # noqa: S102
            ns[name]()
            out[name] = True
        except Exception:  # noqa: BLE001 - any failure is a failing test
            out[name] = False
    return out


def make_task(template: str, seed: int, index: int, tier: str) -> TaskFiles:
    """Task number ``index`` of ``template`` in ``tier`` for ``seed``."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
    rng = random.Random(f"{seed}:{template}:{index}:{tier}")
    bug = BUG_TEMPLATES.get(template)(rng)
    fname = rng.choice(bug.names)
    src = rng.random() < 0.5  # a src/ layout or the root
    prefix = "src/" if src else ""
    n_decoys = {"easy": 0, "medium": 2, "hard": 2}[tier]
    decoys = rng.sample(sorted(_DECOYS), n_decoys)

    fixed_code = _module_code(bug, fname, False, decoys)
    buggy_code = _module_code(bug, fname, True, decoys)
    ns: dict[str, Any] = {}
    exec(compile(fixed_code, "<fixed>", "exec"), ns)  # noqa: S102 - our own template code
    bodies = {c.name: _test_body(c, fname, ns) for c in bug.checks}
    fixed_ok, buggy_ok = _run_checks(fixed_code, bodies, fname), _run_checks(buggy_code, bodies, fname)
    if not all(fixed_ok.values()):
        raise GenerationError(f"template {template}: the fixed code fails {[k for k, v in fixed_ok.items() if not v]}")
    failing = [k for k, v in buggy_ok.items() if not v]
    if not failing:
        raise GenerationError(f"template {template}: no test fails on the buggy code")

    meta: dict[str, Any] = {"template": template, "tier": tier, "function": fname, "failing_tests": failing,
                            "tests": list(bodies), "symptom": bug.symptom, "phrasing": rng.randrange(3)}
    if tier == "easy":
        mod = rng.choice(_MODULES)
        bug_path = f"{prefix}{mod}.py"
        repo = {bug_path: buggy_code}
        gold = {bug_path: fixed_code}
        import_line = f"from {mod} import {fname}"
        meta.update(layout="src" if src else "flat", module=mod, bug_file=bug_path, entry=f"{mod}.{fname}",
                    entry_file=bug_path, packages=[], modules=[mod])
    else:
        pkg, core, api = rng.choice(_PACKAGES), rng.choice(_CORE), rng.choice(_API)
        base = f"{prefix}{pkg}/"
        bug_path, api_path = f"{base}{core}.py", f"{base}{api}.py"
        doc = bug.code.split('"""')[1]
        api_code = (f'"""The public functions of {pkg}."""\n\nfrom {pkg} import {core} as _impl\n\n\n'
                    f'def {fname}(*args, **kwargs):\n    """{doc}"""\n    return _impl.{fname}(*args, **kwargs)\n')
        repo = {f"{base}__init__.py": f'"""{pkg}: small helpers."""\n\nfrom {pkg}.{api} import {fname}\n\n__all__ = ["{fname}"]\n',
                api_path: api_code, bug_path: buggy_code}
        modules = [core, api]
        if tier == "hard":
            util = rng.choice(_UTIL)
            extra = rng.sample(sorted(set(_DECOYS) - set(decoys)), 2)
            repo[f"{base}{util}.py"] = "\n\n".join(_DECOYS[d] for d in extra)
            modules.append(util)
        gold = {bug_path: fixed_code}
        import_line = f"from {pkg} import {fname}"
        meta.update(layout="src" if src else "flat", package=pkg, bug_file=bug_path, entry=f"{pkg}.{fname}",
                    entry_file=api_path, packages=[pkg], modules=modules)
    test_src = (f'"""Hidden tests of task {template}/{tier}/{index}."""\n\nimport pytest\n\n{import_line}\n\n\n'
                + "\n\n".join(f"def {name}():\n{body}" for name, body in bodies.items()))
    return TaskFiles(repo=repo, gold=gold, tests={"pytest.ini": PYTEST_INI, TEST_FILE: test_src}, meta=meta)


def generate(seed: int, per_template: int) -> list[TaskFiles]:
    """``per_template`` tasks of every template (tiers in turn); duplicates (same hash) and draws whose values
    hide the bug are skipped."""
    out, seen = [], set()
    for template in BUG_TEMPLATES.names():
        index = 0
        made = 0
        while made < per_template:
            if index > 20 * per_template:
                raise GenerationError(f"template {template} cannot make {per_template} distinct, valid tasks")
            try:
                tf = make_task(template, seed, index, TIERS[index % len(TIERS)])
            except GenerationError:  # this draw's values hide the bug (no test fails): draw again
                index += 1
                continue
            index += 1
            if tf.hash in seen:
                continue
            seen.add(tf.hash)
            out.append(tf)
            made += 1
    return out
