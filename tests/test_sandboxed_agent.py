"""A black-box CLI agent (the official openai SDK) run inside an episode's bubblewrap sandbox: it reaches
the gateway only through the Unix socket bound in, its model calls are recorded token for token, its
file edits land in the workspace and its commands run as the sandbox's unprivileged user; it cannot
reward itself (rollout.trust_agent_rewards=false)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from arborl.agents import run_agent
from arborl.agents.sandboxed import SandboxedCommand
from arborl.run.assemble import build_gateway
from arborl.config import EnvsConfig, load_config
from arborl.envs import make_runtime
from arborl.types import EpisodeStatus, Task

HELPERS = Path(__file__).resolve().parent / "helpers"


def test_a_cli_agent_in_the_sandbox_is_recorded_through_the_gateway_socket(tmp_path):
    cfg = load_config(None, [f"runs_dir={tmp_path}", "name=sb", "model.source=tiny", "model.tiny_tokenizer=smollm2",
                             "model.tiny_layers=1", "model.tiny_hidden=32", "engine.max_seq_len=256"])
    template = tmp_path / "template"
    template.mkdir()
    (template / "buggy.py").write_text("def f(x):\n    return x - 1\n")
    runtime = make_runtime(EnvsConfig(root_dir=str(tmp_path / "ws"), ro_binds=[str(HELPERS)]))
    built = build_gateway(cfg)

    async def main():
        ws = await runtime.prepare(template, episode_id="ep-sandboxed")
        try:
            agent = SandboxedCommand([sys.executable, str(HELPERS / "sandbox_cli_agent.py")], runtime=runtime,
                                     workspace=ws, sampling={"temperature": 1.0, "max_tokens": 6, "seed": 3},
                                     timeout_s=60)
            run = await run_agent(built.gateway, agent, Task("t0", "fix it"), group_id="g")
            return run, (ws.path / "fixed.txt").read_text()
        finally:
            await runtime.close(ws)

    try:
        run, written = asyncio.run(main())
        episode = built.pool.get_episode(run.episode_id)
    finally:
        built.close()
    assert run.status == EpisodeStatus.FINISHED, run.outcome.info
    seen = json.loads(run.outcome.answer)
    assert seen["net"] == "unreachable" and seen["base_url"].startswith("http://127.0.0.1:")
    assert seen["cwd"] == "/workspace" and "buggy.py" in seen["listing"]
    if os.geteuid() == 0:  # as root the sandbox drops to a pooled unprivileged uid
        assert seen["uid"] != 0 and seen["shell"] == str(seen["uid"])
    # the agent's own key posting a reward on its own session: refused, nothing recorded
    assert seen["reward_status"] == 403 and episode.meta.get("rewards", []) == []
    (call,) = episode.calls  # recorded by the gateway, token ids and all
    assert 1 <= len(call.completion_token_ids) <= 6 and len(call.logprobs) == len(call.completion_token_ids)
    text = built.loaded.tokenizer.decode(call.completion_token_ids, skip_special_tokens=True)
    assert written == text.strip() or written == text  # what the agent got is what was recorded


def test_relative_program_and_script_paths_are_taken_from_the_working_directory(tmp_path, monkeypatch):
    """`rollout.agent_command=[.venv/bin/python, examples/agent.py]` as the docs write it: inside the sandbox
    the working directory is the workspace, so both are made absolute here; the venv's link is not resolved
    (its python finds the venv's packages through that path) and a bare program name stays for PATH."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "py").symlink_to(sys.executable)
    (tmp_path / "agent.py").write_text("print('hi')\n")
    (tmp_path / "python").write_text("")
    monkeypatch.chdir(tmp_path)
    cmd = SandboxedCommand(["bin/py", "agent.py", "--flag", "missing.py"], runtime=None, workspace=None).command
    assert cmd == [str(tmp_path / "bin" / "py"), str(tmp_path / "agent.py"), "--flag", "missing.py"]
    assert SandboxedCommand(["python", "agent.py"], runtime=None, workspace=None).command[0] == "python"
