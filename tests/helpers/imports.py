"""What the face tests check of consumers: imports (and isinstance checks) of concrete classes."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "arborl"


def concrete_uses(consumers: list[str], concrete: set[str]) -> list[str]:
    """``file: name`` for each import of a class in ``concrete`` (and each isinstance against one) in the
    ``consumers`` (files or folders under src/arborl)."""
    files: list[Path] = []
    for c in consumers:
        p = SRC / c
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    bad = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                bad += [f"{f.relative_to(SRC)}: {a.name}" for a in node.names if a.name in concrete]
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) > 1:
                names = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])}
                bad += [f"{f.relative_to(SRC)}: isinstance(..., {n})" for n in sorted(names & concrete)]
    return bad
