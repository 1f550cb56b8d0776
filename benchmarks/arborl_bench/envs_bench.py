"""``arborl bench envs``: what a sandboxed episode costs, and that the sandbox holds.

Sections (each a function ``(quick, console) -> dict`` in ``SECTIONS``; a new part is one more):

1. start: prepare (fresh copy of a 12-file template) + one trivial command + close, one after another:
   ``sandbox_start_p50_ms`` / ``_p99_ms``, and each part's p50 (prepare, command, close) next to a bare
   ``bwrap true`` so bubblewrap's own start is visible; ``start_cpu_ms_mean`` is the CPU time one such
   episode costs (this process and its children), which does not grow with the machine's load as wall
   time does (``load_average_1m`` is reported beside it). The same episode with the syscall filter off
   (``rollout.envs.seccomp=false``), interleaved one for one, gives ``start_seccomp_off_p50_ms`` and
   ``seccomp_start_overhead_ms`` (the median of the paired differences: what the filter adds).
2. throughput: 16 episodes at once (prepare, two commands, close): ``sandbox_episodes_per_s``.
3. copy modes: making a workspace from a small (12 files) and a larger (600 files, ~5 MB) template with
   each ``rollout.envs.copy_mode`` (copy, cp), and for comparison an overlay mount (copy-on-write; root only)
   and hard links (unsafe: an agent's write would change the template): ``copy_<mode>_<size>_ms``.
4. escapes: the scripted adversarial agent of ``arborl_bench.escapes`` against the sandbox:
   ``escape_attempts``, ``escapes`` (goal 0), ``escaped`` (names).
5. concurrency sweep: 16, 64 and 256 sandboxes at once, each running a short agent command (a Python
   program that writes a file, reports in to the bench over a bound unix socket and waits there until
   every sandbox of its wave has reported in, so all of them are live together; where the host cannot
   hold that many, until the others wait in the runtime's queue). Per wave:
   ``sandbox_start_failures_<n>``, ``sandbox_start_p50_ms_<n>`` / ``_p99_ms_<n>`` (prepare until the
   agent runs in its sandbox, queue waits included), ``sandbox_queue_waits_<n>`` (starts that waited for
   the host: a uid, processes, descriptors, memory) and ``sandbox_queue_wait_max_ms_<n>``; after the sweep
   ``sandbox_leftovers`` (goal 0: processes, mounts, held uids, workspaces, /dev/shm files;
   ``envs/leftovers.py``) and ``sandbox_leftovers_by_kind``.
6. code repair: the task suite's validation figures (``benchmarks/arborl_bench/envs_tasks_bench.py``).
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from arborl.config import EnvsConfig
from arborl.envs import make_runtime
from arborl.envs.bwrap import check_bwrap
from arborl.envs.leftovers import leftovers, shm_files
from arborl_bench.escapes import run_escapes
from arborl.envs.workspace import copy_tree, copy_with_cp, mount_tmpfs, remove_tree, unmount
from arborl_bench.figures import figure_table

CONCURRENCY = 16
SWEEP = (16, 64, 256)
SWEEP_UID_BASE = 64000  # its own uids, apart from the default pool's, so its leftover count is its own
# the sweep's agent: writes in its workspace, reports in over the bound socket, waits for the wave's go
SWEEP_AGENT = (
    "import os, socket, sys; open('note.txt', 'w').write('x'); s = socket.socket(socket.AF_UNIX); "
    "s.connect(sys.argv[1]); s.sendall(os.environ['SWEEP_I'].encode() + b'\\n'); "
    "assert s.recv(1) == b'g'; print(len(os.listdir('.')))"
)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def make_template(root: Path, files: int, file_bytes: int = 300) -> Path:
    """A small Python repository of ``files`` files in a few packages."""
    t = root / f"template-{files}"
    for i in range(files):
        p = t / f"pkg{i % 4}" / f"mod{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text((f"def f{i}(x):\n    return x + {i}\n" * (file_bytes // 30 + 1))[:file_bytes])
    return t


def _cfg(root: Path, **kw) -> EnvsConfig:  # noqa: ANN003
    return EnvsConfig(root_dir=str(root / "envs"), **kw)


def section_start(quick: bool, console: Console) -> dict:
    with tempfile.TemporaryDirectory(prefix="arborl-bench-envs-") as d:
        return _section_start(quick, Path(d))


def _section_start(quick: bool, work: Path) -> dict:
    rt = make_runtime(_cfg(work))
    rt_off = make_runtime(_cfg(work, seccomp=False))
    tpl = make_template(work, 12)
    n = 40 if quick else 200
    total, prep, cmd, close = [], [], [], []
    off, paired = [], []

    cpu = []

    def cpu_s() -> float:  # this process and its waited-for children: CPU time does not queue behind load
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    async def episode(runtime, name: str) -> tuple[float, float, float, float]:  # noqa: ANN001
        """prepare, command and close times (s) of one episode, and its CPU time."""
        c0 = cpu_s()
        t0 = time.perf_counter()
        ws = await runtime.prepare(tpl, episode_id=name)
        t1 = time.perf_counter()
        r = await runtime.run(ws, ["true"])
        t2 = time.perf_counter()
        await runtime.close(ws)
        t3 = time.perf_counter()
        assert r.returncode == 0, r
        return t1 - t0, t2 - t1, t3 - t2, cpu_s() - c0

    async def go() -> None:
        for i in range(n + 3):
            # the filter on and off one after the other, in alternating order, so drift hits both alike
            first_on = i % 2 == 0
            a = await episode(rt if first_on else rt_off, f"start-{i}-a")
            b = await episode(rt_off if first_on else rt, f"start-{i}-b")
            on_, off_ = (a, b) if first_on else (b, a)
            if i >= 3:  # warm-up
                p_, c_, cl_, cpu_ = on_
                total.append(p_ + c_ + cl_), prep.append(p_), cmd.append(c_), close.append(cl_), cpu.append(cpu_)
                off.append(sum(off_[:3])), paired.append(total[-1] - off[-1])

    asyncio.run(go())
    bare = []
    bwrap = check_bwrap("bwrap")
    argv = [bwrap, "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--unshare-pid",
            "--unshare-net", "--die-with-parent", "--", "true"]  # fmt: skip
    for _ in range(n // 2):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True)
        bare.append(time.perf_counter() - t0)
    ms = 1000.0
    return {
        "sandbox_start_p50_ms": round(_pct(total, 0.5) * ms, 2),
        "sandbox_start_p99_ms": round(_pct(total, 0.99) * ms, 2),
        "start_prepare_p50_ms": round(_pct(prep, 0.5) * ms, 2),
        "start_command_p50_ms": round(_pct(cmd, 0.5) * ms, 2),
        "start_close_p50_ms": round(_pct(close, 0.5) * ms, 2),
        "start_seccomp_off_p50_ms": round(_pct(off, 0.5) * ms, 2),
        "seccomp_start_overhead_ms": round(statistics.median(paired) * ms, 2),
        "bare_bwrap_true_p50_ms": round(_pct(bare, 0.5) * ms, 2),
        "start_cpu_ms_mean": round(statistics.mean(cpu) * ms, 2),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "start_samples": n,
    }


def section_throughput(quick: bool, console: Console) -> dict:
    with tempfile.TemporaryDirectory(prefix="arborl-bench-envs-") as d:
        return _section_throughput(quick, Path(d))


def _section_throughput(quick: bool, work: Path) -> dict:
    rt = make_runtime(_cfg(work))
    tpl = make_template(work, 12)
    n = 64 if quick else 320
    sem = asyncio.Semaphore(CONCURRENCY)
    failures = []

    async def episode(i: int) -> None:
        async with sem:
            ws = await rt.prepare(tpl, episode_id=f"tp-{i}")
            try:
                a = await rt.run(ws, ["sh", "-c", "echo 'x = 1' >> pkg0/mod0.py"])
                b = await rt.run(ws, ["cat", "pkg0/mod0.py"])
                if a.returncode or b.returncode:
                    failures.append(i)
            finally:
                await rt.close(ws)

    async def go() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(episode(i) for i in range(n)))
        return time.perf_counter() - t0

    took = asyncio.run(go())
    return {
        "sandbox_episodes_per_s": round(n / took, 1),
        "throughput_episodes": n,
        "throughput_concurrency": CONCURRENCY,
        "throughput_failures": len(failures),
    }


def section_sweep(quick: bool, console: Console) -> dict:
    with tempfile.TemporaryDirectory(prefix="arborl-bench-envs-") as d:
        return _section_sweep(Path(d))


def _section_sweep(work: Path) -> dict:
    rt = make_runtime(_cfg(work, sandbox_uid_base=SWEEP_UID_BASE))
    tpl = make_template(work, 12)
    shm_before = shm_files()
    out: dict = {"sandbox_sweep": list(SWEEP)}
    reasons: list[str] = []
    for n in SWEEP:
        out.update(asyncio.run(_wave(rt, tpl, n, work / f"wave-{n}.sock", reasons)))
    left = leftovers(rt, shm_before)
    out["sandbox_leftovers"] = sum(left.values())
    out["sandbox_leftovers_by_kind"] = left
    out["sandbox_start_failure_reasons"] = sorted(set(reasons))[:5]
    return out


async def _wave(rt, tpl: Path, n: int, sock: Path, reasons: list[str]) -> dict:  # noqa: ANN001
    """``n`` sandboxes at once, each until all have reported in; their start times and failures."""
    t0 = time.perf_counter()
    up: dict[int, float] = {}  # sandbox -> when its agent reported in
    ended: set[int] = set()  # sandboxes whose command ended (or never began)
    go = asyncio.Event()

    def check() -> None:
        # go once every sandbox has reported in, ended, or waits in the runtime's queue: where the host
        # cannot hold n at once, those running end and make room for the queued ones
        if len(up.keys() | ended) + rt.queue.waiting >= n:
            go.set()

    async def watch_queue() -> None:  # the queue's waiters do not report in: look at them now and then
        while not go.is_set():
            check()
            await asyncio.sleep(0.05)

    async def report_in(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up[int(await reader.readline())] = time.perf_counter()
            check()
            await go.wait()
            writer.write(b"g")
            await writer.drain()
        except (ConnectionError, ValueError):  # its sandbox was killed first: counted as its failure
            pass
        finally:
            writer.close()

    async def sandbox(i: int) -> tuple[bool, float]:
        """Whether sandbox ``i`` started, ran its agent and closed, and how long it queued."""
        waited, ws = 0.0, None
        try:
            ws = await rt.prepare(tpl, episode_id=f"sweep-{n}-{i}")
            waited = float(ws.extra.get("queue_wait_s", 0.0))
            res = await rt.run(ws, ["python", "-c", SWEEP_AGENT, str(sock)], env={"SWEEP_I": str(i)},
                               unix_sockets=[sock], timeout_s=120)
            waited += res.queued_s
            if res.returncode != 0:
                reasons.append(f"exit {res.returncode} ({res.killed}): {res.stderr.strip()[-300:]}")
            ok = res.returncode == 0 and i in up
        except Exception as e:  # noqa: BLE001 - a start failure, counted and named
            reasons.append(f"{type(e).__name__}: {e}"[:300])
            ok = False
        ended.add(i)
        check()
        try:
            if ws is not None:
                await rt.close(ws)
        except Exception as e:  # noqa: BLE001
            reasons.append(f"close: {type(e).__name__}: {e}"[:300])
            ok = False
        return ok, waited

    server = await asyncio.start_unix_server(report_in, path=str(sock), backlog=n)
    os.chmod(sock, 0o666)  # the sandbox's own uid connects to it
    watcher = asyncio.ensure_future(watch_queue())
    try:
        results = await asyncio.gather(*(sandbox(i) for i in range(n)))
    finally:
        go.set()
        await watcher
        server.close()
        await server.wait_closed()
        sock.unlink(missing_ok=True)
    starts = sorted(up[i] - t0 for i, (ok, _) in enumerate(results) if ok)
    waits = [w for _, w in results]
    ms = 1000.0
    return {
        f"sandbox_start_failures_{n}": sum(not ok for ok, _ in results),
        f"sandbox_start_p50_ms_{n}": round(_pct(starts, 0.5) * ms, 1) if starts else None,
        f"sandbox_start_p99_ms_{n}": round(_pct(starts, 0.99) * ms, 1) if starts else None,
        f"sandbox_queue_waits_{n}": sum(w > 0 for w in waits),
        f"sandbox_queue_wait_max_ms_{n}": round(max(waits) * ms, 1),
        f"sandbox_sweep_wall_s_{n}": round(time.perf_counter() - t0, 2),
    }


def _overlay(tpl: Path, dst: Path, scratch: Path) -> Callable[[], None]:
    upper, workdir = scratch / "upper", scratch / "work"
    upper.mkdir()
    workdir.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={tpl},upperdir={upper},workdir={workdir}", str(dst)], check=True)  # fmt: skip
    return lambda: unmount(dst)


def section_copy_modes(quick: bool, console: Console) -> dict:
    with tempfile.TemporaryDirectory(prefix="arborl-bench-envs-") as d:
        return _section_copy_modes(quick, Path(d))


def _section_copy_modes(quick: bool, work: Path) -> dict:
    reps = 15 if quick else 60
    out: dict[str, float] = {}
    is_root = os.geteuid() == 0
    for size, files, nbytes in (("small", 12, 300), ("large", 600, 8000)):
        tpl = make_template(work, files, nbytes)
        modes: dict[str, Callable[[Path, Path], Callable[[], None] | None]] = {
            "copy": lambda d, s: (copy_tree(tpl, d, uid=None), None)[1],
            "cp": lambda d, s: copy_with_cp(tpl, d, uid=None),
            "hardlink_unsafe": lambda d, s: (subprocess.run(["cp", "-al", f"{tpl}/.", str(d)], check=True), None)[1],
        }
        if is_root:
            modes["overlay"] = lambda d, s: _overlay(tpl, d, s)
        for mode, make in modes.items():
            times = []
            for i in range(reps):
                base = work / f"cm-{size}-{mode}-{i}"
                dst, scratch = base / "ws", base / "scratch"
                dst.mkdir(parents=True)
                scratch.mkdir()
                if is_root:
                    mount_tmpfs(scratch, size_mb=64, uid=None)
                    if mode != "hardlink_unsafe":  # hard links cannot cross into a tmpfs
                        mount_tmpfs(dst, size_mb=64, uid=None)
                try:
                    t0 = time.perf_counter()
                    undo = make(dst, scratch)
                    times.append(time.perf_counter() - t0)
                    if undo:
                        undo()
                finally:
                    unmount(dst)
                    unmount(scratch)
                    remove_tree(base)
            out[f"copy_{mode}_{size}_ms"] = round(statistics.median(times) * 1000, 3)
    return out


def section_escapes(quick: bool, console: Console) -> dict:
    with tempfile.TemporaryDirectory(prefix="arborl-bench-envs-") as d:
        return _section_escapes(quick, Path(d))


def _section_escapes(quick: bool, work: Path) -> dict:
    rt = make_runtime(_cfg(work, disk_mb=16, file_size_mb=8, processes=32, tmp_mb=8, wall_s=20))
    outcomes = asyncio.run(run_escapes(rt, work / "escapes"))
    return {
        "escape_attempts": len(outcomes),
        "escapes": sum(o.escaped for o in outcomes),
        "escaped": [o.name for o in outcomes if o.escaped],
    }


def section_code_repair(quick: bool, console: Console) -> dict:
    """The task suite's figures (validated tasks, drops): benchmarks/arborl_bench/envs_tasks_bench.py."""
    from arborl_bench.envs_tasks_bench import code_repair_section

    return code_repair_section(quick, console)


def section_episodes(quick: bool, console: Console) -> dict:
    """Real SmolLM2 code-repair episodes, white-box and black-box: benchmarks/arborl_bench/envs_episodes_bench.py."""
    from arborl_bench.envs_episodes_bench import episodes_section

    return episodes_section(quick, console)


def section_training(quick: bool, console: Console) -> dict:
    """Held-out success of the code-repair job before SFT, after SFT and after RL (--quick: its recorded run)."""
    from arborl_bench.envs_episodes_bench import training_section

    return training_section(quick, console)


# each section: (quick, console) -> figures; a new part of the bench is one more function here
SECTIONS: list[Callable[[bool, Console], dict]] = [
    section_start,
    section_throughput,
    section_copy_modes,
    section_escapes,
    section_sweep,
    section_code_repair,
    section_episodes,
    section_training,
]


def run(quick: bool, console: Console) -> dict:
    results: dict = {}
    for section in SECTIONS:
        t0 = time.perf_counter()
        results.update(section(quick, console))
        console.print(f"[dim]{section.__name__}: {time.perf_counter() - t0:.1f}s[/dim]")
    console.print(figure_table("arborl bench envs" + (" (quick)" if quick else ""), results))
    return results
