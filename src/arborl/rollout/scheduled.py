"""Asynchronous consumption in the real controller: GRPO groups kept in flight under a consumption
policy (``scheduling.consume`` = async_ratio or windowed_fifo), batches handed to the trainer.

``SyncController.train_step`` delegates here when the policy is not ``sync`` (or is ``sync`` with
over-sampling: the surplus groups are cancelled once the batch is full): a group starts
whenever the policy allows it (its episodes run through the gateway like the synchronous path's),
a finished group is reported with the oldest policy version among its tokens, and each training
step waits for the policy's next batch, trains on it (GRPO inside each group; stale tokens masked
when ``scheduling.stale_token_mask`` is set), publishes the weights and cancels the groups the
policy gives up. Engines keep generating during training: requests in flight when the weights
change continue and their later tokens carry the new version (partial rollout, ``continue``).
The consumption decisions are made by the same policy class the simulator drives.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from arborl.rollout.consume import make_consume
from arborl.rollout.partial import mask_stale
from arborl.rollout.timeline import Timeline
from arborl.types import ArborlError

if TYPE_CHECKING:
    from arborl.rollout.sync import ScoredEpisode, SyncController


class ScheduledRollout:
    def __init__(self, ctl: "SyncController") -> None:
        self.ctl = ctl
        cfg = ctl.cfg
        s = cfg.scheduling
        self.policy = make_consume(s.consume, cfg.rollout.batch_tasks, alpha=s.async_ratio, window=s.window,
                                   oversample=s.oversample, max_version_gap=s.max_version_gap, version=ctl.version)
        self._tasks: dict[str, asyncio.Task] = {}
        self._episodes: dict[str, list["ScoredEpisode"]] = {}
        self._changed = asyncio.Event()
        self._next = 0
        self.t0 = time.time()
        self.timeline = Timeline() if s.timeline else None
        self.dispatcher = ctl.gateway.dispatcher  # when set, it records per-piece spans into the timeline

    # -- producer ---------------------------------------------------------------------------------
    def _fill(self) -> None:
        from arborl.rollout.sync import episode_seed

        cfg = self.ctl.cfg
        while self.policy.can_start():
            idx = self._next
            self._next += 1
            task = self.ctl.suite.tasks("train", 1, seed=episode_seed(cfg.seed, "async-task", idx) % 2**31)[0]
            tag = f"async{idx}"
            gid = f"{tag}:{task.task_id}"
            self.policy.on_start(gid)
            self._tasks[gid] = asyncio.create_task(self._group(gid, task, tag))

    async def _group(self, gid: str, task, tag: str) -> None:
        r = self.ctl.cfg.rollout
        try:
            eps = await self.ctl.run_group_batch([task], r.group_size, temperature=r.temperature, tag=tag)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one group's crash never stops the others
            self.policy.on_fail(gid)
        else:
            vs = [v for e in eps for c in e.calls for v in c.versions]
            self._episodes[gid] = eps
            self.policy.on_finish(gid, min(vs) if vs else None)
        finally:
            self._tasks.pop(gid, None)
            self._changed.set()

    def cancel(self, gids) -> None:
        for gid in gids:
            t = self._tasks.pop(gid, None)
            if t is not None:
                t.cancel()
            self._episodes.pop(gid, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self.cancel(list(self._tasks))
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _next_batch(self):
        while True:
            self._changed.clear()
            self._fill()
            b = self.policy.take_batch()
            if b is not None:
                return b
            if not self._tasks:
                raise ArborlError(f"consumption policy {self.policy.name} waits for a batch but no group is in "
                                  f"flight: {self.policy.stats()}")
            await self._changed.wait()

    # -- one training step ------------------------------------------------------------------------
    async def train_step(self, step: int) -> dict[str, float]:
        ctl, cfg = self.ctl, self.ctl.cfg
        t0 = time.perf_counter()
        if self.dispatcher is not None and self.timeline is not None:
            self.dispatcher.record(self.timeline, t0=self.t0, step=step)
        b = await self._next_batch()
        wait_s = time.perf_counter() - t0
        self.cancel(b.cancel)
        for gid in b.dropped:
            self._episodes.pop(gid, None)
        groups = {gid: self._episodes.pop(gid) for gid in b.items}
        episodes = [e for eps in groups.values() for e in eps]
        samples, stats = ctl.build_samples(episodes)
        masked = 0
        if cfg.scheduling.stale_token_mask is not None:
            out = [mask_stale(x, ctl.version, cfg.scheduling.stale_token_mask) for x in samples]
            samples, masked = [x for x, _ in out], sum(n for _, n in out)
        gap = max((ctl.version - min(v for e in eps for c in e.calls for v in c.versions or [ctl.version])
                   for eps in groups.values()), default=0)
        train_metrics: dict[str, float] = {}
        publish_s = 0.0
        if samples:
            train_metrics = await asyncio.to_thread(ctl.trainer.train_step, samples)
            publish_s = await ctl.publish()
            self.cancel(self.policy.on_version(ctl.version))
        if self.timeline is not None:
            for gid, eps in groups.items() if self.dispatcher is None else ():
                for e in eps:
                    self.timeline.add_calls(e.calls, group_id=gid, step=step, t0=self.t0)
            self.timeline.mark(time.time() - self.t0, "publish", step=step)
            write_step_timeline(self.timeline, cfg.run_dir, step, f"{cfg.name} step {step + 1} ({self.policy.name})")
        if step + 1 >= cfg.rollout.steps:
            await self.close()
        gen_tokens = sum(len(c.completion_token_ids) for e in episodes for c in e.calls)
        step_s = time.perf_counter() - t0
        n = max(1, len(episodes))
        st = self.policy.stats()
        return {
            "step": step + 1,
            "reward": sum(e.reward for e in episodes) / n,
            "success": sum(e.components.get("outcome", 0.0) >= 1.0 for e in episodes) / n,
            "tool_use": sum(e.components.get("used_tool", 0.0) for e in episodes) / n,
            "episodes": stats.episodes,
            "unusable_episodes": stats.unusable,
            "zero_variance_groups": stats.zero_variance_groups,
            "samples": stats.samples,
            "generated_tokens": gen_tokens,
            "rollout_s": wait_s,
            "rollout_tokens_per_s": gen_tokens / step_s if step_s else 0.0,
            "train_s": train_metrics.get("train/step_s", 0.0),
            "publish_s": publish_s,
            "step_s": step_s,
            "policy_version": ctl.version,
            "sched/max_version_gap": gap,
            "sched/dropped_groups": st["dropped"],
            "sched/cancelled_groups": st["cancelled"],
            "sched/in_flight_groups": len(self._tasks),
            "sched/masked_tokens": masked,
            **ctl.dispatch_metrics(),
            **{k: v for k, v in train_metrics.items() if k != "train/step"},
        }


def write_step_timeline(timeline: Timeline, run_dir, step: int, title: str) -> None:
    """The step's Gantt PNG, and its spans appended to spans.jsonl, under <run_dir>/timeline/."""
    from pathlib import Path

    d = Path(run_dir) / "timeline"
    d.mkdir(parents=True, exist_ok=True)
    timeline.gantt(d / f"step{step + 1:04d}.png", title=title, step=step)
    timeline.write_jsonl(d / "spans.jsonl", step=step, append=True)
