"""A scripted adversarial agent: ways out of a sandbox, each with a host-side check that it failed.

Each attempt runs real commands in a fresh workspace of the runtime under test and then looks, from the
host, for evidence that it got out (a secret's marker in the output, a file written outside, a host
process dead, a connection accepted, a process still running after the timeout, ...). The tests
(tests/test_envs_escapes.py) and ``arborl bench envs`` run the same list; against ``rollout.envs.runtime=local``
most of them do get out, which is how the checks are known to see an escape.

Besides file system, network, process and resource escapes, the list holds the kernel's shared state:
the job's session keyring (read a key the host holds, plant one the next episode reads), a pooled uid's
keyrings outliving its episode, ``/proc`` files a container runtime makes read-only or hides, and the
system calls of Docker's default seccomp list (new user namespaces, io_uring, perf events, userfaultfd,
ptrace, personality, other ABIs): each probe reports what the kernel allowed, and one that never reports
counts as a way out.

``python -m arborl_bench.escapes WORK_DIR [ENVS_ROOT]`` runs the list against the bwrap runtime and prints one
JSON line (the tests run it as a non-root user that way).
"""

from __future__ import annotations

import ast
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

from arborl.envs import keyrings
from arborl.envs.base import InfraError, Runtime, Workspace
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
        r = await ctx.runtime.run(ws, ["python3", "-c", src], timeout_s=20)
        held = tree_bytes(ws.path)
    finally:
        await ctx.runtime.close(ws)
    out = r.stdout + r.stderr
    # as root the workspace is a tmpfs of disk_mb; as another user its size is checked after each command,
    # which is then reported killed="disk_limit" (and the episode's workspace is deleted at close)
    escaped = held > cap * 1.05 and not (ws.extra.get("disk_cap") == "check" and r.killed == "disk_limit")
    return Outcome("fill_disk", escaped, f"workspace holds {held >> 20} MiB (cap {cap >> 20} MiB), killed: {r.killed}; "
                   f"{out[-120:]}")


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


def _checkout() -> Path:
    """The directory holding this checkout of arborl (its ``benchmarks/``), or the installed package's parent."""
    here = Path(__file__).resolve().parents[1]
    return here.parent if here.name == "benchmarks" else here


def _host_secret_paths(ctx: EscapeContext) -> list[str]:
    """Places a host keeps secrets in, computed on this host: the run's key, the home directory's history and
    SSH keys, the run directories of the working directory and of this checkout, pid 1's environment."""
    home = Path.home()
    paths = [ctx.secret, ctx.secret.parent, Path("/etc/shadow"), home / ".bash_history", home / ".ssh",
             home / ".ssh" / "id_rsa", home, Path("/home"), Path.cwd() / "runs", _checkout() / "runs",
             _checkout(), Path("/proc/1/environ")]  # fmt: skip
    return list(dict.fromkeys(str(p) for p in paths))


def _home_listing_allowed() -> set[str]:
    """Entries of the home directory the sandbox may show: those on the way to the bound Python."""
    from arborl.envs.bwrap import _python_dirs

    home = Path.home()
    return {d.relative_to(home).parts[0] for d in _python_dirs() if d.is_relative_to(home) and d != home}


def _listing(text: str) -> set[str]:
    """The names of a printed ``os.listdir`` list (never evaluated as code); unparsable counts as one name."""
    try:
        names = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return {text}
    return {str(n) for n in names} if isinstance(names, list) else {text}


async def read_host_secrets(ctx: EscapeContext) -> Outcome:
    ws = await _ws(ctx, "secrets")
    paths = _host_secret_paths(ctx)
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
    home = str(Path.home())
    listed = [line[len(home) + 1:] for line in out.splitlines() if line.startswith(home + " [")]
    listed_home = any(_listing(entries) - _home_listing_allowed() for entries in listed)
    escaped = ctx.secret_marker in out or "root:" in out or "PRIVATE KEY" in out or listed_home
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


# -- the kernel's shared state: keyrings ---------------------------------------------------------------

# system calls from inside, through ctypes (the sandbox has Python, not keyutils' library)
_KEYS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def arg(a):
    return ctypes.c_long(a) if isinstance(a, int) else a if isinstance(a, ctypes.Array) else ctypes.c_char_p(a)
def sys_(nr, *a):
    r = libc.syscall(ctypes.c_long(nr), *map(arg, a))
    return (r, 0) if r >= 0 else (r, ctypes.get_errno())
