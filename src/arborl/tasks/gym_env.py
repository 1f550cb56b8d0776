"""The ``gym`` task suite (X1): a Gymnasium-style text environment, multi-turn through the white-box loop
(``rollout.task=gym``, knobs ``rollout.gym.*``).

Two conventions are accepted, told apart by the environment's methods:

* **Gymnasium** (``gymnasium.Env``, GEM's ``gem.Env``, or any object with these methods):
  ``reset(seed=...) -> (observation, info)``, ``step(action) -> (observation, reward, terminated,
  truncated, info)``. A task is a reset seed: training draws seeds below ``rollout.gym.eval_seed``,
  evaluation uses ``eval_seed, eval_seed + 1, ...`` (the same every time), so the splits are disjoint
  and a group's episodes start from the same state.
* **SkyRL-Gym** (``skyrl_gym.envs.base_text_env.BaseTextEnv``, or an object with ``init`` and no
  ``reset``): ``init(prompt) -> (messages, info)``, ``step(action) -> {"observations", "reward",
  "done", "metadata"}``. A task is a row of ``rollout.data.train_files`` / ``eval_files``; the env is
  built as ``Env(env_config=rollout.gym.env_kwargs, extras=<the row's other columns>)``, as SkyRL does.

Observations and actions are text: an observation is a string (one user message), a chat message or
a list of them; the action is the model's reply text. Each episode builds a fresh environment, runs
at most ``rollout.max_turns`` model turns and closes it. Per-turn rewards: each turn's reward but the
last is a process reward on that turn's call (C1); the last turn's reward is the episode's
``outcome`` (success, for evaluation). With ``train.advantage.shaping.process_weight=1`` the trained
return is exactly the environment's return, which is also reported as the ``return`` component.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from arborl.agents import AgentLoop, AgentOutcome
from arborl.agents.client import SessionClient
from arborl.agents.react import task_messages
from arborl.config import ConfigError
from arborl.registry import RegistryError, load_object
from arborl.tasks.data_files import load_tasks
from arborl.tasks.dataset import copy_task, draw_rows
from arborl.types import Call, Task

if TYPE_CHECKING:
    from arborl.config import RolloutConfig


class GymEnvError(ConfigError):
    """The environment cannot be loaded, or does not speak text the way this adapter reads it."""


def env_convention(env: Any) -> str:
    """``"gymnasium"`` or ``"skyrl"`` for an environment class or instance (its methods decide)."""
    has = {m: callable(getattr(env, m, None)) for m in ("reset", "init", "step")}
    if not has["step"]:
        raise GymEnvError(f"{_name(env)} has no step(action) method: not a Gymnasium-style environment")
    if has["reset"]:
        return "gymnasium"
    if has["init"]:
        return "skyrl"
    raise GymEnvError(f"{_name(env)} has neither reset(seed) (Gymnasium, GEM) nor init(prompt) (SkyRL-Gym)")


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


def as_messages(observation: Any, where: str) -> list[dict[str, Any]]:
    """An observation as chat messages: a string is one user message; a message or a list of them pass."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict) and isinstance(observation.get("content"), str):
        return [{"role": observation.get("role", "user"), "content": observation["content"]}]
    if isinstance(observation, (list, tuple)) and all(isinstance(m, dict) for m in observation):
        return [m for o in observation for m in as_messages(o, where)]
    raise GymEnvError(f"{where} is a {type(observation).__name__}, not text: this adapter trains on environments "
                      "whose observations are strings or chat messages")


def _reward(value: Any, where: str) -> float:
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise GymEnvError(f"{where}: reward {value!r} is not a number") from None
    if not math.isfinite(r):
        raise GymEnvError(f"{where}: reward {r} is not finite")
    return r


@dataclass
class StepResult:
    messages: list[dict[str, Any]]  # the observation, as chat messages for the next turn
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class EnvEpisode:
    """One live environment, spoken to in one convention: ``start`` then ``step`` until done."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.convention = env_convention(env)

    def start(self, task: Task) -> list[dict[str, Any]]:
        if self.convention == "gymnasium":
            obs, _info = self.env.reset(seed=int(task.metadata["seed"]))
            return as_messages(obs, f"{_name(self.env)}.reset()'s observation")
        prompt = task_messages(task)
        messages, _info = self.env.init(prompt)
        return as_messages(messages, f"{_name(self.env)}.init()'s observation")

    def step(self, action: str) -> "StepResult":
        """What one action brought: observation messages, reward, terminated / truncated, info."""
        where = f"{_name(self.env)}.step()"
        out = self.env.step(action)
        if self.convention == "gymnasium":
            if not (isinstance(out, tuple) and len(out) == 5):
                raise GymEnvError(f"{where} returned {type(out).__name__}; the Gymnasium convention is a 5-tuple "
                                  "(observation, reward, terminated, truncated, info)")
            obs, reward, terminated, truncated, info = out
            done = bool(terminated) or bool(truncated)
            messages = [] if done and obs in (None, "") else as_messages(obs, f"{where}'s observation")
            return StepResult(messages, _reward(reward, where), bool(terminated), bool(truncated), dict(info or {}))
        if not isinstance(out, dict) or not {"observations", "reward", "done"} <= set(out):
            raise GymEnvError(f"{where} returned {type(out).__name__}; the SkyRL-Gym convention is a dict with "
                              "observations, reward, done, metadata")
        obs = out["observations"] or []
        return StepResult(as_messages(obs, f"{where}'s observations"), _reward(out["reward"], where),
                          bool(out["done"]), False, dict(out.get("metadata") or {}))

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class GymAgent:
    """The white-box loop over one environment: reply -> env.step(reply text) -> observation -> ..."""

    def __init__(self, make_env: Callable[[Task], Any], *, system_prompt: str | None, max_turns: int,
                 **sampling: Any) -> None:
        self.make_env = make_env
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.sampling = sampling

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome:
        episode = EnvEpisode(await asyncio.to_thread(self.make_env, task))
        try:
            return await self._run(episode, task, client)
        finally:
            await asyncio.to_thread(episode.close)

    async def _run(self, episode: EnvEpisode, task: Task, client: SessionClient) -> AgentOutcome:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages += await asyncio.to_thread(episode.start, task)
        rewards: list[float] = []
        reply, result = None, None
        for turn in range(self.max_turns):
            reply = await client.chat(messages, **self.sampling)
            messages.append(reply.message)
            result = await asyncio.to_thread(episode.step, reply.content or "")
            rewards.append(result.reward)
            await client.interaction(kind="env_step", call_id=reply.call_id, reward=result.reward,
                                     terminated=result.terminated, truncated=result.truncated,
                                     observation=result.messages)
            if result.done:
                break
            if result.reward and turn < self.max_turns - 1:  # not the last turn's: a process reward on its call
                await client.reward(result.reward, name="env", call_id=reply.call_id)
            messages += result.messages
        info = result.info if result is not None else {}
        return AgentOutcome(answer=reply.content if reply else None,
                            info={"rewards": rewards, "terminated": bool(result and result.terminated),
                                  "turns": len(rewards), **({"env_info": _plain(info)} if info else {})})


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """The JSON-storable part of an env's info dict (numbers, strings, booleans)."""
    return {str(k): v for k, v in info.items() if isinstance(v, (str, int, float, bool)) or v is None}


