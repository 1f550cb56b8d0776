"""Guess the number: a multi-turn Gymnasium text environment (configs/gym.yaml trains on it).

The environment thinks of a number in [1, high]; each turn the agent replies with a guess and hears
whether to go higher or lower. Reward 1 for the correct guess (the episode ends); a wrong guess that is
a number earns ``format_reward`` (a per-turn reward: arborl trains it as a process reward on that
turn); a reply without a number earns 0 and is told how to answer. A plain ``gymnasium.Env`` with
``Text`` spaces: nothing in it knows about arborl.
"""

from __future__ import annotations

import re

import gymnasium as gym
from gymnasium import spaces

_NUMBER = re.compile(r"-?\d+")


class GuessNumberEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, high: int = 16, max_guesses: int = 5, format_reward: float = 0.1) -> None:
        self.high = high
        self.max_guesses = max_guesses
        self.format_reward = format_reward
        self.observation_space = spaces.Text(max_length=400)
        self.action_space = spaces.Text(max_length=2000)
        self.secret = 0
        self.guesses = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(1, self.high + 1))
        self.guesses = 0
        return (f"Guess my secret number from 1 to {self.high}. Reply with just the number. After each guess I "
                "tell you whether my number is higher or lower."), {"secret": self.secret}

    def step(self, action: str):
        self.guesses += 1
        truncated = self.guesses >= self.max_guesses
        found = _NUMBER.search(action)
        if found is None:
            return f"Reply with just a number from 1 to {self.high}.", 0.0, False, truncated, {}
        guess = int(found.group())
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {"guesses": self.guesses}
        hint = "higher" if guess < self.secret else "lower"
        return f"{guess} is wrong: my number is {hint}. Guess again.", self.format_reward, False, truncated, {}