def keyctl(*a):
    return sys_(250, *a)
def add_key(desc, payload, ring):
    return sys_(248, b"user", desc, payload, len(payload), ring)
def read_key(ring, desc):
    kid, e = keyctl(10, ring, b"user", desc, 0)  # KEYCTL_SEARCH
    if kid < 0:
        return f"search: {os.strerror(e)}"
    buf = ctypes.create_string_buffer(1 << 16)
    n, e = keyctl(11, kid, buf, 1 << 16)  # KEYCTL_READ
    return buf.raw[:n].decode("utf-8", "replace") if n >= 0 else f"read: {os.strerror(e)}"
"""


class _HostSessionKeyring:
    """The job's session keyring as systemd, a pod or ``pam_keyinit`` gives one: this thread joins a new named
    session keyring (children inherit it) holding a secret key; afterwards its keys are unlinked."""

    def __init__(self, ctx: EscapeContext) -> None:
        self.name = f"arborl-escape-{secrets.token_hex(4)}".encode()
        keyrings.join_new_session_keyring(self.name)
        self.secret_desc = f"arborl-escape-secret-{secrets.token_hex(4)}".encode()
        keyrings.add_key(b"user", self.secret_desc, ctx.secret_marker.encode(), keyrings.KEY_SPEC_SESSION_KEYRING)

    def has(self, desc: bytes) -> bool:
        try:
            keyrings.keyctl(keyrings.KEYCTL_SEARCH, keyrings.KEY_SPEC_SESSION_KEYRING, b"user", desc, 0)
            return True
        except keyrings.KeyringError:
            return False

    def close(self) -> None:
        keyrings.keyctl(keyrings.KEYCTL_CLEAR, keyrings.KEY_SPEC_SESSION_KEYRING)


async def keyring_host_session_read(ctx: EscapeContext) -> Outcome:
    """A key the job holds in its session keyring (a secret) must not be readable inside."""
    host = _HostSessionKeyring(ctx)
    ws = await _ws(ctx, "keys-read")
    try:
        out = await _py(ctx, ws, _KEYS + f"print('read', read_key(-3, {host.secret_desc!r}))")
    finally:
        await ctx.runtime.close(ws)
        host.close()
    return Outcome("keyring_host_session_read", ctx.secret_marker in out, out[-300:])


async def keyring_host_session_write(ctx: EscapeContext) -> Outcome:
    """A key planted in the session keyring must reach neither the job's keyring nor a later episode."""
    host = _HostSessionKeyring(ctx)
    desc, payload = f"planted-{secrets.token_hex(4)}".encode(), f"PLANTED-{secrets.token_hex(6)}"
    first, second = await _ws(ctx, "keys-write"), await _ws(ctx, "keys-write-next")
    try:
        wrote = await _py(ctx, first, _KEYS + f"print('add', add_key({desc!r}, {payload.encode()!r}, -3))")
        in_host = host.has(desc)
        read = await _py(ctx, second, _KEYS + f"print('read', read_key(-3, {desc!r}))")
    finally:
        for ws in (first, second):
            await ctx.runtime.close(ws)
        host.close()
    detail = f"in the job's keyring: {in_host}; wrote: {wrote[-120:]}; the next episode read: {read[-150:]}"
    return Outcome("keyring_host_session_write", in_host or payload in read, detail)


