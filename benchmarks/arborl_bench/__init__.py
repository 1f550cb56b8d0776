"""``arborl bench NAME [--quick]``: benchmarks that print a table and, last, one JSON line.

Each benchmark is a function ``run(quick: bool, console) -> dict`` registered by name; variants
are compared as ratios inside one run because the machine is shared and noisy.
"""

from __future__ import annotations

from typing import Callable

from arborl.registry import load_object

# name -> "module:function", imported lazily so `arborl --help` stays fast
BENCHMARKS: dict[str, str] = {
    "engine": "arborl_bench.engine_bench:run",
    "gateway": "arborl_bench.gateway_bench:run",
    "tree-packing": "arborl_bench.tree_packing_bench:run",
    "scheduling": "arborl_bench.scheduling_bench:run",
    "vs-trl": "arborl_bench.vs_trl_bench:run",
    "envs": "arborl_bench.envs_bench:run",
    "backends": "arborl_bench.backends_bench:run",
    "specdec": "arborl_bench.specdec_bench:run",
    "credit": "arborl_bench.credit_bench:run",
    "cluster": "arborl_bench.cluster_bench:run",
    "parallel": "arborl_bench.parallel_bench:run",
    "memory": "arborl_bench.memory_bench:run",
    "progress": "arborl_bench.progress_bench:run",
    "faults": "arborl_bench.faults_bench:run",
}


def get_benchmark(name: str) -> Callable:
    """The ``run`` function of benchmark ``name``, or of a ``module:attr`` / ``file.py:attr`` path (a user's
    own benchmark); KeyError for an unknown name, RegistryError for a path that does not load."""
    if name in BENCHMARKS:
        return load_object(BENCHMARKS[name])
    if ":" in name:
        return load_object(name)
    raise KeyError(name)
