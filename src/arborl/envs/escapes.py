"""A scripted adversarial agent: ways out of a sandbox, each with a host-side check that it failed.

Each attempt runs real commands in a fresh workspace of the runtime under test and then looks, from the
host, for evidence that it got out (a secret's marker in the output, a file written outside, a host
process dead, a connection accepted, a process still running after the timeout, ...). The tests
(tests/test_envs_escapes.py) and ``arborl bench envs`` run the same list; against ``rollout.envs.runtime=local``
most of them do get out, which is how the checks are known to see an escape.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from arborl.envs.base import Runtime, Workspace
from arborl.envs.workspace import tree_bytes

T = TypeVar("T")


@dataclass
class Outcome:
    name: str
    escaped: bool
    detail: str


@dataclass
class EscapeContext:
    """Host-side material the attempts aim at; made by ``make_context``."""

    runtime: Runtime
    work: Path  # a host directory for this run
    template: Path  # the task's template repository
    hidden: Path  # hidden tests; every file holds ``hidden_marker``
    secret: Path  # a host secret (e.g. a run directory's key); holds ``secret_marker``
    hidden_marker: str
    secret_marker: str

    @property
    def cfg(self):  # noqa: ANN201 - the runtime's EnvsConfig
        return getattr(self.runtime, "cfg")


def make_context(runtime: Runtime, work: Path) -> EscapeContext:
    work.mkdir(parents=True, exist_ok=True)
    hm, sm = f"HIDDEN-{secrets.token_hex(8)}", f"SECRET-{secrets.token_hex(8)}"
    template = work / "template"
    (template / "pkg").mkdir(parents=True, exist_ok=True)
    (template / "pkg" / "__init__.py").write_text("")
    (template / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (template / "README.md").write_text("fix add()\n")
    hidden = work / "hidden_tests"
    hidden.mkdir(exist_ok=True)
    (hidden / "test_calc.py").write_text(f"# {hm}\nfrom pkg.calc import add\n\ndef test_add():\n    assert add(2, 2) == 4\n")
    secret = work / "runs" / "run-1" / "api_key.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text(sm + "\n")
    return EscapeContext(runtime, work, template, hidden, secret, hm, sm)


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = Path(root) / f
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
            h.update(oct(p.stat().st_mode).encode())
    return h.hexdigest()


async def _ws(ctx: EscapeContext, name: str) -> Workspace:
    return await ctx.runtime.prepare(ctx.template, episode_id=f"escape-{name}-{secrets.token_hex(3)}")


async def _py(ctx: EscapeContext, ws: Workspace, src: str, **kw) -> str:  # noqa: ANN003
    r = await ctx.runtime.run(ws, ["python3", "-c", textwrap.dedent(src)], **kw)
    return r.stdout + r.stderr


# -- the attempts -------------------------------------------------------------------------------------


async def hidden_tests_by_path(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "hidden-path")
    try:
        out = await _py(ctx, ws, f"""
            import os
            for p in [{str(ctx.hidden)!r}, {str(ctx.hidden / 'test_calc.py')!r}, "hidden_tests", "../hidden_tests"]:
                try:
                    print(open(p).read() if os.path.isfile(p) else os.listdir(p))
                except Exception as e:
                    print(p, repr(e))
        """)
    finally:
        await ctx.runtime.close(ws)
    return Outcome("hidden_tests_by_path", ctx.hidden_marker in out, out[-300:])


_SCAN = """
import os, stat, sys
MARK = (sys.argv[1] + sys.argv[2]).encode()  # in halves: our own command line must not match
SKIP = {"/usr", "/sys", "/dev", "/proc/self", "/proc/thread-self", "/lib", "/lib64", "/bin", "/sbin"}
found = []
def grep(path, depth=0, budget=None):
    budget = budget if budget is not None else [5000]  # entries visited from one starting point
    budget[0] -= 1
    if depth > 6 or budget[0] < 0 or path in SKIP:
        return
    try:
        if os.path.islink(path) and depth > 0 and not path.startswith("/proc"):
            return
        if os.path.isdir(path):
            for n in sorted(os.listdir(path)):
                grep(os.path.join(path, n), depth + 1, budget)
        elif stat.S_ISREG(os.stat(path).st_mode):  # never a pipe or a device: reading one blocks
            with open(path, "rb") as f:
                if MARK in f.read(1 << 20):
                    print("FOUND", path, flush=True)
                    os._exit(0)
    except Exception:
        pass