async def keyring_uid_outlives_episode(ctx: EscapeContext) -> Outcome:
    """Hidden tests stashed in the evaluation uid's keyrings (@u, @us, persistent) must not reach the next
    episode that runs as that uid (as root the uid goes back to the pool; otherwise it is the job's own).
    An evaluation that never says its uid counts as a way out: it cannot show the stash went nowhere."""
    desc = f"stash-{secrets.token_hex(4)}".encode()
    stash = _KEYS + f"""
text = open("{ctx.hidden.name}/test_calc.py", "rb").read()
p, _ = keyctl(22, -1, -3)  # the uid's persistent keyring, linked into the session keyring
print("uid", os.getuid(), [add_key({desc!r}, text, ring) for ring in (-4, -5, p)])
"""
    read = _KEYS + f"""
p, _ = keyctl(22, -1, -3)
print("uid", os.getuid(), [read_key(ring, {desc!r}) for ring in (-4, -5, p)])
"""
    for _ in range(3):  # another workspace may draw the released uid first: then evaluate again
        ws = await _ws(ctx, "keys-uid")
        try:
            r = await ctx.runtime.evaluate(ws, ctx.hidden, ["python3", "-c", stash])
        finally:
            await ctx.runtime.close(ws)
        fields = r.stdout.split("uid ", 1)[1].split() if "uid " in r.stdout else ["?"]
        if not fields[0].isdigit():
            return Outcome("keyring_uid_outlives_episode", True, f"the evaluation said no uid: {(r.stdout + r.stderr)[-200:]}")
        runtime = ctx.runtime
        if getattr(ctx.runtime, "drop_uid", False):  # root: a runtime whose pool is that one uid
            runtime = type(ctx.runtime)(ctx.cfg.model_copy(update={"sandbox_uid_base": int(fields[0]), "sandbox_uids": 1}))
        try:
            later = await runtime.prepare(ctx.template, episode_id=f"escape-keys-uid-next-{secrets.token_hex(3)}")
        except InfraError:
            continue
        try:
            res = await runtime.run(later, ["python3", "-c", read])
        finally:
            await runtime.close(later)
        out = res.stdout + res.stderr
        return Outcome("keyring_uid_outlives_episode", ctx.hidden_marker in out or f"uid {fields[0]} " not in out,
                       f"evaluation: {(r.stdout + r.stderr)[-150:]}; later episode: {out[-200:]}")
    raise InfraError("keyring_uid_outlives_episode: the evaluation's uid was drawn by another workspace three times")


async def keyring_calls(ctx: EscapeContext) -> Outcome:
    """The keyring system calls themselves (add_key, request_key, keyctl other than joining a fresh
    session keyring) reach the kernel's keyrings: refused inside."""
    ws = await _ws(ctx, "keys-calls")
    src = _KEYS + """
res = {"add_key": add_key(b"mine", b"x", -2), "request_key": sys_(249, b"user", b"mine", 0, -2),  # -2: its own
       "describe": keyctl(6, -3, ctypes.create_string_buffer(256), 256), "user_keyring": keyctl(0, -4, 0)}
print("allowed", sorted(k for k, (r, e) in res.items() if r >= 0), res, "DONE")
"""
    try:
        out = await _py(ctx, ws, src)
    finally:
        await ctx.runtime.close(ws)
    return Outcome("keyring_calls", "allowed []" not in out or "DONE" not in out, out[-300:])


async def proc_keys_lists_host_keys(ctx: EscapeContext) -> Outcome:
    """/proc/keys lists the keys a process may view, the job's session keys among them: masked inside."""
    host = _HostSessionKeyring(ctx)
    ws = await _ws(ctx, "proc-keys")
    try:
        out = await _run_text(ctx, ws, ["sh", "-c", "cat /proc/keys /proc/key-users; echo DONE"])
    finally:
        await ctx.runtime.close(ws)
        host.close()
    return Outcome("proc_keys_lists_host_keys", host.secret_desc.decode() in out, out[-300:])


# -- evaluation and /proc ---------------------------------------------------------------------------------


async def hidden_tests_keep_agent_files(ctx: EscapeContext) -> Outcome:
    """Files the agent left in the hidden tests' directory (another name than the tests') must not be in
    the evaluation copy: the hidden tests replace the directory."""
    ws = await _ws(ctx, "hidden-merge")
    name = ctx.hidden.name
    try:
        await ctx.runtime.run(ws, ["sh", "-c", f"mkdir -p {name} && echo 'def test_agent(): pass' > {name}/test_agent.py"
                                   f" && echo x > {name}/agent_note.txt"])
        r = await ctx.runtime.evaluate(ws, ctx.hidden, ["sh", "-c", f"ls -a {name}; echo DONE"])
    finally:
        await ctx.runtime.close(ws)
    out = r.stdout + r.stderr
    return Outcome("hidden_tests_keep_agent_files", "test_agent.py" in out or "agent_note" in out or "DONE" not in out,
                   out[-300:])


async def proc_sys_writable(ctx: EscapeContext) -> Outcome:
    """/proc/sys, /proc/sysrq-trigger and friends are read-only mounts inside, as in container runtimes."""
    ws = await _ws(ctx, "proc-sys")
    src = """
import os
rw = []
for p in ["/proc/sys", "/proc/sys/kernel", "/proc/sys/net", "/proc/sys/vm", "/proc/sysrq-trigger", "/proc/fs",
          "/proc/irq", "/proc/bus"]:
    if os.path.exists(p) and not os.statvfs(p).f_flag & os.ST_RDONLY:
        rw.append(p)
print("writable mounts", rw, "DONE")
"""
    try:
        out = await _py(ctx, ws, src)
    finally:
        await ctx.runtime.close(ws)
    return Outcome("proc_sys_writable", "writable mounts []" not in out, out[-300:])


