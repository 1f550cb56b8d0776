"""Every non-Python file the package reads at run time ships in its wheel (pyproject's package-data)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_source_the_package_compiles_at_run_time_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = sorted((ROOT / "src").glob("arborl/**/csrc/*"))
    assert {f.suffix for f in files} >= {".c", ".cpp", ".h"}
    missing = []
    for f in files:
        package_dir = f.parent.parent
        package = ".".join(package_dir.relative_to(ROOT / "src").parts)
        name = str(f.relative_to(package_dir))
        if not any(fnmatch.fnmatch(name, pattern) for pattern in data.get(package, [])):
            missing.append(f"{package}: {name}")
    assert not missing, f"add to [tool.setuptools.package-data] in pyproject.toml: {missing}"