"""


async def _while_evaluating(ctx: EscapeContext, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run ``attempt`` while another episode's evaluation (hidden tests in place) is running."""
    other = await _ws(ctx, "evaluated")
    ev = asyncio.ensure_future(ctx.runtime.evaluate(other, ctx.hidden, ["sleep", "3"], timeout_s=10))
    try:
        await asyncio.sleep(0.5)
        return await attempt()
    finally:
        await ev
        await ctx.runtime.close(other)


async def hidden_tests_via_proc(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "hidden-proc")
    src = _SCAN + """
pids = sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int, reverse=True)  # newest first
for pid in pids:  # the cheap places first: working directories, open files, environments
    grep(f"/proc/{pid}/cwd", 4, [500])
    for part in ("environ", "cmdline"):
        grep(f"/proc/{pid}/{part}", 5)
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            grep(f"/proc/{pid}/fd/{fd}", 5)
    except Exception:
        pass
for pid in pids:
    grep(f"/proc/{pid}/root/workspace", 3, [500])
    grep(f"/proc/{pid}/root", 3, [2000])
print("pids", len([p for p in os.listdir("/proc") if p.isdigit()]), "found", found)
"""
    try:
        r = await _while_evaluating(ctx, lambda: ctx.runtime.run(ws, ["python3", "-c", src, *_halves(ctx.hidden_marker)]))
    finally:
        await ctx.runtime.close(ws)
    out = r.stdout + r.stderr
    # a scan that never reported is counted as a way out: it cannot show that none was found
    return Outcome("hidden_tests_via_proc", "found []" not in out, f"exit {r.returncode}, killed {r.killed}: {out[-300:]}")