async def proc_kernel_files(ctx: EscapeContext) -> Outcome:
    """/proc files a container runtime hides (timers and scheduler state of the whole machine, kernel
    memory, every uid's key quota) read as empty inside."""
    ws = await _ws(ctx, "proc-hidden")
    src = """
import os
seen = {}
for name in ["timer_list", "sched_debug", "key-users", "keys", "kcore", "latency_stats"]:
    try:
        with open("/proc/" + name, "rb") as f:
            seen[name] = len(f.read(4096))
    except OSError as e:
        seen[name] = e.strerror
print("non-empty", sorted(k for k, v in seen.items() if isinstance(v, int) and v > 0), seen, "DONE")
"""
    try:
        out = await _py(ctx, ws, src)
    finally:
        await ctx.runtime.close(ws)
    return Outcome("proc_kernel_files", "non-empty []" not in out, out[-300:])


# -- system calls of Docker's default seccomp list ------------------------------------------------------

# each probe prints "ALLOWED <what>" for a call the kernel carried out, then DONE; one that never says DONE
# (crashed, killed) counts as a way out: it cannot show that the calls were refused
_SYS = _KEYS + """
import mmap, signal, struct, time
def report(what, r, e):
    print(("ALLOWED " if r >= 0 else "refused ") + what, r, os.strerror(e) if e else "", flush=True)
def in_child(nr, *a):  # a clone-like call: the child leaves at once
    r, e = sys_(nr, *a)
    if r == 0:
        os._exit(0)
    if r > 0:
        os.waitpid(r, 0)
    return r, e
"""


async def _probe(ctx: EscapeContext, name: str, body: str) -> Outcome:
    ws = await _ws(ctx, name.replace("_", "-"))
    try:
        out = await _py(ctx, ws, _SYS + textwrap.dedent(body) + "\nprint('DONE')\n")
    finally:
        await ctx.runtime.close(ws)
    return Outcome(name, "ALLOWED" in out or "DONE" not in out, out[-300:])


async def user_namespace(ctx: EscapeContext) -> Outcome:
    """A new user namespace (root inside it, and the kernel code it opens): refused."""
    return await _probe(ctx, "user_namespace", """
        child = os.fork()  # in a child: the probe itself stays as it was
        if child == 0:
            r, e = sys_(272, 0x10000000)  # unshare(CLONE_NEWUSER)
            os._exit(0 if r == 0 else min(e, 255) or 255)
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        report("unshare(CLONE_NEWUSER)", 0 if code == 0 else -1, max(code, 0))
    """)


async def clone_new_namespaces(ctx: EscapeContext) -> Outcome:
    """clone with CLONE_NEWUSER (and the rest of CLONE_NEW*), and clone3, whose flags a filter cannot read."""
    return await _probe(ctx, "clone_new_namespaces", """
        report("clone(CLONE_NEWUSER)", *in_child(56, 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0))
        report("clone(CLONE_NEWUSER|CLONE_NEWNET)", *in_child(56, 0x50000000 | signal.SIGCHLD, 0, 0, 0, 0))
        args = ctypes.create_string_buffer(struct.pack("11Q", 0x10000000, 0, 0, 0, signal.SIGCHLD, 0, 0, 0, 0, 0, 0))
        report("clone3(CLONE_NEWUSER)", *in_child(435, args, 88))
    """)


async def io_uring(ctx: EscapeContext) -> Outcome:
    return await _probe(ctx, "io_uring", """
        params = ctypes.create_string_buffer(120)
        report("io_uring_setup", *sys_(425, 8, params))
    """)


async def perf_events(ctx: EscapeContext) -> Outcome:
    return await _probe(ctx, "perf_events", """
        attr = bytearray(128)
        struct.pack_into("IIQ", attr, 0, 1, 128, 1)  # PERF_TYPE_SOFTWARE, size, PERF_COUNT_SW_TASK_CLOCK
        struct.pack_into("Q", attr, 40, 1 | 1 << 5 | 1 << 6)  # disabled, exclude_kernel, exclude_hv
        report("perf_event_open", *sys_(298, ctypes.create_string_buffer(bytes(attr)), 0, -1, -1, 0))
    """)


