"""Render README's measured-figures table from docs/figures.json: ``python scripts/docs_figures.py``.

Rewrites the block between ``<!-- figures:begin -->`` and ``<!-- figures:end -->`` in README.md from the
record ``arborl bench all`` writes (``make figures`` does both); ``--check`` exits 1 when the block is
stale instead of writing it. The record's format: benchmarks/arborl_bench/all_bench.py; what a spread means: docs/figures.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from arborl_bench import BENCHMARKS
from arborl_bench.figures import caveats

BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
UNITS = {"x": "×", "ms": " ms", "s": " s", "tok/s": " tok/s", "eps/s": " episodes/s", "frac": "", "count": "",
         "tokens": " tokens"}
ISA_SHOWN = {"avx2": "AVX2", "avx512f": "AVX-512F", "avx512_bf16": "AVX512-BF16", "avx512_vnni": "AVX512-VNNI",
             "amx_tile": "AMX-TILE", "amx_bf16": "AMX-BF16"}


def _num(v: float, unit: str) -> str:
    text = str(int(v)) if unit == "count" and v == int(v) else f"{v:.3g}"
    if unit == "tokens" and v > 0:
        text = "+" + text
    return text + UNITS.get(unit, f" {unit}")


def figure_cell(label: str, fig: dict[str, Any]) -> str:
    """``label median (spread ±x%, n=N)``; ``n=1`` alone for a single value; n/a when it was not measured."""
    values = fig.get("values") or []
    if fig.get("median") is None:
        return f"{label} n/a"
    if len(values) == 1:
        return f"{label} {_num(fig['median'], fig['unit'])} (n=1)"
    sp = fig.get("spread")
    sp_text = "spread n/a" if sp is None else f"spread ±{100 * sp:.0f}%"
    return f"{label} {_num(fig['median'], fig['unit'])} ({sp_text}, n={len(values)})"


def machine_line(record: dict[str, Any]) -> str:
    m, v = record["machine"], record.get("versions", {})
    isa = " ".join(ISA_SHOWN.get(k, k) for k, on in m.get("isa", {}).items() if on) or "none of AVX2/AVX-512/AMX"
    load = f"load {m.get('load_before')} → {m.get('load_after')}"
    return (f"**Machine:** {m.get('cpu')}, {isa}, {m.get('cores')} cores, {m.get('memory_gib')} GiB; {load}; "
            f"torch {v.get('torch')}, vLLM {v.get('vllm') or 'not installed'}, transformers {v.get('transformers')}, "
            f"arborl {v.get('arborl')}; {record.get('date')}; `{record.get('command')}`.")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def bench_row(name: str, b: dict[str, Any], record_date: str | None) -> str:
    walls = b.get("wall_s") or []
    wall = f"{statistics.median(walls):.0f} s" if walls else "-"
    if len(walls) > 1:
        wall += f" (median of {len(walls)})"
    loads = f"load {b['load_before'][0]} → {b['load_after'][-1]}" if b.get("load_before") else ""
    when = b.get("date", "")
    wall_cell = wall + (f"; {loads}" if loads else "") + (f"; {when}" if when[:10] != (record_date or "")[:10] else "")
    if b.get("ok"):
        figs = "; ".join(figure_cell(label, f) for label, f in b.get("figures", {}).items()) or "(no headline figures)"
    else:
        last = (b.get("error") or "failed").strip().splitlines()[-1]
        figs = "**failed:** " + (last if len(last) <= 200 else last[:197] + "...")
    notes = caveats(name, b.get("raw"))
    if notes:
        figs += " (" + "; ".join(notes) + ")"
    return f"| {name} | `{b.get('command', '')}` | {_cell(figs)} | {_cell(wall_cell)} |"


def render_block(record: dict[str, Any]) -> str:
    """The README text between the markers (without them), generated from ``record``."""
    order = {n: i for i, n in enumerate(BENCHMARKS)}
    names = sorted(record.get("benches", {}), key=lambda n: (order.get(n, len(order)), n))
    lines = [
        "",
        "Generated from [docs/figures.json](docs/figures.json) by `make figures`",
        "([docs/figures.md](docs/figures.md)): medians over repeats, spread = (max − min) / median.",
        "",
        machine_line(record),
        "",
        "| bench | command | headline figures | wall time |",
        "|---|---|---|---|",
        *[bench_row(n, record["benches"][n], record.get("date")) for n in names],
        "",
    ]
    return "\n".join(lines)


def rewrite(readme: str, block: str) -> str:
    """``readme`` with the text between the markers replaced by ``block``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {BEGIN} ... {END} block")
    return readme[: start + len(BEGIN)] + "\n\n" + block.strip("\n") + "\n\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/docs_figures.py", description=__doc__.splitlines()[0])
    p.add_argument("--record", type=Path, default=Path("docs/figures.json"), help="the record (arborl bench all)")
    p.add_argument("--readme", type=Path, default=Path("README.md"), help="the file with the markers")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when the block differs from the record's; write nothing")
    args = p.parse_args(argv)
    if not args.record.is_file():
        print(f"no record at {args.record}: run `make figures` (arborl bench all --quick)", file=sys.stderr)
        return 2
    try:
        record = json.loads(args.record.read_text())
    except ValueError as e:
        print(f"{args.record} is not JSON ({e}): rerun `arborl bench all`", file=sys.stderr)
        return 2
    readme = args.readme.read_text()
    try:
        new = rewrite(readme, render_block(record))
    except ValueError as e:
        print(f"{args.readme}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != readme:
            print(f"{args.readme} is stale: its figures block differs from {args.record}; run "
                  "`python scripts/docs_figures.py`", file=sys.stderr)
            return 1
        return 0
    if new != readme:
        args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
