"""The agent layer on one live gateway: the white-box ReAct agent (in-process client) and black-box
programs (subprocesses speaking OpenAI over HTTP) produce the same recorded tokens; failures,
timeouts and process-group kills are handled without losing data."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from arborl.agents import AgentOutcome, BlackBoxRunner, ReActAgent, SessionClient, Tool, run_agent
from arborl.types import EpisodeStatus, Task
from helpers.blackbox_gateway import ADD_TOOL, ANSWER, QUESTION, start_harness

AGENT = str(Path(__file__).parent / "helpers" / "blackbox_agent.py")
TASK = Task(task_id="add-2-3", prompt=QUESTION, metadata={"answer": 5})


@pytest.fixture(scope="module")
def h():
    harness = start_harness()
    yield harness
    harness.close()


def add_tool() -> Tool:
    return Tool("add", lambda a, b: a + b, ADD_TOOL["function"]["description"], ADD_TOOL["function"]["parameters"])


def run(coro):
    return asyncio.run(coro)


def tokens(calls):
    return [(c.prompt_token_ids, c.completion_token_ids) for c in calls]


def test_whitebox_react_agent_and_blackbox_program_record_the_same_tokens(h, tmp_path):
    wb = run(run_agent(h.gateway, ReActAgent([add_tool()], temperature=0), TASK, group_id="g"))
    assert wb.status == EpisodeStatus.FINISHED and wb.error is None
    assert wb.outcome.answer == ANSWER and wb.outcome.info == {"turns": 2, "tool_runs": 1, "finish_reason": "stop"}
    ep = h.pool.get_episode(wb.episode_id)
    assert ep.agent_kind == "whitebox" and ep.status == EpisodeStatus.FINISHED and ep.group_id == "g"
    assert ep.meta["outcome"]["answer"] == ANSWER
    (inter,) = ep.interactions
    assert inter["tool"] == "add" and inter["result"] == "5" and inter["call_id"] == ep.calls[0].call_id

    runner = BlackBoxRunner(h.gateway, h.base_url, timeout_s=60, log_dir=tmp_path)
    bb = run(runner.run([sys.executable, AGENT, "tools"], TASK, group_id="g"))
    assert bb.status == EpisodeStatus.FINISHED and bb.returncode == 0 and not bb.timed_out
    assert bb.stdout.strip() == ANSWER and "tool add({'a': 2, 'b': 3})" in bb.stderr
    bep = h.pool.get_episode(bb.episode_id)
    assert bep.agent_kind == "blackbox" and bep.meta["blackbox"]["returncode"] == 0
    assert bep.meta["blackbox"]["stdout_tail"].strip() == ANSWER
    assert (tmp_path / f"{bb.episode_id}.stdout").read_text().strip() == ANSWER
    # an agent program may not reward itself (rollout.trust_agent_rewards=false): refused, nothing recorded
    assert "reward: HTTP 403" in bb.stderr and bep.meta.get("rewards", []) == []
    # one recording path: the same episode, token for token, whichever way the agent came in
    assert tokens(bep.calls) == tokens(ep.calls) and len(ep.calls) == 2
    assert ep.calls[1].meta["stitch"]["parent_call"] == ep.calls[0].call_id


def test_whitebox_agent_errors_and_timeouts_keep_the_data(h):
    async def crashing(task: Task, client: SessionClient) -> AgentOutcome:
        await client.chat([{"role": "user", "content": "hi"}], max_tokens=2)
        raise ValueError("the agent's own bug")

    bad = run(run_agent(h.gateway, crashing, TASK))
    assert bad.status == EpisodeStatus.FAILED and "ValueError: the agent's own bug" in bad.error
    ep = h.pool.get_episode(bad.episode_id)
    assert ep.status == EpisodeStatus.FAILED and len(ep.calls) == 1 and "ValueError" in ep.meta["agent_traceback"]

    async def slow(task: Task, client: SessionClient) -> AgentOutcome:
        await client.chat_completion(model=client.model, messages=[{"role": "user", "content": "x"}], max_tokens=1900,
                                     ignore_eos=True)
        return AgentOutcome("never")

    (engine,) = h.engines
    run(engine.pause())  # its call cannot finish before the timeout, however fast the engine is
    try:
        late = run(run_agent(h.gateway, slow, TASK, timeout_s=0.3))
        assert late.status == EpisodeStatus.ABORTED and "timeout" in late.error

        def aborted_recorded():
            calls = h.pool.calls(late.episode_id)
            return calls and calls[0].finish_reason == "abort"

        deadline = time.monotonic() + 10
        while not aborted_recorded():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        engine.resume()
    assert h.pool.get_episode(late.episode_id).status == EpisodeStatus.ABORTED


def test_react_agent_turns_tool_errors_into_observations(h):
    def broken(a, b):
        raise RuntimeError("calculator on fire")

    spec = ADD_TOOL["function"]  # same spec as the script: the policy calls it
    agent = ReActAgent([Tool("add", broken, spec["description"], spec["parameters"])], temperature=0, max_turns=2)
    res = run(run_agent(h.gateway, agent, TASK))
    assert res.status == EpisodeStatus.FINISHED
    inter = h.pool.get_episode(res.episode_id).interactions[0]
    assert inter["error"] == "RuntimeError: calculator on fire" and inter["result"].startswith("error: ")
    second = h.pool.calls(res.episode_id)[1]
    assert "error: RuntimeError: calculator on fire" in h.loaded.tokenizer.decode(second.prompt_token_ids)


def test_blackbox_timeout_kills_the_whole_process_group(h, tmp_path):
    pid_file = tmp_path / "child.pid"
    runner = BlackBoxRunner(h.gateway, h.base_url, kill_grace_s=1)
    # the timeout leaves a loaded machine time to start the agent's Python and its child
    res = run(runner.run([sys.executable, AGENT, "hang", str(pid_file)], TASK, timeout_s=6))
    assert res.timed_out and res.returncode is None and res.status == EpisodeStatus.ABORTED
    assert "started child" in res.stdout
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, "the agent's child survived the kill"
        time.sleep(0.05)
    assert h.pool.get_episode(res.episode_id).meta["blackbox"]["timed_out"] is True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its (dead) parent's reaper counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_blackbox_exit_codes_outputs_and_self_finish(h):
    runner = BlackBoxRunner(h.gateway, h.base_url)
    res = run(runner.run([sys.executable, AGENT, "fail"], TASK, timeout_s=30))
    assert res.status == EpisodeStatus.FAILED and res.returncode == 3
    assert res.stdout.strip() == "some output" and res.stderr.strip() == "something went wrong"
    assert h.pool.get_episode(res.episode_id).meta["blackbox"]["stderr_tail"].strip() == "something went wrong"
    own = run(runner.run(f"{sys.executable} {AGENT} finish-self", TASK, timeout_s=30))  # a shell command line
    assert own.returncode == 0 and own.status == EpisodeStatus.FAILED  # the agent's own verdict stands
    assert len(h.pool.calls(own.episode_id)) == 1
    missing = run(runner.run(["/nonexistent/agent"], TASK))
    assert missing.status == EpisodeStatus.FAILED and "cannot start" in missing.stderr


def test_blackbox_gets_the_task_in_the_environment_or_a_file(h):
    runner = BlackBoxRunner(h.gateway, h.base_url)
    small = run(runner.run([sys.executable, AGENT, "task"], TASK, timeout_s=30))
    assert small.stdout.split() == ["env", str(len(QUESTION)), h.base_url]
    big = Task("big", "x" * 100_000)
    res = run(runner.run([sys.executable, AGENT, "task"], big, timeout_s=30))
    assert res.stdout.split() == ["file", "100000"] and res.status == EpisodeStatus.FINISHED