async def userfaultfd(ctx: EscapeContext) -> Outcome:
    return await _probe(ctx, "userfaultfd", """
        report("userfaultfd(UFFD_USER_MODE_ONLY)", *sys_(323, os.O_CLOEXEC | 1))
    """)


async def personality_flags(ctx: EscapeContext) -> Outcome:
    """personality(ADDR_NO_RANDOMIZE / READ_IMPLIES_EXEC / MMAP_PAGE_ZERO): address-space layout switches."""
    return await _probe(ctx, "personality_flags", """
        for what, flag in [("ADDR_NO_RANDOMIZE", 0x0040000), ("READ_IMPLIES_EXEC", 0x0400000),
                           ("MMAP_PAGE_ZERO", 0x0100000), ("ADDR_NO_RANDOMIZE with bit 31", 0x80040000)]:
            r, e = sys_(135, flag)
            report("personality " + what, *(sys_(135, 0xffffffff) if r >= 0 else (r, e)))
            sys_(135, 0)
    """)


async def foreign_abi(ctx: EscapeContext) -> Outcome:
    """System calls of another ABI (ia32 through int 0x80, x32) escape a filter written for the native one."""
    return await _probe(ctx, "foreign_abi", """
        code = bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3])  # mov eax, 20 (ia32 getpid); int 0x80; ret
        buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        buf.write(code)
        fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
        got = fn()
        report("ia32 getpid", got if got == os.getpid() else -1, 0 if got == os.getpid() else -got)
        r, e = sys_(0x40000000 + 39)
        report("x32 getpid", r if r == os.getpid() else -1, e)
    """)


async def trace_own_children(ctx: EscapeContext) -> Outcome:
    """ptrace and process_vm_readv, even on the command's own children (the kernel code behind them)."""
    return await _probe(ctx, "trace_own_children", """
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        try:
            report("ptrace(PTRACE_SEIZE, child)", *sys_(101, 0x4206, child, 0, 0))
            local, remote = ctypes.create_string_buffer(8), ctypes.create_string_buffer(8)
            iov_l = struct.pack("QQ", ctypes.addressof(local), 8)
            iov_r = struct.pack("QQ", ctypes.addressof(remote), 8)
            report("process_vm_readv(child)", *sys_(310, child, ctypes.create_string_buffer(iov_l), 1,
                                                    ctypes.create_string_buffer(iov_r), 1, 0))
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    """)


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
    keyring_host_session_read,
    keyring_host_session_write,
    keyring_uid_outlives_episode,
    keyring_calls,
    proc_keys_lists_host_keys,
    hidden_tests_keep_agent_files,
    proc_sys_writable,
    proc_kernel_files,
    user_namespace,
    clone_new_namespaces,
    io_uring,
    perf_events,
    userfaultfd,
    personality_flags,
    foreign_abi,
    trace_own_children,
]
# what these do when they get out would harm the host (`kill -9 -1` as root, a fork bomb, a mount,
# stopping a traced process):
# never run them where nothing contains them
# (keyring_uid_outlives_episode would leave the hidden tests in this user's own keyrings)
UNSAFE_UNSANDBOXED = {signal_host_process, fork_bomb, gain_privileges, ptrace_processes, keyring_uid_outlives_episode}


async def run_escapes(runtime: Runtime, work: Path) -> list[Outcome]:
    """Every attempt in ``ESCAPES`` against ``runtime``, one after another (against the unsandboxed
    ``local`` runtime only those that are harmless when they succeed)."""
    ctx = make_context(runtime, work)
    unsafe = UNSAFE_UNSANDBOXED if runtime.name == "local" else set()
    return [await attempt(ctx) for attempt in ESCAPES if attempt not in unsafe]


def main(argv: list[str] | None = None) -> int:
    """``python -m arborl_bench.escapes WORK_DIR [ENVS_ROOT]``: the list against bwrap, one JSON line."""
    import json
    import sys

    from arborl.config import EnvsConfig
    from arborl.envs import make_runtime

    args = sys.argv[1:] if argv is None else argv
    work = Path(args[0])
    root = Path(args[1]) if len(args) > 1 else work / "envs"
    runtime = make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(root), disk_mb=16, file_size_mb=8,
                                      processes=32, tmp_mb=8, wall_s=20))
    outcomes = asyncio.run(run_escapes(runtime, work / "work"))
    print(json.dumps({"uid": os.geteuid(), "attempts": len(outcomes), "escaped": [o.name for o in outcomes if o.escaped],
                      "details": {o.name: o.detail for o in outcomes if o.escaped}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
