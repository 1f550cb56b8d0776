"""The environment runtimes for real: bubblewrap sandboxes (and the local opt-in) over real workspaces.

Clean state between episodes (E1), hidden tests only at evaluation (E2), limits, clear errors, and
one test per envs.* knob showing it changes what happens."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from arborl.config import EnvsConfig
from arborl.envs import EnvError, InfraError, SandboxUnavailableError, make_runtime
from arborl.envs import local as local_mod
from arborl.envs.bwrap import BwrapRuntime
from arborl.envs.local import LocalRuntime


def _template(tmp: Path) -> Path:
    t = tmp / "template"
    (t / "pkg").mkdir(parents=True, exist_ok=True)
    (t / "pkg" / "__init__.py").write_text("")
    (t / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (t / "notes.txt").write_text("keep me\n")
    return t


def _hidden(tmp: Path) -> Path:
    h = tmp / "hidden"
    h.mkdir(exist_ok=True)
    (h / "test_calc.py").write_text("from pkg.calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    return h


def _rt(tmp: Path, **kw) -> BwrapRuntime:  # noqa: ANN003
    kw.setdefault("root_dir", str(tmp / "root"))
    return make_runtime(EnvsConfig(**kw))


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def test_default_runtime_is_the_sandbox(tmp_path):
    rt = _rt(tmp_path)
    assert isinstance(rt, BwrapRuntime)

    async def go():
        ws = await rt.prepare(_template(tmp_path), episode_id="ep-1")
        assert ws.path == tmp_path / "root" / "ep-1"  # rollout.envs.root_dir, named by episode id
        r = await rt.run(ws, ["sh", "-c", "pwd; id -u; ls; echo out; echo err >&2; exit 3"])
        await rt.close(ws)
        return ws, r

    ws, r = run(go())
    lines = r.stdout.split()
    assert lines[0] == "/workspace" and int(lines[1]) != 0  # never root inside
    assert set(lines[2:4]) == {"notes.txt", "pkg"} and "out" in lines
    assert r.stderr.strip() == "err" and r.returncode == 3 and not r.timed_out
    assert not ws.path.exists()  # close deleted it


def test_next_episode_starts_clean_after_writes_deletes_and_leftover_processes(tmp_path):
    tpl = _template(tmp_path)
    before = _snapshot(tpl)
    rt = _rt(tmp_path)

    async def go():
        ws1 = await rt.prepare(tpl, episode_id="ep-a")
        await rt.run(ws1, ["sh", "-c", "echo hacked > pkg/calc.py; rm notes.txt; echo x > new.txt; chmod 000 pkg; "
                           "(setsid sh -c 'while :; do sleep 0.05; echo . >> /workspace/late; done' &) ; sleep 0.2"])
        uid = ws1.extra["uid"]
        await rt.close(ws1)
        ws2 = await rt.prepare(tpl, episode_id="ep-a")  # same id even: a fresh copy
        await asyncio.sleep(0.3)
        r = await rt.run(ws2, ["sh", "-c", "ls -A; cat pkg/calc.py notes.txt"])
        await rt.close(ws2)
        return uid, r

    uid, r = run(go())
    assert r.stdout.split("\n")[:2] == ["notes.txt", "pkg"] and "return a - b" in r.stdout and "keep me" in r.stdout
    assert _snapshot(tpl) == before  # the template never changed
    owners = {os.stat(f"/proc/{p}").st_uid for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}")}
    assert uid not in owners  # nothing of episode 1 still runs


def test_evaluate_sees_hidden_tests_and_the_final_workspace_and_the_agent_never_does(tmp_path):
    tpl, hidden = _template(tmp_path), _hidden(tmp_path)
    rt = _rt(tmp_path)
    pytest_argv = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "hidden"]

    async def go():
        ws = await rt.prepare(tpl, episode_id="ep-eval")
        seen = await rt.run(ws, ["sh", "-c", f"ls -A; ls {hidden} 2>&1; ls /workspace/hidden 2>&1"])
        failing = await rt.evaluate(ws, hidden, ["python", "-c", "from hidden.test_calc import test_add; test_add()"])
        await rt.run(ws, ["sh", "-c", "printf 'def add(a, b):\\n    return a + b\\n' > pkg/calc.py"])
        passing = await rt.evaluate(ws, hidden, pytest_argv, timeout_s=120)
        after = await rt.run(ws, ["ls", "-A"])
        await rt.close(ws)
        return seen, failing, passing, after

    seen, failing, passing, after = run(go())
    assert "test_calc" not in seen.stdout and "No such file" in seen.stdout
    assert failing.returncode == 1 and "AssertionError" in failing.stderr
    assert passing.returncode == 0 and "1 passed" in passing.stdout
    assert "hidden" not in after.stdout.split()  # evaluation worked on a copy
    assert [p.name for p in (tmp_path / "root").iterdir() if not p.name.startswith(".")] == []  # scratch deleted


def test_clear_errors_for_bad_templates_commands_and_ids(tmp_path):
    rt = _rt(tmp_path)
    tpl = _template(tmp_path)

    async def go():
        with pytest.raises(EnvError, match="does not exist"):
            await rt.prepare(tmp_path / "nope", episode_id="e")
        with pytest.raises(EnvError, match="not a directory"):
            await rt.prepare(tpl / "notes.txt", episode_id="e")
        for bad_id in ("../x", "", "a/b", ".hidden"):
            with pytest.raises(EnvError, match="episode id"):
                await rt.prepare(tpl, episode_id=bad_id)
        ws = await rt.prepare(tpl, episode_id="e")
        with pytest.raises(EnvError, match="already has a live workspace"):
            await rt.prepare(tpl, episode_id="e")
        with pytest.raises(EnvError, match="argv is empty"):
            await rt.run(ws, [])
        with pytest.raises(EnvError, match="not one string"):
            await rt.run(ws, "ls -l")
        with pytest.raises(EnvError, match="NUL"):
            await rt.run(ws, ["echo", "a\0b"])
        with pytest.raises(EnvError, match="must be strings"):
            await rt.run(ws, ["echo", 3])
        with pytest.raises(EnvError, match="unix socket"):
            await rt.run(ws, ["true"], unix_sockets=[tmp_path / "no.sock"])
        with pytest.raises(EnvError, match="hidden tests directory"):
            await rt.evaluate(ws, tmp_path / "none", ["true"])
        missing = await rt.run(ws, ["no-such-program"])
        await rt.close(ws)
        with pytest.raises(EnvError, match="not live"):
            await rt.run(ws, ["true"])
        return missing

    missing = run(go())
    assert missing.returncode == 127 and "no-such-program" in missing.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox uid differs from the socket owner only as root")
def test_a_gateway_socket_the_sandbox_uid_cannot_open_is_a_clear_error(tmp_path):
    import socket

    rt = _rt(tmp_path)
    path = tmp_path / "gw.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    os.chmod(path, 0o600)

    async def go():
        ws = await rt.prepare(_template(tmp_path), episode_id="e")
        try:
            with pytest.raises(EnvError, match="chmod it 0o666"):
                await rt.run(ws, ["true"], unix_sockets=[path])
            os.chmod(path, 0o666)
            return await rt.run(ws, ["sh", "-c", f"test -S {path} && echo bound"], unix_sockets=[path])
        finally:
            await rt.close(ws)
            s.close()

    assert run(go()).stdout.strip() == "bound"


def test_missing_bwrap_is_a_clear_error_never_a_fallback(tmp_path):
    with pytest.raises(SandboxUnavailableError) as e:
        _rt(tmp_path, bwrap_path="/nonexistent/bwrap")
    assert "apt-get install -y bubblewrap" in str(e.value) and "rollout.envs.runtime=local" in str(e.value)


def test_a_sandbox_that_does_not_start_is_an_infrastructure_failure(tmp_path):
    rt = _rt(tmp_path)
    rt.bwrap = "/bin/false"  # exits 1 without starting anything, as a broken bwrap would

    async def go():
        ws = await rt.prepare(_template(tmp_path), episode_id="e")
        try:
            await rt.run(ws, ["true"])
        finally:
            await rt.close(ws)

    with pytest.raises(InfraError, match="did not start"):
        run(go())


def test_a_failing_command_is_not_an_infrastructure_failure(tmp_path):
    rt = _rt(tmp_path)

    async def go():
        ws = await rt.prepare(_template(tmp_path), episode_id="e")
        r = await rt.run(ws, ["sh", "-c", "echo 'bwrap: fake' >&2; exit 1"])  # pretending does not help
        await rt.close(ws)
        return r

    assert run(go()).returncode == 1


def test_local_runtime_works_and_warns_once(tmp_path, capsys):
    local_mod._warned = False
    rt = make_runtime(EnvsConfig(runtime="local", root_dir=str(tmp_path / "root")))
    make_runtime(EnvsConfig(runtime="local", root_dir=str(tmp_path / "root")))
    assert isinstance(rt, LocalRuntime)
    assert capsys.readouterr().err.count("WITHOUT A SANDBOX") == 1

    async def go():
        ws = await rt.prepare(_template(tmp_path), episode_id="e")
        r = await rt.run(ws, ["sh", "-c", "pwd; cat notes.txt"])
        ev = await rt.evaluate(ws, _hidden(tmp_path), ["ls", "hidden"])
        await rt.close(ws)
        return ws, r, ev

    ws, r, ev = run(go())
    assert r.stdout.split("\n")[:2] == [str(ws.path), "keep me"]
    assert ev.stdout.strip() == "test_calc.py"


# -- one test per knob -------------------------------------------------------------------------------


def _one(rt, tpl: Path, argv: list[str], **kw):  # noqa: ANN001, ANN003, ANN202
    async def go():
        ws = await rt.prepare(tpl, episode_id="knob")
        try:
            return ws, await rt.run(ws, argv, **kw)
        finally:
            await rt.close(ws)

    return run(go())


def test_wall_s_kills_the_whole_tree(tmp_path):
    _, r = _one(_rt(tmp_path, wall_s=0.5), _template(tmp_path), ["sh", "-c", "sleep 5 & sleep 5"])
    assert r.timed_out and r.killed == "timeout" and r.duration_s < 3
    _, r = _one(_rt(tmp_path, wall_s=0.5), _template(tmp_path), ["sleep", "5"], timeout_s=0.2)
    assert r.timed_out and r.duration_s < 0.5 + 1  # a per-call timeout_s overrides wall_s


def test_cpu_s_stops_a_busy_loop_before_the_wall_clock(tmp_path):
    _, r = _one(_rt(tmp_path, cpu_s=1, wall_s=20), _template(tmp_path), ["sh", "-c", "while :; do :; done"])
    assert not r.timed_out and r.returncode != 0 and r.duration_s < 15


def test_memory_mb_caps_allocation(tmp_path):
    src = "b = bytearray(300 * 1024 * 1024); print('allocated')"
    _, small = _one(_rt(tmp_path, memory_mb=200), _template(tmp_path), ["python", "-c", src])
    _, big = _one(_rt(tmp_path, memory_mb=2048), _template(tmp_path), ["python", "-c", src])
    assert "MemoryError" in small.stderr and big.stdout.strip() == "allocated"


def test_file_size_mb_caps_one_file(tmp_path):
    src = "f = open('big', 'wb'); [f.write(b'x' * (1 << 20)) for _ in range(4)]; f.close(); print('wrote')"
    _, small = _one(_rt(tmp_path, file_size_mb=2), _template(tmp_path), ["python", "-c", src])
    _, big = _one(_rt(tmp_path, file_size_mb=8), _template(tmp_path), ["python", "-c", src])
    assert "File too large" in small.stderr and big.stdout.strip() == "wrote"


def test_processes_caps_what_runs_at_once(tmp_path):
    src = ("import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n            time.sleep(5); os._exit(0)\n"
           "        n += 1\nexcept OSError:\n    pass\nprint(n)")  # fmt: skip
    _, r8 = _one(_rt(tmp_path, processes=8), _template(tmp_path), ["python", "-c", src])
    _, r32 = _one(_rt(tmp_path, processes=32), _template(tmp_path), ["python", "-c", src])
    assert int(r8.stdout) < 8 and 8 < int(r32.stdout) < 32


def test_disk_mb_caps_the_workspace(tmp_path):
    src = ("import os\ntry:\n    [open(f'f{i}', 'wb').write(b'x' * (1 << 20)) for i in range(12)]\n    print('ok')\n"
           "except OSError as e:\n    print(e.errno)")
    _, small = _one(_rt(tmp_path, disk_mb=4), _template(tmp_path), ["python", "-c", src])
    _, big = _one(_rt(tmp_path, disk_mb=32), _template(tmp_path), ["python", "-c", src])
    assert small.stdout.strip() == "28" and big.stdout.strip() == "ok"  # ENOSPC


def test_a_full_workspace_is_still_evaluated(tmp_path):
    rt = _rt(tmp_path, disk_mb=4)

    async def go():
        ws = await rt.prepare(_template(tmp_path), episode_id="e")
        fill = await rt.run(ws, ["sh", "-c", "cat /dev/zero > fill; echo $?"])
        ev = await rt.evaluate(ws, _hidden(tmp_path), ["sh", "-c", "ls hidden; echo data > out.txt && echo wrote"])
        await rt.close(ws)
        return fill, ev

    fill, ev = run(go())
    assert fill.stdout.strip() != "0" and ev.stdout.split() == ["test_calc.py", "wrote"]


def test_a_template_larger_than_disk_mb_is_an_env_error(tmp_path):
    tpl = _template(tmp_path)
    (tpl / "blob").write_bytes(b"x" * (3 << 20))
    with pytest.raises(EnvError, match="rollout.envs.disk_mb"):
        run(_rt(tmp_path, disk_mb=1).prepare(tpl, episode_id="e"))


def test_tmp_mb_caps_the_private_tmp(tmp_path):
    argv = ["sh", "-c", "dd if=/dev/zero of=/tmp/f bs=1M count=6 2>/dev/null && echo ok || echo full"]
    _, small = _one(_rt(tmp_path, tmp_mb=2), _template(tmp_path), argv)
    _, big = _one(_rt(tmp_path, tmp_mb=16), _template(tmp_path), argv)
    assert small.stdout.strip() == "full" and big.stdout.strip() == "ok"


def test_output_kb_caps_and_stops_a_flood(tmp_path):
    _, r = _one(_rt(tmp_path, output_kb=64, wall_s=20), _template(tmp_path), ["yes"])
    assert r.killed == "output_limit" and len(r.stdout) <= 64 * 1024 and r.duration_s < 10
    _, ok = _one(_rt(tmp_path, output_kb=256), _template(tmp_path), ["head", "-c", "100000", "/dev/zero"])
    assert ok.killed is None and len(ok.stdout) == 100000


def test_workspace_path_is_where_the_workspace_appears(tmp_path):
    _, r = _one(_rt(tmp_path, workspace_path="/src/repo"), _template(tmp_path), ["sh", "-c", "pwd; ls /src/repo"])
    assert r.stdout.split() == ["/src/repo", "notes.txt", "pkg"]


def test_bind_python_puts_the_running_python_inside(tmp_path):
    argv = ["sh", "-c", "command -v python || echo none"]
    _, on = _one(_rt(tmp_path, bind_python=True), _template(tmp_path), argv)
    _, off = _one(_rt(tmp_path, bind_python=False), _template(tmp_path), argv)
    assert on.stdout.strip() == str(Path(sys.executable).parent / "python")
    assert off.stdout.strip() != on.stdout.strip()


def test_ro_binds_are_visible_and_read_only(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "x.txt").write_text("shared\n")
    os.chmod(tmp_path, 0o755)
    argv = ["sh", "-c", f"cat {data}/x.txt; echo y > {data}/y.txt 2>/dev/null || echo read-only"]
    _, with_bind = _one(_rt(tmp_path, ro_binds=[str(data)]), _template(tmp_path), argv)
    _, without = _one(_rt(tmp_path), _template(tmp_path), argv)
    assert with_bind.stdout.split() == ["shared", "read-only"] and not (data / "y.txt").exists()
    assert "shared" not in without.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid pool is used as root only")
def test_sandbox_uids_pool_gives_each_live_workspace_its_own_uid(tmp_path):
    rt = _rt(tmp_path, sandbox_uid_base=70000, sandbox_uids=2, sandbox_wait_s=0)  # no queue: a full pool fails at once
    tpl = _template(tmp_path)

    async def go():
        a = await rt.prepare(tpl, episode_id="a")
        b = await rt.prepare(tpl, episode_id="b")
        ids = [(await rt.run(ws, ["id", "-u"])).stdout.strip() for ws in (a, b)]
        with pytest.raises(InfraError, match="sandbox_uids"):
            await rt.prepare(tpl, episode_id="c")
        await rt.close(a)
        c = await rt.prepare(tpl, episode_id="c")  # a's uid is free again
        for ws in (b, c):
            await rt.close(ws)
        return ids, c.extra["uid"]

    ids, c_uid = run(go())
    assert sorted(ids) == ["70000", "70001"] and str(c_uid) == ids[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid pool is used as root only")
def test_runtimes_with_different_roots_never_hand_out_the_same_uid(tmp_path):
    # the uids are the host's: a second runtime (another job, another worker) with its own root_dir
    # must not reuse a uid the first holds, or closing one sandbox kills the other's processes
    a_rt = _rt(tmp_path, root_dir=str(tmp_path / "root-a"), sandbox_uid_base=70100, sandbox_uids=2)
    b_rt = _rt(tmp_path, root_dir=str(tmp_path / "root-b"), sandbox_uid_base=70100, sandbox_uids=3, sandbox_wait_s=0)
    tpl = _template(tmp_path)

    async def go():
        held = [await a_rt.prepare(tpl, episode_id=f"a{i}") for i in range(2)]
        b = await b_rt.prepare(tpl, episode_id="b")
        with pytest.raises(InfraError, match="sandbox_uids"):
            await b_rt.prepare(tpl, episode_id="b2")
        uids = sorted(ws.extra["uid"] for ws in held) + [b.extra["uid"]]
        for ws in held:
            await a_rt.close(ws)
        await b_rt.close(b)
        return uids

    assert run(go()) == [70100, 70101, 70102]


def test_copy_mode_cp_and_copy_make_the_same_workspace(tmp_path):
    tpl = _template(tmp_path)
    (tpl / "link").symlink_to("/etc/passwd")
    listing = ["sh", "-c", "find . | sort; readlink link; cat pkg/calc.py"]
    ws_copy, a = _one(_rt(tmp_path, copy_mode="copy"), tpl, listing)
    ws_cp, b = _one(_rt(tmp_path, copy_mode="cp"), tpl, listing)
    assert a.stdout == b.stdout and "/etc/passwd" in a.stdout
    assert (ws_copy.extra["copy_mode"], ws_cp.extra["copy_mode"]) == ("copy", "cp")


def test_unknown_runtime_names_the_choices(tmp_path):
    with pytest.raises(Exception, match="bwrap, local"):
        make_runtime(EnvsConfig(runtime="docker", root_dir=str(tmp_path)))


def test_tmp_stays_writable_with_binds_and_a_socket_below_it(tmp_path):
    """A venv, a ro_binds path or the gateway's socket under /tmp must not cost the sandbox its /tmp."""
    import socket as _socket
    import tempfile as _tempfile

    d = Path(_tempfile.mkdtemp(prefix="arborl-test-bind-"))  # on the host's /tmp
    d.chmod(0o755)
    (d / "data.txt").write_text("x\n")
    sock_path = d / "s.sock"
    srv = _socket.socket(_socket.AF_UNIX)
    srv.bind(str(sock_path))
    sock_path.chmod(0o777)
    try:
        rt = _rt(tmp_path, ro_binds=[str(d)])
        argv = ["sh", "-c", f"cat {d}/data.txt && echo hi > /tmp/f && cat /tmp/f && stat -c %a /tmp"]
        _, r = _one(rt, _template(tmp_path), argv, unix_sockets=[sock_path])
        assert r.stdout.split() == ["x", "hi", "1777"], (r.stdout, r.stderr)
    finally:
        srv.close()
        sock_path.unlink(missing_ok=True)
        (d / "data.txt").unlink()
        d.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs another uid to own the directory")
def test_a_root_dir_another_user_made_or_can_write_is_refused(tmp_path):
    """rollout.envs.root_dir defaults to a fixed name in /tmp: one another local user made first (or a
    link they put there, or one others can write) could plant what the job runs as root."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(EnvError, match=r"belongs to uid 65534, not this user \(0\).*only this user can write"):
        _rt(tmp_path, root_dir=str(theirs))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(EnvError, match="can be written by others \\(mode 777\\)"):
        make_runtime(EnvsConfig(runtime="local", root_dir=str(shared)))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    os.lchown(link, 65534, 65534)
    with pytest.raises(EnvError, match="is a link made by uid 65534"):
        _rt(tmp_path, root_dir=str(link))
    mine = _rt(tmp_path, root_dir=str(tmp_path / "made" / "here"))  # made where missing (0711 under the umask)
    assert mine.root.is_dir() and not mine.root.stat().st_mode & 0o066