def _halves(marker: str) -> list[str]:
    return [marker[: len(marker) // 2], marker[len(marker) // 2 :]]


async def _run_text(ctx: EscapeContext, ws: Workspace, argv: list[str], **kw) -> str:  # noqa: ANN003
    r = await ctx.runtime.run(ws, argv, **kw)
    return r.stdout + r.stderr


async def hidden_tests_via_parents(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "hidden-parents")
    roots = ["..", "../..", "/", "/tmp", str(ctx.hidden.parent), str(Path(ctx.cfg.root_dir))]
    src = _SCAN + f"""
for r in {roots!r}:
    grep(r)
print("found", found)
"""
    try:
        out = await _while_evaluating(
            ctx, lambda: _run_text(ctx, ws, ["python3", "-c", src, *_halves(ctx.hidden_marker)]))
    finally:
        await ctx.runtime.close(ws)
    return Outcome("hidden_tests_via_parents", "found []" not in out, out[-300:])


async def write_outside_workspace(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "write-out")
    tag = f"escaped-{secrets.token_hex(4)}"
    targets = [Path("/") / tag, Path("/usr") / tag, Path("/etc") / tag, Path("/tmp") / tag, ctx.work / tag,
               Path(ctx.cfg.root_dir) / tag, ctx.template / tag, ctx.hidden / tag, ws.path.parent / tag]  # fmt: skip
    src = f"""
import os
for p in {[str(t) for t in targets] + ['../' + tag, '../../' + tag, '/proc/1/root/' + tag, '/proc/1/cwd/../' + tag]!r}:
    try:
        open(p, "w").write("x"); print("wrote", p)
    except Exception as e:
        print("refused", p, type(e).__name__)
"""
    before = _tree_hash(ctx.template)
    try:
        await _py(ctx, ws, src)
    finally:
        await ctx.runtime.close(ws)
    leaked = sorted({str(t) for t in targets if t.exists()})
    for t in leaked:
        Path(t).unlink(missing_ok=True)
    changed = _tree_hash(ctx.template) != before
    detail = f"host files written: {leaked}, template changed: {changed}"
    return Outcome("write_outside_workspace", bool(leaked) or changed, detail)


async def modify_template_through_workspace(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "template")
    before = _tree_hash(ctx.template)
    try:
        await ctx.runtime.run(ws, ["sh", "-c", "echo 'def add(a, b): return 4' > pkg/calc.py; rm README.md; "
                                   "chmod 000 pkg/__init__.py; ln -sf /etc/passwd link; mkdir new"])
    finally:
        await ctx.runtime.close(ws)
    changed = _tree_hash(ctx.template) != before
    return Outcome("modify_template_through_workspace", changed, f"template changed: {changed}")


class _TcpServer:
    """A host TCP server on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            c.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


_CONNECT = """
import socket, sys
ok = []
for host, port in [(h, int(p)) for h, p in (a.split(":") for a in sys.argv[1:])]:
    try:
        s = socket.create_connection((host, port), timeout=1.5); s.close(); ok.append(f"{host}:{port}")
    except Exception as e:
        print("blocked", host, port, type(e).__name__)
print("connected", ok)
"""


async def network_host_loopback(ctx: EscapeContext) -> Outcome:
    srv = _TcpServer()
    ws = await _ws(ctx, "net-loop")
    try:
        hosts = {"127.0.0.1", "localhost"}
        try:
            hosts |= {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
        except OSError:
            pass
        out = await _run_text(ctx, ws, ["python3", "-c", _CONNECT, *[f"{h}:{srv.port}" for h in sorted(hosts)]])
    finally:
        await ctx.runtime.close(ws)
        srv.close()
    return Outcome("network_host_loopback", srv.accepted > 0 or "connected []" not in out, out[-300:])


async def network_outside(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "net-out")
    src = _CONNECT.replace('print("connected", ok)', """
ifs = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
try:
    socket.getaddrinfo("example.com", 80); ok.append("dns")
except Exception:
    pass
print("interfaces", ifs)
print("connected", ok)
""")
    try:
        out = await _run_text(ctx, ws, ["python3", "-c", src, "1.1.1.1:80", "8.8.8.8:53"])
    finally:
        await ctx.runtime.close(ws)
    return Outcome("network_outside", "connected []" not in out or "interfaces ['lo']" not in out, out[-300:])


async def other_local_port_than_gateway(ctx: EscapeContext) -> Outcome:
    """With the gateway's Unix socket bound in, a host TCP port and a host abstract socket stay shut."""
    srv = _TcpServer()
    sock_dir = ctx.work / f"gw-{secrets.token_hex(3)}"
    sock_dir.mkdir()
    gw_path = sock_dir / "gateway.sock"
    gw = socket.socket(socket.AF_UNIX)
    gw.bind(str(gw_path))
    gw.listen(4)
    os.chmod(gw_path, 0o666)
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"\0arborl-escape-{secrets.token_hex(4)}"
    abstract.bind(abstract_name)
    abstract.listen(4)
    src = f"""
import socket
res = {{}}
for name, fam, addr in [("gateway", socket.AF_UNIX, {str(gw_path)!r}), ("abstract", socket.AF_UNIX, {abstract_name!r}),
                        ("tcp", socket.AF_INET, ("127.0.0.1", {srv.port}))]:
    s = socket.socket(fam); s.settimeout(1.5)
    try:
        s.connect(addr); res[name] = "open"
    except Exception as e:
        res[name] = type(e).__name__
print(res)
"""
    ws = await _ws(ctx, "ports")
    try:
        out = await _run_text(ctx, ws, ["python3", "-c", src], unix_sockets=[gw_path])
    finally:
        await ctx.runtime.close(ws)
        for s in (gw, abstract):
            s.close()
        srv.close()
    escaped = "'abstract': 'open'" in out or "'tcp': 'open'" in out or srv.accepted > 0
    return Outcome("other_local_port_than_gateway", escaped, out[-300:])


async def signal_host_process(ctx: EscapeContext) -> Outcome:
    victim = subprocess.Popen(["sleep", "1000"])
    ws = await _ws(ctx, "signal")
    try:
        out = await _run_text(ctx, ws, ["sh", "-c", f"kill -9 {victim.pid}; kill -9 -1; kill -STOP {victim.pid}; "
                                        f"python3 -c 'import os; os.kill({victim.pid}, 9)'; echo done"])
        await asyncio.sleep(0.2)
        alive = victim.poll() is None
        stopped = alive and open(f"/proc/{victim.pid}/stat").read().split(")")[1].split()[0] == "T"
    finally:
        await ctx.runtime.close(ws)
        victim.kill()
        victim.wait()
    return Outcome("signal_host_process", not alive or stopped, f"victim alive: {alive}, stopped: {stopped}; {out[-200:]}")


async def fork_bomb(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "forkbomb")
    cap = ctx.cfg.processes
    src = """
import os, time
n = 0
try:
    while n < 5000:
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        n += 1
except OSError as e:
    pass
print("forked", n)
"""
    try:
        t0 = time.perf_counter()
        out = await _run_text(ctx, ws, ["python3", "-c", src], timeout_s=8)
        out += await _run_text(ctx, ws, ["sh", "-c", "b() { b | b & }; b"], timeout_s=3)
        took = time.perf_counter() - t0
        host_ok = subprocess.run(["true"]).returncode == 0
    finally:
        await ctx.runtime.close(ws)
    forked = int(out.split("forked ")[1].split()[0]) if "forked " in out else -1
    escaped = forked < 0 or forked >= cap or took > 8 + 3 + 5 or not host_ok
    return Outcome("fork_bomb", escaped, f"forked {forked} (cap {cap}), both commands took {took:.1f}s, host forks: {host_ok}")


async def fill_disk(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "disk")
    cap = ctx.cfg.disk_mb * 1024 * 1024
    src = f"""
import os
chunk = b"x" * (1 << 20)
written = 0
for i in range({ctx.cfg.disk_mb * 3 // max(1, min(ctx.cfg.file_size_mb, ctx.cfg.disk_mb)) + 2}):
    try:
        with open(f"fill{{i}}", "wb") as f:
            for _ in range({min(ctx.cfg.file_size_mb, ctx.cfg.disk_mb) + 1}):
                f.write(chunk); written += len(chunk)
    except OSError as e:
        print(type(e).__name__, e.errno)
print("written", written)
"""
    try:
        out = await _run_text(ctx, ws, ["python3", "-c", src], timeout_s=20)
        held = tree_bytes(ws.path)
    finally:
        await ctx.runtime.close(ws)
    return Outcome("fill_disk", held > cap * 1.05, f"workspace holds {held >> 20} MiB (cap {cap >> 20} MiB); {out[-120:]}")


async def outlive_timeout(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "outlive")
    beat = ws.path / "beat"
    script = ("setsid sh -c 'while :; do date +%s%N > beat; sleep 0.1; done' </dev/null >/dev/null 2>&1 & "
              "nohup sh -c 'sleep 2.5; while :; do date +%s%N > beat2; sleep 0.1; done' >/dev/null 2>&1 & "
              "sleep 1000")  # fmt: skip
    try:
        r = await ctx.runtime.run(ws, ["sh", "-c", script], timeout_s=1.5)
        await asyncio.sleep(0.5)
        first = beat.read_text() if beat.exists() else ""
        await asyncio.sleep(1.5)
        later = beat.read_text() if beat.exists() else ""
        beat2 = (ws.path / "beat2").exists()
    finally:
        await ctx.runtime.close(ws)
    escaped = not r.timed_out or r.duration_s > 5 or first != later or beat2
    detail = f"timed out: {r.timed_out} after {r.duration_s:.1f}s; beat moved: {first != later}; late child ran: {beat2}"
    return Outcome("outlive_timeout", escaped, detail)


async def read_host_secrets(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "secrets")
    paths = [str(ctx.secret), str(ctx.secret.parent), "/etc/shadow", "/root/.bash_history", "/root/.ssh",
             "/root/.ssh/id_rsa", "/root", "/home", "/work/main/runs", "/proc/1/environ"]  # fmt: skip
    src = f"""
import os
for p in {paths!r}:
    try:
        print(p, open(p).read()[:2000] if os.path.isfile(p) else os.listdir(p))
    except Exception as e:
        print(p, type(e).__name__)
"""
    try:
        out = await _py(ctx, ws, src)
    finally:
        await ctx.runtime.close(ws)
    listed_root = "/root ['" in out.replace("/root ['.pyenv']", "")  # /root holds only the bound Python
    escaped = ctx.secret_marker in out or "root:" in out or "PRIVATE KEY" in out or listed_root
    return Outcome("read_host_secrets", escaped, out[-300:])


async def ptrace_processes(ctx: EscapeContext) -> Outcome:
    victim = subprocess.Popen(["sleep", "1000"])
    ws = await _ws(ctx, "ptrace")
    src = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
res = {{}}
for pid in [{victim.pid}, 1, os.getppid()]:
    r = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    res[pid] = "attached" if r == 0 else os.strerror(ctypes.get_errno())
print(res)
"""
    try:
        out = await _py(ctx, ws, src)
    finally:
        await ctx.runtime.close(ws)
        victim.kill()
        victim.wait()
    return Outcome("ptrace_processes", "attached" in out, out[-300:])


async def gain_privileges(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "privs")
    script = ("grep CapEff /proc/self/status; id -u; mkdir -p /tmp/m; "
              "mount -t tmpfs none /tmp/m 2>/dev/null && echo MOUNTED; "
              "echo 1 > /proc/sys/kernel/sysrq 2>/dev/null && echo SYSCTL; "
              "unshare -r true 2>/dev/null && echo USERNS_ROOT; true")  # fmt: skip
    try:
        out = await _run_text(ctx, ws, ["sh", "-c", script])
    finally:
        await ctx.runtime.close(ws)
    caps = out.split("CapEff:")[1].split()[0] if "CapEff:" in out else "?"
    # USERNS_ROOT (a nested user namespace) is allowed: root there owns only namespaces it made
    escaped = caps != "0000000000000000" or "MOUNTED" in out or "SYSCTL" in out or out.split("\n")[1:2] == ["0"]
    return Outcome("gain_privileges", escaped, out[-300:])


async def symlink_exfiltration(ctx: EscapeContext) -> Outcome:
    """Links the agent plants must not make the host (copying for evaluation) read or write for it."""
    ws = await _ws(ctx, "symlinks")
    target = ctx.work / f"host-target-{secrets.token_hex(3)}"
    target.write_text("untouched\n")
    name = ctx.hidden.name
    script = (f"ln -s {ctx.secret} leak; ln -s {ctx.secret.parent} leakdir; mkdir -p {name}; "
              f"ln -s {target} {name}/test_calc.py; ln -s {ctx.secret} {name}/conftest_data")  # fmt: skip
    try:
        await ctx.runtime.run(ws, ["sh", "-c", script])
        r = await ctx.runtime.evaluate(ws, ctx.hidden, ["sh", "-c", "cat leak leakdir/* " + name + "/conftest_data"])
        out = r.stdout + r.stderr
    finally:
        await ctx.runtime.close(ws)
    written = target.read_text() != "untouched\n"
    detail = f"host file overwritten: {written}; {out[-200:]}"
    return Outcome("symlink_exfiltration", ctx.secret_marker in out or written, detail)


ESCAPES: list[Callable[[EscapeContext], Awaitable[Outcome]]] = [
    hidden_tests_by_path,
    hidden_tests_via_proc,
    hidden_tests_via_parents,
    write_outside_workspace,
    modify_template_through_workspace,
    network_host_loopback,
    network_outside,
    other_local_port_than_gateway,
    signal_host_process,
    fork_bomb,
    fill_disk,
    outlive_timeout,
    read_host_secrets,
    ptrace_processes,
    gain_privileges,
    symlink_exfiltration,
]
# what these do when they get out would harm the host (`kill -9 -1` as root, a fork bomb, a mount,
# stopping a traced process):
# never run them where nothing contains them
UNSAFE_UNSANDBOXED = {signal_host_process, fork_bomb, gain_privileges, ptrace_processes}


async def run_escapes(runtime: Runtime, work: Path) -> list[Outcome]:
    """Every attempt in ``ESCAPES`` against ``runtime``, one after another (against the unsandboxed
    ``local`` runtime only those that are harmless when they succeed)."""
    ctx = make_context(runtime, work)
    unsafe = UNSAFE_UNSANDBOXED if runtime.name == "local" else set()
    return [await attempt(ctx) for attempt in ESCAPES if attempt not in unsafe]
