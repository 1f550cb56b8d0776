"""Guess the number as a verifiers (0.4, ``verifiers.v1``) environment: a taskset of secrets, an ``Env``
whose ``run`` answers each guess with "higher" / "lower" (the multi-turn environment response), and two
rewards: ``found`` (weight 1) and ``valid`` (weight 0.1: the share of replies that are a number).
Nothing in it knows about arborl; configs/verifiers.yaml trains on it.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

HIGH = 16
PROMPT = (f"Guess my secret number from 1 to {HIGH}. Reply with just the number. After each guess I tell you "
          "whether my number is higher or lower.")
_NUMBER = re.compile(r"-?\d+")


def guess_of(text: str | None) -> int | None:
    found = _NUMBER.search(text or "")
    return int(found.group()) if found else None


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def found(self, task: GuessData, trace: vf.Trace) -> float:
        return float(any(guess_of(m.content) == task.secret for m in trace.assistant_messages))

    @vf.reward(weight=0.1)
    async def valid(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return sum(guess_of(m.content) is not None for m in replies) / len(replies) if replies else 0.0


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for i in range(400):
            yield GuessTask(GuessData(id=f"guess-{i}", prompt=PROMPT, secret=rng.randint(1, HIGH)), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret = task.data.secret
        async with agents.player.interaction(task) as it:
            seg = await it.turn()
            for _ in range(4):
                guess = guess_of(it.trace.last_reply)
                if seg.terminated or guess == secret:
                    break
                if guess is None:
                    seg = await it.turn(f"Reply with just a number from 1 to {HIGH}.")
                else:
                    hint = "higher" if guess < secret else "lower"
                    seg = await it.turn(f"{guess} is wrong: my number is {hint}. Guess again.")


__all__ = ["GuessTaskset", "GuessEnv"]
