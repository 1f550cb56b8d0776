"""The synchronous agentic-RL step: B tasks x G episodes through the gateway, wait for all, score,
GRPO advantages, drop zero-variance groups, train one step, publish the weights (version + 1).

Every episode runs as a white-box agent on the gateway's one recording path, so the samples the
trainer sees are built from the data pool's token ids (``episode_samples``), never from text.
Episodes are seeded from (run seed, step, task, member): a resumed run samples exactly what the
uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from arborl.agents import AgentOutcome, run_agent
from arborl.config import Config
from arborl.engine import AsyncEngine
from arborl.gateway.core import Gateway
from arborl.gateway.samples import episode_samples
from arborl.datapool import DataPool
from arborl.rewards import grpo_advantages, reward_to_go_advantages, turn_rewards, zero_variance_mask
from arborl.tasks import TaskSuite
from arborl.train.trainer import Trainer
from arborl.types import Call, EpisodeStatus, FinishReason, Sample, Task


def episode_seed(*parts: Any) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)


@dataclass
class ScoredEpisode:
    task: Task
    group_id: str
    episode_id: str
    status: EpisodeStatus
    outcome: AgentOutcome | None
    calls: list[Call]
    components: dict[str, float]
    reward: float
    duration_s: float
    process_rewards: list[dict[str, Any]] = field(default_factory=list)  # the agent's step rewards (C1)

    def turn_process_rewards(self) -> list[float]:
        """Process rewards summed per turn (turn k = the episode's k-th kept call, as in chunk ids):
        a reward names its call, else the call it came after, else the last turn."""
        kept = [c.call_id for c in self.calls if c.finish_reason != FinishReason.ABORT.value]
        out = [0.0] * len(kept)
        for r in self.process_rewards:
            ref = r.get("call_id") or r.get("after_call")
            k = kept.index(ref) if ref in kept else len(kept) - 1
            if k >= 0:
                out[k] += float(r["value"])
        return out

    @property
    def usable(self) -> bool:
        """Failed or aborted episodes (infrastructure, timeouts) are not trained on."""
        return self.status == EpisodeStatus.FINISHED and bool(self.calls)


@dataclass
class BatchStats:
    episodes: int = 0
    unusable: int = 0
    groups: int = 0
    zero_variance_groups: int = 0
    samples: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class SyncController:
    def __init__(
        self,
        cfg: Config,
        gateway: Gateway,
        engines: list[AsyncEngine],
        pool: DataPool,
        trainer: Trainer,
        suite: TaskSuite,
        *,
        version: int = 0,
    ) -> None:
        self.cfg = cfg
        self.gateway = gateway
        self.engines = engines
        self.pool = pool
        self.trainer = trainer
        self.suite = suite
        self.version = version
        self._scheduled = None  # the async-consumption driver (rollout/scheduled.py), made on first use

    # -- episodes ---------------------------------------------------------------------------------
    def _sampling(self, temperature: float, seed: int) -> dict[str, Any]:
        r = self.cfg.rollout
        return {"temperature": temperature, "top_p": r.top_p, "max_tokens": r.max_tokens, "seed": seed}

    async def _episode(self, task: Task, group_id: str, sampling: dict[str, Any]) -> ScoredEpisode:
        agent = self.suite.agent(sampling)
        run = await run_agent(self.gateway, agent, task, group_id=group_id, timeout_s=self.cfg.rollout.agent_timeout_s)
        episode = await asyncio.to_thread(self.pool.get_episode, run.episode_id)
        calls = episode.calls if episode else []
        components = self.suite.score(task, run.outcome, calls) if run.status == EpisodeStatus.FINISHED else {}
        reward = float(components.get("outcome", 0.0))
        await asyncio.to_thread(
            self.pool.update_episode, run.episode_id, reward=reward, reward_components=components
        )
        return ScoredEpisode(task, group_id, run.episode_id, run.status, run.outcome, calls, components, reward,
                             run.duration_s, list(episode.meta.get("rewards", [])) if episode else [])

    async def run_group_batch(self, tasks: list[Task], group_size: int, *, temperature: float, tag: str) -> list[ScoredEpisode]:
        jobs = []
        for task in tasks:
            gid = f"{tag}:{task.task_id}"
            for member in range(group_size):
                seed = episode_seed(self.cfg.seed, tag, task.task_id, member)
                jobs.append(self._episode(task, gid, self._sampling(temperature, seed)))
        return list(await asyncio.gather(*jobs))

    # -- samples ----------------------------------------------------------------------------------
    def build_samples(self, episodes: list[ScoredEpisode]) -> tuple[list[Sample], BatchStats]:
        stats = BatchStats(episodes=len(episodes))
        usable = [e for e in episodes if e.usable]
        stats.unusable = len(episodes) - len(usable)
        if not usable:
            return [], stats
        rewards = torch.tensor([e.reward for e in usable], dtype=torch.float64)
        groups = [e.group_id for e in usable]
        stats.groups = len(set(groups))
        adv_cfg = self.cfg.train.advantage
        keep = torch.ones(len(usable), dtype=torch.bool)
        if adv_cfg.drop_zero_variance:
            zero = zero_variance_mask(rewards, groups, tol=adv_cfg.zero_variance_tol)
            stats.zero_variance_groups = len({g for g, z in zip(groups, zero.tolist()) if z})
            keep = ~zero
        per_turn = adv_cfg.estimator == "reward_to_go"
        if per_turn:  # C3 + C4: return from each turn to the end, minus the group mean, per chunk
            turns = [turn_rewards(e.reward, len(p), p) for e in usable for p in [e.turn_process_rewards()]]
            adv = reward_to_go_advantages(turns, groups, gamma=adv_cfg.gamma, std_normalize=adv_cfg.std_normalize,
                                          eps=adv_cfg.eps)
        else:
            adv = grpo_advantages(rewards, groups, std_normalize=adv_cfg.std_normalize, eps=adv_cfg.eps)
        tempered = self.cfg.rollout.temperature != 1.0
        samples: list[Sample] = []
        for e, a, k in zip(usable, adv.tolist(), keep.tolist()):
            if not k:
                continue
            for st in episode_samples(e.calls):
                token_adv = [a[c] * m for c, m in zip(st.chunk_ids, st.loss_mask)] if per_turn else a
                s = st.to_sample(group_id=e.group_id, reward=e.reward, advantages=token_adv)
                if tempered:  # the trainer scores softmax(logits / T): compare with the same distribution
                    s.rollout_logprobs = list(st.sample_logprobs)
                samples.append(s)
        stats.samples = len(samples)
        return samples, stats

    # -- weights ----------------------------------------------------------------------------------
    async def publish(self) -> float:
        """Send the trainer's weights to every engine as version + 1; returns seconds."""
        t0 = time.perf_counter()
        state = await asyncio.to_thread(self.trainer.engine_state)
        self.version += 1
        dispatcher = self.gateway.dispatcher
        abort_resume = dispatcher is not None and self.cfg.scheduling.partial_rollout == "abort_resume"
        async with dispatcher.updating(abort_resume=abort_resume) if dispatcher else contextlib.nullcontext():
            # abort_resume: requests in flight stopped before the load; they resume under the new weights
            await asyncio.gather(*(eng.update_weights(state, self.version) for eng in self.engines))
        return time.perf_counter() - t0

    # -- one step, one evaluation -----------------------------------------------------------------
    async def train_step(self, step: int) -> dict[str, float]:
        s = self.cfg.scheduling
        if s.consume != "sync" or s.oversample > 0:  # consumption policies (rollout/scheduled.py)
            if self._scheduled is None:
                from arborl.rollout.scheduled import ScheduledRollout

                self._scheduled = ScheduledRollout(self)
            return await self._scheduled.train_step(step)
        r = self.cfg.rollout
        t0 = time.perf_counter()
        dispatcher = self.gateway.dispatcher
        if dispatcher is not None and self.cfg.scheduling.timeline:  # per-piece spans (engine, chunk) for the Gantt
            from arborl.rollout.timeline import Timeline

            dispatcher.record(Timeline(), t0=time.time(), step=step)
        tasks = self.suite.tasks("train", r.batch_tasks, seed=episode_seed(self.cfg.seed, "tasks", step) % 2**31)
        episodes = await self.run_group_batch(tasks, r.group_size, temperature=r.temperature, tag=f"step{step}")
        rollout_s = time.perf_counter() - t0
        samples, stats = self.build_samples(episodes)
        train_metrics: dict[str, float] = {}
        publish_s = 0.0
        if samples:
            train_metrics = await asyncio.to_thread(self.trainer.train_step, samples)
            publish_s = await self.publish()
        gen_tokens = sum(len(c.completion_token_ids) for e in episodes for c in e.calls)
        if self.cfg.scheduling.timeline:
            from arborl.rollout.scheduled import write_step_timeline
            from arborl.rollout.timeline import Timeline

            if dispatcher is not None:
                tl = dispatcher.timeline
                dispatcher.record(None, t0=0.0, step=step)
            else:
                tl, wall0 = Timeline(), min((c.created_at - c.latency_s for e in episodes for c in e.calls), default=0.0)
                for e in episodes:
                    tl.add_calls(e.calls, group_id=e.group_id, step=step, t0=wall0)
            await asyncio.to_thread(write_step_timeline, tl, self.cfg.run_dir, step, f"{self.cfg.name} step {step + 1} (sync)")
        return {
            "step": step + 1,
            "reward": sum(e.reward for e in episodes) / len(episodes),
            "success": sum(e.components.get("outcome", 0.0) >= 1.0 for e in episodes) / len(episodes),
            "tool_use": sum(e.components.get("used_tool", 0.0) for e in episodes) / len(episodes),
            "episodes": stats.episodes,
            "unusable_episodes": stats.unusable,
            "zero_variance_groups": stats.zero_variance_groups,
            "samples": stats.samples,
            "generated_tokens": gen_tokens,
            "rollout_s": rollout_s,
            "rollout_tokens_per_s": gen_tokens / rollout_s if rollout_s else 0.0,
            "train_s": train_metrics.get("train/step_s", 0.0),
            "publish_s": publish_s,
            "step_s": time.perf_counter() - t0,
            "policy_version": self.version,
            **self.dispatch_metrics(),
            **{k: v for k, v in train_metrics.items() if k != "train/step"},
        }

    def dispatch_metrics(self) -> dict[str, float]:
        """The gateway dispatcher's counters so far (pieces, migrations, resumed, ...), when it has one."""
        d = self.gateway.dispatcher
        return {f"dispatch/{k}": v for k, v in d.stats().items()} if d is not None else {}

    async def evaluate(self, n: int) -> dict[str, float]:
        """Held-out success: one episode per eval task at ``eval_temperature``."""
        if n <= 0:
            return {}
        tasks = self.suite.tasks("eval", n, seed=0)
        t0 = time.perf_counter()
        episodes = await self.run_group_batch(tasks, 1, temperature=self.cfg.rollout.eval_temperature,
                                              tag=f"eval-v{self.version}")
        return {
            "eval_success": sum(e.components.get("outcome", 0.0) >= 1.0 for e in episodes) / len(episodes),
            "eval_reward": sum(e.reward for e in episodes) / len(episodes),
            "eval_tool_use": sum(e.components.get("used_tool", 0.0) for e in episodes) / len(episodes),
            "eval_s": time.perf_counter() - t0,
        }
