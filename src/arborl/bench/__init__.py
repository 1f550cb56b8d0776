"""``arborl bench NAME [--quick]``: benchmarks that print a table and, last, one JSON line.

Each benchmark is a function ``run(quick: bool, console) -> dict`` registered by name; variants
are compared as ratios inside one run because the machine is shared and noisy.
"""

from __future__ import annotations

import importlib
from typing import Callable

# name -> "module:function", imported lazily so `arborl --help` stays fast
BENCHMARKS: dict[str, str] = {
    "engine": "arborl.bench.engine_bench:run",
    "gateway": "arborl.bench.gateway_bench:run",
    "tree-packing": "arborl.bench.tree_packing_bench:run",
    "scheduling": "arborl.bench.scheduling_bench:run",
    "vs-trl": "arborl.bench.vs_trl_bench:run",
    "envs": "arborl.bench.envs_bench:run",
    "backends": "arborl.bench.backends_bench:run",
    "specdec": "arborl.bench.specdec_bench:run",
    "credit": "arborl.bench.credit_bench:run",
    "cluster": "arborl.bench.cluster_bench:run",
    "parallel": "arborl.bench.parallel_bench:run",
}


def get_benchmark(name: str) -> Callable:
    if name not in BENCHMARKS:
        raise KeyError(name)
    module, func = BENCHMARKS[name].split(":")
    return getattr(importlib.import_module(module), func)
