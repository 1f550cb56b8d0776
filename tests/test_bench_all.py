"""``arborl bench all``: each benchmark run in its own process and recorded with its machine; the headline
figures' median and spread; README's figures block rendered from the record (docs_figures)."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

import docs_figures
from arborl_bench import BENCHMARKS
from arborl_bench.all_bench import Attempt, appended, bench_entry, kept_entries, machine, run_process
from arborl_bench.figures import HEADLINES, lookup, spread, summarize
from arborl.cli import app

ROOT = Path(__file__).resolve().parents[1]
HAS_TRL = importlib.util.find_spec("trl") is not None
# gateway --quick is the cheapest benchmark that runs (about a minute here); vs-trl without TRL fails at once,
# for a real reason (its JSON says "trl not installed"), and runs first so the test sees the next one go on
ONLY = "gateway" if HAS_TRL else "vs-trl,gateway"
KEPT = {"command": "arborl bench engine --quick", "date": "2000-01-01T00:00:00+00:00", "ok": True, "error": None,
        "wall_s": [1.0], "load_before": [0.1], "load_after": [0.2], "figures": {}, "raw": {}}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One real ``arborl bench all --quick --only ...`` into a record that already holds an engine entry."""
    out = tmp_path_factory.mktemp("figures") / "figures.json"
    out.write_text(json.dumps({"machine": machine(), "benches": {"engine": KEPT, "gateway": {"stale": True}}}))
    argv = [sys.executable, "-m", "arborl.cli", "bench", "all", "--quick", "--only", ONLY, "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"record": json.loads(out.read_text()), "stdout": proc.stdout, "stderr": proc.stderr, "out": out}


# -- (a) a real benchmark, in its own process, recorded with the machine ----------------------------------
@pytest.mark.slow
def test_bench_all_records_a_real_benchmark_with_its_machine(run: dict) -> None:
    rec = run["record"]
    assert rec["command"].endswith(f"bench all --quick --only {ONLY} --out {run['out']}")
    assert rec["quick"] is True and rec["repeats"] == 1 and rec["date"].endswith("+00:00")
    m = rec["machine"]
    assert m["cores"] >= 1 and m["memory_gib"] > 0 and m["cpu"]
    assert m["load_before"] >= 0 and m["load_after"] >= 0
    flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    isa = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    assert m["isa"] == {f: f in flags for f in isa}
    v = rec["versions"]
    assert v["torch"] == metadata.version("torch") and v["transformers"] == metadata.version("transformers")
    assert "vllm" in v and v["python"] == ".".join(map(str, sys.version_info[:3]))

    gw = rec["benches"]["gateway"]
    assert gw["ok"] and gw["error"] is None and gw["exit_codes"] == [0]
    assert gw["command"] == "arborl bench gateway --quick"
    assert len(gw["wall_s"]) == len(gw["load_before"]) == len(gw["load_after"]) == 1 and gw["wall_s"][0] > 1
    assert gw["raw"]["bench"] == "gateway" and gw["raw"]["quick"] is True  # the benchmark's own last-line JSON
    p50 = gw["figures"]["overhead p50"]
    assert p50["values"] == [gw["raw"]["overhead_p50_ms"]] and p50["median"] == p50["values"][0]
    assert p50["spread"] == 0.0 and p50["unit"] == "ms" and p50["key"] == "overhead_p50_ms"
    assert gw["figures"]["calls lost"]["values"] == [0.0]
    # --only kept the other entry of the record (same machine) and replaced the rerun one
    assert rec["benches"]["engine"] == KEPT and "stale" not in gw
    assert json.loads(run["stdout"].strip().splitlines()[-1])["ok"] == ["gateway"]
    assert "  | " in run["stderr"]  # the benchmark's progress was shown as it ran


# -- (b) a benchmark that cannot run is recorded with its error; the others still run -----------------------
@pytest.mark.slow
@pytest.mark.skipif(HAS_TRL, reason="TRL is installed here: vs-trl would run for real (minutes), not fail")
def test_a_benchmark_that_cannot_run_is_recorded_and_the_next_runs(run: dict) -> None:
    trl = run["record"]["benches"]["vs-trl"]
    assert not trl["ok"] and "trl not installed" in trl["error"] and "pip install -e .[bench]" in trl["error"]
    assert trl["raw"]["error"] == "trl not installed"
    assert all(f["values"] == [] and f["median"] is None for f in trl["figures"].values())
    assert run["record"]["benches"]["gateway"]["ok"]  # ran after it
    assert json.loads(run["stdout"].strip().splitlines()[-1])["failed"] == ["vs-trl"]


def test_a_crashed_or_silent_process_is_a_failure_with_its_stderr() -> None:
    seen: list[str] = []
    crash = run_process([sys.executable, "-c", "import sys; print('loading', file=sys.stderr); "
                         "print('Boom: no model here', file=sys.stderr); sys.exit(3)"], seen.append)
    assert crash.exit_code == 3 and crash.output is None and seen == ["loading", "Boom: no model here"]
    assert crash.error.startswith("exit status 3") and crash.error.endswith("Boom: no model here")
    silent = run_process([sys.executable, "-c", "print('a table, no JSON')"])
    assert silent.exit_code == 0 and "no JSON object" in silent.error
    fine = run_process([sys.executable, "-c", "print('table'); print('{\"x\": 1}')"])
    assert fine.error is None and fine.output == {"x": 1} and fine.wall_s >= 0


def test_a_benchmark_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """The whole process group goes (a bench's vLLM server or Ray workers with it); the run is a failure
    that says so. The child reports its grandchild's pid before it hangs: no clock decides the verdict."""
    pid_file = tmp_path / "grandchild.pid"
    hang = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', file=sys.stderr, flush=True); time.sleep(600)")
    a = run_process([sys.executable, "-c", hang], timeout_s=15)
    assert a.error.startswith("timed out after 15 s (killed)") and "started" in a.error and a.output is None
    grandchild = int(pid_file.read_text())
    for _ in range(200):  # reaped by init shortly after the kill
        if not Path(f"/proc/{grandchild}").exists() or " Z " in Path(f"/proc/{grandchild}/stat").read_text():
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the benchmark's child {grandchild} outlived the timeout")


def test_unknown_names_and_misplaced_options_are_clear_errors(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    r = CliRunner().invoke(app, ["bench", "all", "--only", "gateway,nope", "--out", str(out)])
    assert r.exit_code == 2 and "unknown benchmark(s) in --only: nope" in r.output and not out.exists()
    r = CliRunner().invoke(app, ["bench", "gateway", "--repeats", "2"])
    assert r.exit_code == 2 and "options of `arborl bench all`" in r.output
    assert "all" not in BENCHMARKS and "all:" in CliRunner().invoke(app, ["bench", "--help"]).output.replace("\n", " ")


def test_a_record_of_another_machine_is_not_merged(tmp_path: Path) -> None:
    other = {**machine(), "cpu": "some other CPU"}
    out = tmp_path / "f.json"
    out.write_text(json.dumps({"machine": other, "benches": {"engine": KEPT}}))
    said: list[str] = []
    assert kept_entries(out, ["gateway"], machine(), said.append) == {} and "another machine" in said[0]
    out.write_text(json.dumps({"machine": machine(), "benches": {"engine": KEPT, "gateway": {}}}))
    assert kept_entries(out, ["gateway"], machine(), said.append) == {"engine": KEPT}


# -- (c) the arithmetic of repeats ---------------------------------------------------------------------------
def test_spread_and_median_over_repeats() -> None:
    assert spread([1.0, 1.2, 1.1]) == pytest.approx(0.2 / 1.1)
    assert spread([5.0]) == 0.0 and spread([0.0, 0.0]) == 0.0 and spread([]) is None
    assert spread([-1.0, 0.0, 1.0]) is None  # differs around a median of 0: no relative spread
    assert spread([-2.0, -1.0]) == pytest.approx(1 / 1.5)
    figs = summarize("tree-packing", [{"speedup_80": 5.0}, {"speedup_80": 6.0, "speedup_35": 1.3}, {"speedup_80": 5.5}])
    assert figs["80% shared"]["values"] == [5.0, 6.0, 5.5] and figs["80% shared"]["median"] == 5.5
    assert figs["80% shared"]["spread"] == pytest.approx(1 / 5.5) and figs["80% shared"]["unit"] == "x"
    assert figs["35% shared"] == {"key": "speedup_35", "values": [1.3], "median": 1.3, "spread": 0.0, "unit": "x",
                                  "row": "tree packing"}
    assert figs["multi-turn"]["values"] == [] and figs["multi-turn"]["median"] is None
    # nested keys (JSON turns the batch sizes into strings); a bool or a string is not a figure
    assert lookup({"tail_decode_speedup_by_batch": {"1": 1.7}}, ("tail_decode_speedup_by_batch", "1")) == 1.7
    assert lookup({"valid": True}, ("valid",)) is None and lookup({"vllm": "skipped"}, ("vllm",)) is None


def test_a_benchmark_entry_over_repeats() -> None:
    ok = [Attempt(0, 60.0 + i, 1.0, 1.5, {"speedup_80": v}, None) for i, v in enumerate((5.0, 6.0))]
    bad = Attempt(1, 3.0, 1.5, 1.6, None, "exit status 1: Traceback ...\nMemoryError")
    e = bench_entry("tree-packing", [ok[0], bad, ok[1]], quick=True, date="2026-01-01T00:00:00+00:00")
    assert e["repeats"] == 3 and not e["ok"] and e["error"].endswith("MemoryError") and e["exit_codes"] == [0, 1, 0]
    assert e["wall_s"] == [60.0, 3.0, 61.0] and e["load_before"] == [1.0, 1.5, 1.0]
    assert e["figures"]["80% shared"]["values"] == [5.0, 6.0] and e["raw"] == {"speedup_80": 6.0}


def test_an_appended_run_adds_its_values_to_the_earlier_invocations() -> None:
    """`bench all --append`: a rerun's values join the record's, so median and spread cover both runs."""
    first = bench_entry("tree-packing", [Attempt(0, 60.0, 1.0, 1.2, {"speedup_80": 5.0}, None)], quick=True,
                        date="2026-01-01T00:00:00+00:00")
    second = bench_entry("tree-packing", [Attempt(0, 62.0, 1.2, 1.4, {"speedup_80": 6.0, "speedup_35": 1.3}, None)],
                         quick=True, date="2026-01-02T00:00:00+00:00")
    both = appended(first, second)
    assert both["repeats"] == 2 and both["ok"] and both["wall_s"] == [60.0, 62.0] and both["load_after"] == [1.2, 1.4]
    assert both["dates"] == ["2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00"]
    assert both["figures"]["80% shared"]["values"] == [5.0, 6.0] and both["figures"]["80% shared"]["median"] == 5.5
    assert both["figures"]["80% shared"]["spread"] == pytest.approx(1 / 5.5)
    assert both["figures"]["35% shared"]["values"] == [1.3] and both["raw"] == {"speedup_80": 6.0, "speedup_35": 1.3}
    failed = bench_entry("tree-packing", [Attempt(1, 3.0, 1.0, 1.0, None, "exit status 1: boom")], quick=True, date="d")
    assert not appended(first, failed)["ok"] and appended(first, failed)["figures"]["80% shared"]["values"] == [5.0]


def test_headline_table_names_registered_benchmarks_with_unique_labels() -> None:
    assert set(HEADLINES) == set(BENCHMARKS)
    for name, figs in HEADLINES.items():
        assert len({f.label for f in figs}) == len(figs), name


# -- (d) README's block from a record -------------------------------------------------------------------------
def _record() -> dict:
    return {
        "command": "arborl bench all --quick --repeats 3", "date": "2026-01-02T03:04:05+00:00", "quick": True,
        "repeats": 3,
        "machine": {"cpu": "AMD EPYC", "isa": {"avx2": True, "avx512f": True, "amx_tile": False}, "cores": 2,
                    "memory_gib": 23.5, "load_before": 0.5, "load_after": 2.1},
        "versions": {"python": "3.11.7", "arborl": "0.1.0", "torch": "2.13.0", "transformers": "5.2", "vllm": None},
        "benches": {
            "vs-trl": {"command": "arborl bench vs-trl --quick", "date": "2026-01-02T03:05:00+00:00", "ok": False,
                       "error": "trl not installed (pip install -e .[bench])", "wall_s": [4.0, 4.0, 5.0],
                       "load_before": [0.5, 0.6, 0.6], "load_after": [0.6, 0.6, 0.7], "figures": {}, "raw": {}},
            "tree-packing": {
                "command": "arborl bench tree-packing --quick", "date": "2025-12-01T00:00:00+00:00", "ok": True,
                "error": None, "wall_s": [300.0, 320.0, 310.0], "load_before": [1.0, 1.1, 1.2],
                "load_after": [1.9, 2.0, 2.1], "raw": {},
                "figures": summarize("tree-packing", [{"speedup_80": v, "speedup_35": 1.3} for v in (5.0, 6.0, 5.5)])},
        },
    }


def test_docs_figures_renders_the_block_and_check_catches_a_stale_readme(tmp_path: Path) -> None:
    block = docs_figures.render_block(_record())
    assert ("**Machine:** AMD EPYC, AVX2 AVX-512F, 2 cores, 23.5 GiB; load 0.5 → 2.1; torch 2.13.0, "
            "vLLM not installed") in block
    assert "`arborl bench all --quick --repeats 3`" in block
    rows = [ln for ln in block.splitlines() if ln.startswith("| tree-packing") or ln.startswith("| vs-trl")]
    assert rows[0].startswith(
        "| tree-packing | `arborl bench tree-packing --quick` | 80% shared 5.5× (spread ±18%, n=3)")
    assert "35% shared 1.3× (spread ±0%, n=3); multi-turn n/a" in rows[0]
    assert rows[0].endswith("| 310 s (median of 3); load 1.0 → 2.1; 2025-12-01T00:00:00+00:00 |")  # another day
    assert rows[1] == ("| vs-trl | `arborl bench vs-trl --quick` | **failed:** trl not installed "
                       "(pip install -e .[bench]) | 4 s (median of 3); load 0.5 → 0.7 |")

    record, readme = tmp_path / "figures.json", tmp_path / "README.md"
    record.write_text(json.dumps(_record()))
    readme.write_text("# x\n\n<!-- figures:begin -->\nold\n<!-- figures:end -->\n\nhand-written\n")
    args = ["--record", str(record), "--readme", str(readme)]
    assert docs_figures.main([*args, "--check"]) == 1
    assert docs_figures.main(args) == 0
    text = readme.read_text()
    assert "old" not in text and "80% shared 5.5×" in text and text.endswith("<!-- figures:end -->\n\nhand-written\n")
    assert docs_figures.main([*args, "--check"]) == 0
    changed = copy.deepcopy(_record())
    changed["benches"]["tree-packing"]["figures"]["80% shared"]["median"] = 5.6
    record.write_text(json.dumps(changed))
    assert docs_figures.main([*args, "--check"]) == 1 and readme.read_text() == text  # --check writes nothing
    readme.write_text("# no markers\n")
    assert docs_figures.main(args) == 2
    assert docs_figures.main(["--record", str(tmp_path / "absent.json"), "--readme", str(readme)]) == 2


def test_a_skipped_part_is_said_beside_its_figures() -> None:
    entry = {"command": "arborl bench engine --quick", "ok": True, "wall_s": [90.0], "load_before": [1.0],
             "load_after": [1.0], "figures": summarize("engine", [{"engine_vs_hf_tokens_per_s": 2.5}]),
             "raw": {"vllm": "skipped: vLLM is not installed (no .venv-vllm/bin/python)"}}
    row = docs_figures.bench_row("engine", entry, None)
    assert "vs vLLM fixed lengths n/a" in row and "vs transformers natural 2.5× (n=1)" in row
    assert "(vLLM column skipped: vLLM is not installed (no .venv-vllm/bin/python))" in row


# -- (e) the real README against the real record ---------------------------------------------------------------
def test_readme_figures_block_matches_the_record() -> None:
    record = ROOT / "docs" / "figures.json"
    if not record.is_file():
        pytest.skip("docs/figures.json is absent: `make figures` (arborl bench all --quick) writes it")
    assert docs_figures.main(["--record", str(record), "--readme", str(ROOT / "README.md"), "--check"]) == 0, \
        "README's figures block is stale: run `python scripts/docs_figures.py`"
