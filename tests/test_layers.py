"""The package's layers, from the ground up (docs/architecture.md): a module may import its own layer
and any layer below it, never one above; and no import circle between files. Lazy imports inside
functions count. A new top-level module or package must be placed in LAYERS, or this test fails."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "arborl"

# bottom first; each entry is a set of top-level parts of the package (a module or a sub-package)
LAYERS: list[set[str]] = [
    {"types", "seeding", "registry", "heap", "failpoints"},  # records and ground-floor helpers
    {"config", "config_paths", "run_config"},  # the one pydantic config tree, its path knobs; a run directory's own config and its changes
    {"prefix", "scheduling", "rewards", "datapool", "report", "envs"},  # prefix tree, scheduling policies, reward math, storage, sandboxes
    {"models"},  # loading, the shared decoder forward
    {"engine", "train"},  # built-in engine + engine pool; samples, losses, packing, trainer
    {"gateway"},  # OpenAI-compatible server, sessions, recording
    {"agents"},  # white-box loops, black-box runner
    {"tasks"},  # task suites
    {"sim", "extensions", "workers", "cluster"},  # simulator, extensions, rollout workers, Ray
    {"run", "serve", "cli", "export", "show", "audit", "dashboard"},  # entry points (run: step loop, wiring, job, sft, run dir)
]


def _part(module: str) -> str | None:
    bits = module.split(".")
    return bits[1] if bits[0] == "arborl" and len(bits) > 1 else None


def _module_name(f: Path) -> str:
    rel = f.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(f: Path) -> list[tuple[str, int]]:
    """(imported arborl module, line) for every import in ``f``, relative ones resolved."""
    tree = ast.parse(f.read_text(), str(f))
    name = _module_name(f)
    base = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("arborl")]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            if mod.startswith("arborl"):
                out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def _graph() -> dict[str, list[tuple[str, int]]]:
    files = {_module_name(f): f for f in PKG.rglob("*.py")}
    graph = {}
    for name, f in files.items():
        deps = []
        for target, line in _imports(f):
            while target not in files and "." in target:  # "from arborl.x import name": the module is arborl.x
                target = target.rsplit(".", 1)[0]
            if target in files and target != name:
                deps.append((target, line))
        graph[name] = deps
    return graph


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.is_file() and p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    placed = set().union(*LAYERS)
    assert parts - placed == set(), "place these in LAYERS (tests/test_layers.py) and docs/architecture.md"
    assert placed - parts == set(), "LAYERS names parts that no longer exist"


def test_no_import_runs_up_the_layers():
    level = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    upward = []
    for name, deps in _graph().items():
        me = _part(name)
        for target, line in deps:
            other = _part(target)
            if me and other and level.get(other, -1) > level.get(me, -1):
                upward.append(f"{name}:{line} imports {target} (layer {level[other]} above {level[me]})")
    assert upward == []


def test_no_import_circle_between_files():
    graph = {k: {t for t, _ in v} for k, v in _graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checks above would catch a break: an upward import in a scratch file is reported."""
    f = PKG / "prefix" / "_layers_probe.py"
    f.write_text("from arborl.gateway.core import Gateway\n")
    try:
        try:
            test_no_import_runs_up_the_layers()
        except AssertionError as e:
            assert "arborl.prefix._layers_probe:1 imports arborl.gateway.core" in str(e)
        else:
            raise AssertionError("an upward import went unnoticed")
    finally:
        f.unlink()


def test_no_module_is_over_600_lines():
    """Small modules, one idea each (DESIGN.md section 8): a file past 600 lines holds more than one."""
    big = {str(f.relative_to(PKG)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > 600}
    assert not big, f"split these: {big}"
