"""Built-in tasks emit process rewards (C1) through the gateway's reward path, on the call that earned
them: the calculator's rules (malformed tool call, tool error, language mixing) and the chain task's
per-step rewards, where a wrong step ends the episode. Real gateway, engine and data pool."""

from __future__ import annotations

import asyncio
import random

import pytest

from arborl.agents import ReActAgent, Tool, run_agent
from arborl.agents.client import ChatReply
from arborl.config import AdvantageConfig, load_config
from arborl.tasks import TASK_SUITES, make_suite
from arborl.tasks.chain import ChainSuite, make_chain, step_is_right
from arborl.tasks.process_rewards import (
    ProcessRewardRules,
    RewardingAgent,
    malformed_tool_calls,
    other_script_letters,
    reply_penalties,
)
from arborl.train.samples import build_samples
from arborl.types import EpisodeStatus, Task
from helpers.blackbox_gateway import ADD_TOOL, QUESTION, start_harness


@pytest.fixture(scope="module")
def h():
    harness = start_harness()
    yield harness
    harness.close()


def reply(content):
    return ChatReply({"role": "assistant", "content": content}, content, [], "stop", "call-1", [1], 0)


def test_rules_detect_what_they_name():
    assert other_script_letters("Answer: 42. Café, naïve, 3 × 4 = 12 ✓") == 0
    assert other_script_letters("Answer: 42 (ответ)") == 5 and other_script_letters("答案 42") == 2
    assert malformed_tool_calls('<tool_call>{"name": calc</tool_call> and <tool_call>x') == 2
    rules = ProcessRewardRules()
    assert reply_penalties(reply("Answer: 7"), rules) == []
    assert reply_penalties(reply("<tool_call>{oops</tool_call> 答"), rules) == [("malformed_tool_call", -0.2),
                                                                             ("language_mixing", -0.2)]
    assert reply_penalties(reply("答"), ProcessRewardRules(language_mixing=0.0)) == []


def test_a_tool_error_is_rewarded_on_its_call_and_reaches_that_turns_tokens(h):
    def broken(a, b):
        raise RuntimeError("calculator on fire")

    spec = ADD_TOOL["function"]
    agent = RewardingAgent(ReActAgent([Tool("add", broken, spec["description"], spec["parameters"])], temperature=0,
                                      max_turns=2))
    task = Task(task_id="add-2-3", prompt=QUESTION)
    runs = [asyncio.run(run_agent(h.gateway, agent, task, group_id="g")) for _ in range(2)]
    eps = [h.pool.get_episode(r.episode_id) for r in runs]
    for ep in eps:
        assert ep.status == EpisodeStatus.FINISHED and len(ep.calls) == 2
        (r,) = ep.meta["rewards"]
        assert (r["name"], r["value"], r["call_id"]) == ("tool_error", -0.2, ep.calls[0].call_id)
    # equal outcomes, one episode's penalty dropped (as if its tool had worked): the penalty is the only
    # difference, and it moves the first turn's tokens only
    eps[0].reward = eps[1].reward = 1.0
    eps[1].meta["rewards"] = []
    samples, stats = build_samples(eps, AdvantageConfig(estimator="grpo"))
    assert stats.zero_variance_groups == 0
    pen, ok = samples
    turn = lambda s, k: {a for a, m, c in zip(s.advantages, s.loss_mask, s.chunk_ids) if m and c == k}
    (p0,), (p1,), (o0,), (o1,) = turn(pen, 0), turn(pen, 1), turn(ok, 0), turn(ok, 1)
    assert p0 < o0 and p1 == pytest.approx(o1)


def test_calculator_suite_agent_emits_process_penalties_when_asked():
    agent = make_suite(load_config(None, ["rollout.process_penalties=true"]).rollout).agent({"temperature": 0})
    assert isinstance(agent, RewardingAgent) and agent.rules == ProcessRewardRules()
    default = make_suite(load_config(None, []).rollout).agent({"temperature": 0})
    assert default.rules == ProcessRewardRules(0.0, 0.0, 0.0)  # off: nothing is posted


def test_chain_tasks_are_deterministic_and_dependent():
    rng = random.Random(0)
    start, ops, values = make_chain(rng, 3)
    v = start
    for (op, x), want in zip(ops, values):
        v = {"+": v + x, "-": v - x, "*": v * x}[op]
        assert str(v) == want
    suite = ChainSuite(steps=3)
    a, b = suite.tasks("train", 4, seed=1), suite.tasks("train", 4, seed=1)
    assert [t.metadata for t in a] == [t.metadata for t in b]
    assert {t.prompt[-1]["content"] for t in a}.isdisjoint({t.prompt[-1]["content"] for t in suite.tasks("eval", 4, 1)})
    call = lambda e: [{"id": "c", "function": {"name": "calculator", "arguments": f'{{"expression": "{e}"}}'}}]
    assert step_is_right(call("4 + 3"), "7") and step_is_right(call("7"), "7")
    assert not step_is_right(call("4 + 4"), "7") and not step_is_right(call("4 +"), "7") and not step_is_right([], "7")
    assert "chain" in TASK_SUITES and "chain_tokens" in TASK_SUITES
    assert make_suite(load_config(None, ["rollout.task=chain", "rollout.max_turns=4"]).rollout).suite.steps == 3


def test_chain_tokens_episode_ends_at_the_first_wrong_step_and_rewards_each_right_one(h):
    suite = ChainSuite(steps=3, tokens=True, step_reward=0.25)
    seen = set()
    for i, task in enumerate(suite.tasks("train", 8)):
        agent = suite.agent({"temperature": 1.0, "max_tokens": 2, "seed": 100 + i})
        run = asyncio.run(run_agent(h.gateway, agent, task, group_id="chain"))
        ep = h.pool.get_episode(run.episode_id)
        right = run.outcome.info["steps_right"]
        first = [c.completion_token_ids[0] for c in ep.calls]
        assert all(t % 2 == 0 for t in first[:right])
        if right < 3:  # the episode stopped at the first odd token: no call after it
            assert len(first) == right + 1 and first[right] % 2 == 1
        else:
            assert len(first) == 3
        steps = [(r["name"], r["value"], r["call_id"]) for r in ep.meta.get("rewards", []) if r["name"] == "step_right"]
        assert steps == [("step_right", 0.25, c.call_id) for c in ep.calls[:right]]
        score = suite.score(task, run.outcome, ep.calls)
        assert score == {"outcome": float(right == 3), "steps_right": right / 3}
        seen.add(right)
    assert len(seen) >= 2  # the seeds reach different depths of the chain