class GymSuite:
    """Tasks, agent and score of a Gymnasium-style environment (module docstring)."""

    name = "gym"

    def __init__(self, rollout: "RolloutConfig") -> None:
        gym = rollout.gym
        if not gym.env:
            raise GymEnvError("rollout.task=gym needs rollout.gym.env: package.module:attr or path/to/file.py:attr "
                              "naming the environment class or factory")
        try:
            self.factory = load_object(gym.env)
        except RegistryError as e:
            raise GymEnvError(f"rollout.gym.env: {e}") from None
        if not callable(self.factory):
            raise GymEnvError(f"rollout.gym.env: {gym.env} is a {type(self.factory).__name__}, not a class or factory")
        self.gym = gym
        self.max_turns = rollout.max_turns
        probe = self.factory if inspect.isclass(self.factory) else None
        self.convention = env_convention(probe) if probe is not None else None  # a factory: known per instance
        data = rollout.data
        self.rows: dict[str, list[Task]] = {}
        if self.convention == "skyrl" or (self.convention is None and data.train_files):
            if not data.train_files:
                raise GymEnvError(f"{gym.env} takes a prompt (SkyRL-Gym convention): give its rows in "
                                  "rollout.data.train_files (and eval_files)")
            keys = dict(prompt_key=data.prompt_key, answer_key=None)
            self.rows["train"] = load_tasks(data.train_files, "train", knob="rollout.data.train_files", **keys)
            self.rows["eval"] = (load_tasks(data.eval_files, "eval", knob="rollout.data.eval_files", **keys)
                                 if data.eval_files else [])
            if rollout.eval_tasks and not self.rows["eval"]:
                raise GymEnvError(f"rollout.eval_tasks={rollout.eval_tasks} needs rollout.data.eval_files with this "
                                  "environment's held-out rows, or rollout.eval_tasks=0")

        self._probe()

    def _probe(self) -> None:
        """Build one held-out (or training) environment and start it: a factory that fails, or an
        observation that is not text, stops the job before the model loads."""
        split = "eval" if (self.rows.get("eval") or not self.rows) else "train"
        task = self.tasks(split, 1)[0]
        try:
            episode = EnvEpisode(self.make_env(task))
        except GymEnvError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's constructor: say which knob built it
            raise GymEnvError(f"rollout.gym.env: building {self.gym.env} with rollout.gym.env_kwargs="
                              f"{self.gym.env_kwargs} failed: {e!r}") from e
        try:
            episode.start(task)
        except GymEnvError:
            raise
        except Exception as e:  # noqa: BLE001
            raise GymEnvError(f"rollout.gym.env: starting {self.gym.env} ({task.task_id}) failed: {e!r}") from e
        finally:
            episode.close()

    def make_env(self, task: Task) -> Any:
        kwargs = dict(self.gym.env_kwargs)
        if not self.rows:  # Gymnasium convention
            return self.factory(**kwargs)
        return self.factory(env_config=_env_config(kwargs), extras=dict(task.metadata))

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if self.rows:
            rows = self.rows[split]
            return draw_rows(rows, n, seed) if split == "train" else [copy_task(t) for t in rows[:n]]
        if split == "eval":
            seeds = [self.gym.eval_seed + i for i in range(n)]
        else:
            seeds = random.Random(seed).sample(range(self.gym.eval_seed), n)
        return [Task(task_id=f"gym-{split}-{s}", prompt=f"{self.gym.env} reset(seed={s})", metadata={"seed": s},
                     split=split) for s in seeds]

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        return GymAgent(self.make_env, system_prompt=self.gym.system_prompt, max_turns=self.max_turns, **sampling)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        rewards = list((outcome.info if outcome is not None else {}).get("rewards", []))
        return {"outcome": rewards[-1] if rewards else 0.0, "return": float(sum(rewards)),
                "terminated": float(bool(outcome and outcome.info.get("terminated")))}


def _env_config(kwargs: dict[str, Any]) -> Any:
    """SkyRL envs read their config as an OmegaConf DictConfig (attribute or key access); a dict otherwise."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return kwargs
    return OmegaConf.create(kwargs)
