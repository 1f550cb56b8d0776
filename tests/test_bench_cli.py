"""`arborl bench`: the benchmarks live outside the product package (benchmarks/arborl_bench) and are loaded
through the registry, so a user's own benchmark runs by path and a missing install says what to do."""

from __future__ import annotations

import json
import sys

from typer.testing import CliRunner

from arborl.cli import app


def test_a_benchmark_of_your_own_runs_by_path_and_prints_its_json_last(tmp_path):
    bench = tmp_path / "my_bench.py"
    bench.write_text("def run(quick, console):\n    console.print('my table')\n    return {'quick': quick, 'x': 1}\n")
    r = CliRunner().invoke(app, ["bench", f"{bench}:run", "--quick"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"quick": True, "x": 1}

    bad = CliRunner().invoke(app, ["bench", f"{bench}:nope"])
    assert bad.exit_code == 2 and "has no attribute 'nope'" in bad.output
    unknown = CliRunner().invoke(app, ["bench", "no-such-bench"])
    assert unknown.exit_code == 2 and "unknown benchmark 'no-such-bench'" in unknown.output and "tree-packing" in unknown.output


def test_without_the_benchmarks_installed_the_cli_says_how_to_install_them(monkeypatch):
    import arborl_bench

    assert not hasattr(sys.modules["arborl"], "bench")  # the product package holds no benchmark code
    assert "src/arborl" not in arborl_bench.__file__
    monkeypatch.setitem(sys.modules, "arborl_bench", None)  # `import arborl_bench` now fails as if not installed
    r = CliRunner().invoke(app, ["bench", "engine", "--quick"])
    assert r.exit_code == 2 and "pip install -e '.[bench]'" in r.output and "benchmarks/" in r.output
