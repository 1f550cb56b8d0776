"""The controller: the one step loop of a training run.

Episodes run as white-box agents through the gateway (so every token is recorded in the data pool),
grouped G to a task (the GRPO group). A **consumption policy** (``scheduling.consume``, a registry of
``scheduling/consume.py``: sync, async_ratio, windowed_fifo, or the user's own) decides when groups
start and which finished groups the trainer takes: ``sync`` starts a step's B groups at the
trainer's version and waits for all of them (on-policy); the asynchronous policies keep groups in
flight while the trainer trains. Each step then

1. waits for the policy's next batch of finished groups (cancelling those it gives up),
2. reads the groups' episodes back from the data pool and scores them with the task suite,
3. builds the samples (``train/samples.py``: tokens, loss mask, log-probs, versions, advantages),
   loss-masks stale tokens when ``scheduling.stale_token_mask`` is set,
4. trains one step and publishes the weights to the engine pool as version + 1,
5. writes one row of metrics (and the rollout timeline when ``scheduling.timeline``).

Tasks are drawn from the suite B at a time (draw k seeded by (run seed, k)); the k-th draw is the
batch a synchronous step k trains on. Episodes are seeded from (run seed, draw, task, member): a
resumed run samples exactly what the uninterrupted run would have.

Exactly once across a kill: every group of the task stream is in the data pool's ledger (its stream
position, state, the attempt), every training of an episode too (step, attempt). A checkpoint keeps the
stream's position and the consumption policy's open groups (``snapshot``); a resumed controller
``restore``s them and starts them again, and a training group whose members the data pool already holds
finished and scored (committed before the kill, by this lineage or a lost one) runs only its missing
members: committed episodes are trained once, never dropped, never generated twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborl.agents import AGENTS, run_agent
from arborl.agents.served import serve_http, serve_unix
from arborl.config import Config, JudgeConfig
from arborl.datapool import DataPool
from arborl.engine.pool import EnginePool
from arborl.failpoints import failpoint
from arborl.gateway.audit import call_drifted
from arborl.gateway.core import Gateway
from arborl.rewards.shaping import task_reward
from arborl.scheduling.consume import make_consume
from arborl.scheduling.curriculum import Curriculum, CurriculumError
from arborl.scheduling.partial import mask_stale
from arborl.scheduling.timeline import Timeline
from arborl.seeding import derive_seed
from arborl.tasks import TaskSuite
from arborl.tasks.judge import GatewayJudgeClient, Judge, OpenAIJudgeClient, apply_verdict
from arborl.train.mtp import make_mtp_trainer
from arborl.train.samples import build_samples, call_token_values
from arborl.train.face import TrainerFace
from arborl.types import ArborlError, Call, Episode, EpisodeStatus, Sample, Task
from arborl.workers import RemoteAgent, WorkerPool

if TYPE_CHECKING:
    import torch

_MAX_LOCKED_DRAWS = 64  # batches of locked tasks in a row before the curriculum is declared unsatisfiable


class Controller:
    """Rollout, consumption, training, publishing and evaluation of one run; see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        gateway: Gateway,
        engines: EnginePool,
        datapool: DataPool,
        trainer: TrainerFace | None,
        suite: TaskSuite,
        *,
        version: int = 0,
        start_step: int = 0,
    ) -> None:
        """``start_step``: the step a resumed run continues at (its task stream continues there too)."""
        self.cfg = cfg
        self.gateway = gateway
        self.engines = engines
        self.datapool = datapool
        self.trainer = trainer
        self.suite = suite
        self.make_agent = AGENTS.get(cfg.rollout.agent)
        self.version = version
        self.published_bytes = 0  # the last publish's tensors (under lora_sync=adapters: the adapters)
        self._base_of: object | None = None  # the trainer whose base weights the engines hold (lora_sync=adapters)
        self.policy = make_consume(cfg.scheduling, cfg.rollout.batch_tasks, version=version)
        self._running: dict[str, asyncio.Task] = {}  # group id -> its episodes in flight
        self._finished: dict[str, list[Episode]] = {}  # finished groups not yet consumed
        self._changed = asyncio.Event()
        self._started = start_step * cfg.rollout.batch_tasks  # the position in the task stream
        self._draws: dict[int, list[Task]] = {}
        self._open: dict[str, tuple[int, Task]] = {}  # group id -> (stream position, task), until trained or resolved
        self._restored: list[tuple[str, int, int]] = []  # (group id, position, start version) of restore()
        self._position: dict[str, int] = {}  # every started group's stream position (a snapshot's open groups)
        self.attempt = datapool.attempt()  # the ledger's attempt this process is (DataPool.begin_attempt)
        sc = cfg.scheduling
        self.curriculum = Curriculum(sc.curriculum_key, sc.curriculum, sc.curriculum_steps) if sc.curriculum_key else None
        self._step = start_step  # the training step being filled (0-based): the curriculum's clock
        self.t0 = time.time()
        self.timeline = Timeline() if cfg.scheduling.timeline else None
        self.workers: WorkerPool | None = None  # started on the first episode when rollout.workers > 0
        self._workers_lock = asyncio.Lock()
        self._exit: contextlib.AsyncExitStack | None = None
        self.infra_failures = 0  # episodes run again after an infrastructure failure
        self.judge = make_judge(cfg.rollout.judge, gateway) if hasattr(suite, "judge_input") else None
        # the mtp drafter's head, trained after each policy step and published with it (train.mtp)
        self.mtp = make_mtp_trainer(cfg, trainer.policy) if trainer is not None else None

    # -- episodes ---------------------------------------------------------------------------------
    async def _agent(self, sampling: dict[str, Any]):
        """The agent loop of one episode: in this process, or run by a rollout worker (rollout.workers)."""
        r = self.cfg.rollout
        if r.workers == 0:
            return self.make_agent(self.suite, sampling)
        async with self._workers_lock:
            if self.workers is None:
                self._exit = contextlib.AsyncExitStack()
                # Ray's rollout workers may run on other machines: the gateway listens on this node's address
                host = _node_address() if self.cfg.cluster.backend == "ray" else "127.0.0.1"
                base_url = await self._exit.enter_async_context(serve_http(self.gateway, host))
                unix_socket = await self._exit.enter_async_context(serve_unix(self.gateway))
                if self.cfg.cluster.backend == "ray":  # rollout workers as Ray actors (cluster/workers.py)
                    from arborl.cluster.workers import RayWorkerPool

                    pool = RayWorkerPool(r.workers, r, self.cfg.cluster, base_url=base_url,
                                         model=self.gateway.model_name, stall_s=r.worker_stall_s,
                                         unix_socket=unix_socket)
                else:
                    pool = WorkerPool(r.workers, r, base_url=base_url, model=self.gateway.model_name,
                                      stall_s=r.worker_stall_s, log_dir=Path(self.cfg.run_dir) / "workers",
                                      unix_socket=unix_socket)
                await pool.start()
                self._exit.push_async_callback(pool.close)
                self.workers = pool
        return RemoteAgent(self.workers, sampling)

    async def _episode(self, task: Task, group_id: str, sampling: dict[str, Any],
                       metadata: dict[str, Any] | None = None, replay: list[Call] | None = None) -> Episode:
        """One episode through the gateway, read back from the data pool and scored. An episode that
        fails for an infrastructure reason is recorded as such (never trained on) and run again, up
        to rollout.infra_retries times, so it does not count as a failure of the policy."""
        for attempt in range(self.cfg.rollout.infra_retries + 1):
            run = await run_agent(self.gateway, await self._agent(sampling), task, group_id=group_id,
                                  timeout_s=self.cfg.rollout.agent_timeout_s,
                                  metadata={**(metadata or {}), **({"attempt": attempt} if attempt else {})} or None,
                                  replay=replay if attempt == 0 else None)
            if not run.infra:
                break
            self.infra_failures += 1
        episode = await asyncio.to_thread(self.datapool.get_episode, run.episode_id)
        if episode is None:  # the session never reached the data pool
            episode = Episode(task.task_id, group_id, status=EpisodeStatus.FAILED, episode_id=run.episode_id)
        components = self.suite.score(task, run.outcome, episode.calls) if run.status == EpisodeStatus.FINISHED else {}
        meta = None
        if components and self.judge is not None:
            judged = self.suite.judge_input(task, run.outcome)
            if judged is not None:
                v = await self.judge.verdict(*judged, tag=f"judge:{run.episode_id}")
                j = self.cfg.rollout.judge
                components = apply_verdict(components, v, mode=j.mode, weight=j.weight)
                meta = {**episode.meta, "judge": v.to_dict()}
                episode.meta = meta
        episode.status = run.status
        episode.reward_components = components
        episode.reward = task_reward(components, self.cfg.train.advantage.shaping.component_weights)
        await asyncio.to_thread(self.datapool.update_episode, run.episode_id, reward=episode.reward,
                                reward_components=components, meta=meta)
        return episode

    async def run_groups(self, tasks: list[Task], group_size: int, *, temperature: float, tag: str) -> list[Episode]:
        """``group_size`` episodes of each task, all at once; group ids are ``tag:task_id``."""
        jobs = [self._member(task, f"{tag}:{task.task_id}", tag, m, temperature) for task in tasks for m in range(group_size)]
        return list(await asyncio.gather(*jobs))

    def _member(self, task: Task, gid: str, tag: str, member: int, temperature: float,
                metadata: dict[str, Any] | None = None, replay: list[Call] | None = None):
        r = self.cfg.rollout
        sampling = {"temperature": temperature, "top_p": r.top_p, "max_tokens": r.max_tokens,
                    "seed": derive_seed(self.cfg.seed, tag, task.task_id, member)}
        return self._episode(task, gid, sampling, metadata, replay)

    def _replayable(self, interrupted: Episode | None) -> list[Call]:
        """The calls of a member a kill interrupted that its re-run may be served from: the first ones whose
        tokens are at most the consumption's version bound behind the trainer (any, under sync: the policy
        is the checkpoint's, the one that generated them)."""
        if interrupted is None:
            return []
        sc = self.cfg.scheduling
        bound = sc.max_version_gap if sc.max_version_gap is not None else (
            math.ceil(sc.async_ratio - 1e-9) if self.policy.overlaps_training else 0)
        calls = []
        for c in interrupted.calls:
            if not c.versions or self.version - min(c.versions) > bound:
                break
            calls.append(c)
        return calls

    async def _stream_group(self, gid: str, task: Task, tag: str, position: int) -> list[Episode]:
        """The G episodes of a training group; in a resumed run (attempt 2 on), members the data pool already
        holds finished and scored (committed before a kill) are read back, not run again."""
        r = self.cfg.rollout
        held: dict[int, Episode] = {}
        interrupted: dict[int, Episode] = {}  # the latest run of a member a kill cut short (its calls recorded)
        earlier = await asyncio.to_thread(self.datapool.episodes, group_id=gid) if self.attempt > 1 else []
        for e in earlier:
            m = e.meta.get("member")
            if not isinstance(m, int) or e.status == EpisodeStatus.RUNNING:
                continue
            if e.reward is not None and m not in held:
                held[m] = e
            elif e.reward is None and e.meta.get("aborted") and e.calls:
                interrupted[m] = e
        todo = [m for m in range(r.group_size) if m not in held]
        ran = await asyncio.gather(*(self._member(task, gid, tag, m, r.temperature, {"member": m, "position": position},
                                                  self._replayable(interrupted.get(m))) for m in todo))
        return [held[m] if m in held else ran[todo.index(m)] for m in range(r.group_size)]

    # -- groups under the consumption policy ------------------------------------------------------
    def _next_task(self) -> tuple[Task, int, int]:
        """The next task of the stream, the draw it belongs to and its stream position."""
        position = self._started
        self._started += 1
        task, draw = self._task_at(position)
        if (position + 1) % self.cfg.rollout.batch_tasks == 0:
            self._draws.pop(draw, None)
        return task, draw, position

    def _task_at(self, position: int) -> tuple[Task, int]:
        b = self.cfg.rollout.batch_tasks
        draw, pos = divmod(position, b)
        if draw not in self._draws:
            self._draws[draw] = draw_tasks(self.suite, self.cfg.seed, b, draw)
        return self._draws[draw][pos], draw

    def _fill(self) -> None:
        restored, self._restored = self._restored, []
        for gid, position, start_version in restored:  # a checkpoint's open groups, in their order
            self._launch(gid, self._task_at(position)[0], position, start_version)
        admit = getattr(self.policy, "admit", None)  # a difficulty-aware policy may skip a drawn task
        locked = 0  # tasks in a row the curriculum passed over
        while self.policy.can_start():
            task, draw, position = self._next_task()
            tag = f"step{draw}"
            if self.curriculum is not None and not self.curriculum.admits(task.metadata, self._step):
                locked += 1
                if locked > _MAX_LOCKED_DRAWS * self.cfg.rollout.batch_tasks:
                    c = self.curriculum
                    raise CurriculumError(
                        f"scheduling.curriculum: {locked} tasks in a row had {c.key} outside {c.unlocked(self._step)} (the "
                        f"values unlocked at step {self._step + 1}); the train split may hold none of them: check "
                        f"scheduling.curriculum_key and scheduling.curriculum against the tasks' metadata")
                continue
            locked = 0
            if admit is not None and not admit(task.task_id):
                continue
            gid = f"{tag}:{task.task_id}"
            self.policy.on_start(gid)
            self._launch(gid, task, position, self.policy.version)

    def _launch(self, gid: str, task: Task, position: int, start_version: int) -> None:
        self._open[gid] = (position, task)
        self._position[gid] = position
        self.datapool.record_group(gid, position=position, task_id=task.task_id, start_version=start_version,
                                   state="running", attempt=self.attempt)
        self._running[gid] = asyncio.create_task(self._group(gid, task, gid.split(":", 1)[0], position))

    async def _group(self, gid: str, task: Task, tag: str, position: int) -> None:
        try:
            episodes = await self._stream_group(gid, task, tag, position)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one group's crash never stops the others
            self.policy.on_fail(gid)
            self._resolved([gid], "failed")
        else:
            versions = [v for v in (e.min_version() for e in episodes) if v is not None]
            on_rewards = getattr(self.policy, "on_rewards", None)  # per-task difficulty estimates (dynamic)
            if on_rewards is not None:
                on_rewards(gid, task.task_id, [e.reward or 0.0 for e in episodes if not e.meta.get("infra_error")])
            self._finished[gid] = episodes
            self.policy.on_finish(gid, min(versions) if versions else None)
            self.datapool.set_group_state([gid], "finished")
        finally:
            self._running.pop(gid, None)
            self._changed.set()

    def cancel(self, gids, reason: str = "") -> None:
        """Stop these groups (their requests are aborted in the engines) and forget their episodes."""
        gids = list(gids)
        for gid in gids:
            t = self._running.pop(gid, None)
            if t is not None:
                t.cancel()
            self._finished.pop(gid, None)
        self._resolved(gids, "cancelled", reason)

    def _resolved(self, gids: list[str], state: str, reason: str = "") -> None:
        """Groups the consumption policy resolved without training them, into the ledger."""
        gids = [g for g in gids if self._open.pop(g, None) is not None]
        if gids:
            self.datapool.set_group_state(gids, state, reason)

    # -- checkpoint -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any] | None:
        """The task stream's state for a checkpoint, between steps (None: the consumption policy keeps none)."""
        snap = getattr(self.policy, "snapshot", None)
        if snap is None:
            return None
        policy = snap()
        return {"position": self._started, "policy": policy,
                "open": {gid: self._position[gid] for gid in (o["item_id"] for o in policy["open"])},
                "curriculum_skipped": self.curriculum.skipped if self.curriculum is not None else 0}

    def restore(self, snap: dict[str, Any]) -> int:
        """Continue the task stream of a checkpoint: its position, the policy's state, and its open groups
        started again (their committed members read back from the data pool). Returns how many."""
        self._started = snap["position"]
        if self.curriculum is not None:
            self.curriculum.skipped = snap.get("curriculum_skipped", 0)
        starts = {o["item_id"]: o["start_version"] for o in snap["policy"]["open"]}
        gids = self.policy.restore(snap["policy"])
        self._restored = [(gid, snap["open"][gid], starts[gid]) for gid in gids]  # started by the first _fill
        return len(gids)

    async def close(self) -> None:
        """Cancel every group still in flight, wait until they are gone, stop the rollout workers."""
        tasks = list(self._running.values())
        self.cancel(list(self._running), "run ended")
        self._resolved(list(self._open), "cancelled", "run ended")  # finished, not taken: a checkpoint's snapshot has them
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._exit is not None:
            await self._exit.aclose()
            self._exit, self.workers = None, None

    async def _next_batch(self):
        while True:
            self._changed.clear()
            self._fill()
            b = self.policy.take_batch()
            if b is not None:
                return b
            self._fill()  # forming the batch may have dropped finished groups (dynamic): start their replacements
            if not self._running:
                raise ArborlError(f"consumption policy {self.policy.name} waits for a batch but no group is in "
                                  f"flight: {self.policy.stats()}")
            await self._changed.wait()

    # -- weights ----------------------------------------------------------------------------------
    async def publish(self) -> float:
        """Send the trainer's weights to every engine as version + 1; returns seconds."""
        assert self.trainer is not None
        t0 = time.perf_counter()
        state = await asyncio.to_thread(self._policy_state)
        if self.mtp is not None:
            state = {**state, **self.mtp.state()}
        self.version += 1
        self.published_bytes = sum(v.nbytes for v in state.values())
        failpoint("publish")
        await self.engines.update_weights(state, self.version)
        return time.perf_counter() - t0

    def _policy_state(self) -> dict[str, torch.Tensor]:
        """What the engines load as the next version: under LoRA with ``train.lora_sync=adapters`` and engines
        that serve adapters, the adapters alone once this trainer's base is there (its base with them the first
        time: a new trainer -- after a full fine-tuning warm start, on resume -- brings a new base); else
        the whole policy, adapters merged in."""
        if self.cfg.train.lora_sync != "adapters" or not self.engines.serves_adapters:
            return self.trainer.engine_state()
        state = self.trainer.adapter_state()
        if state is None:  # no LoRA, or an adapted module the engines cannot serve as an adapter (Conv1D)
            return self.trainer.engine_state()
        if self._base_of is not self.trainer:
            state = {**self.trainer.base_state(), **state}
            self._base_of = self.trainer
        return state

    def _record_trainer_logprobs(self, step: int, samples: list[Sample], episodes: list[Episode]) -> None:
        """The trainer's per-token log-probs of the step's calls into the data pool, keyed by call and
        step (1-based, as in metrics.jsonl): the trajectory browser's rollout/trainer mismatch. A trainer
        without them (train.parallel's ranks) records none."""
        per_sample = self.trainer.step_logprobs
        if per_sample:
            self.datapool.record_trainer_logprobs(
                step + 1, call_token_values(samples, episodes, {i: lp.tolist() for i, lp in per_sample.items()}))

    # -- one step ---------------------------------------------------------------------------------
    async def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        assert self.trainer is not None, "a controller without a trainer only evaluates"
        self._step = step
        t0 = time.perf_counter()
        dispatcher = self.engines.dispatcher
        if dispatcher is not None and self.timeline is not None:  # one span per piece (engine, chunk)
            dispatcher.record(self.timeline, t0=self.t0, step=step)
        batch = await self._next_batch()
        rollout_s = time.perf_counter() - t0
        self.cancel(batch.cancel, "policy")
        discarded = [e for gid in batch.dropped for e in self._finished.pop(gid, ())]  # generated, not trained
        self._resolved(list(batch.dropped), "dropped", "policy")
        groups = {gid: self._finished.pop(gid) for gid in batch.items}
        episodes = [e for eps in groups.values() for e in eps]
        built, stats = build_samples(episodes, cfg.train.advantage)
        samples, masked = built, 0
        if cfg.scheduling.stale_token_mask is not None:
            out = [mask_stale(x, self.version, cfg.scheduling.stale_token_mask) for x in built]
            samples, masked = [x for x, _ in out], sum(n for _, n in out)
        gap = max((self.version - v for v in (e.min_version() for e in episodes) if v is not None), default=0)
        train_metrics: dict[str, float] = {}
        publish_s, self.published_bytes = 0.0, 0
        released = 0
        if samples:
            # no episode in flight (sync consumption): the engines' prefix caches (cleared by the publish anyway) and
            # spare KV rows make way for training; an episode between two turns would want its cached history
            released = await self.engines.release_memory() if not self._running else 0
            failpoint("train")
            train_metrics = await asyncio.to_thread(self.trainer.train_step, samples)
            for gid in groups:
                self._open.pop(gid, None)
            await asyncio.to_thread(self.datapool.record_trainings, step + 1, self.attempt,
                                    [(e.episode_id, gid) for gid, eps in groups.items() for e in eps])
            await asyncio.to_thread(self._record_trainer_logprobs, step, built, episodes)
            if self.mtp is not None:
                train_metrics.update(await asyncio.to_thread(self.mtp.train_step, samples))
            publish_s = await self.publish()
            self.cancel(self.policy.on_version(self.version), "policy")
        else:
            self.policy.on_batch_skipped()
            for gid in groups:  # nothing to learn from them (no sample): resolved all the same
                self._open.pop(gid, None)
            self.datapool.set_group_state(list(groups), "dropped", "no samples")
        if self.timeline is not None:
            if dispatcher is None:
                for gid, eps in groups.items():
                    for e in eps:
                        self.timeline.add_calls(e.calls, group_id=gid, step=step, t0=self.t0)
            self.timeline.mark(time.time() - self.t0, "publish", step=step)
            await asyncio.to_thread(write_step_timeline, self.timeline, cfg.run_dir, step,
                                    f"{cfg.name} step {step + 1} ({self.policy.name})")
        if step + 1 >= cfg.rollout.steps:
            await self.close()
        step_s = time.perf_counter() - t0
        # every token this step's rollout produced, the dropped groups' too (dynamic sampling's all-equal groups,
        # an over-sampled step's surplus); sync-like policies: per second of the rollout; async: generation
        # overlaps training, so per second of the step
        gen_tokens = sum(len(c.completion_token_ids) for e in episodes + discarded for c in e.calls)
        gen_s = step_s if self.policy.overlaps_training else rollout_s
        n = max(1, len(episodes))
        st = self.policy.stats()
        return {
            "step": step + 1,
            "reward": sum(e.reward or 0.0 for e in episodes) / n,
            "success": sum(e.reward_components.get("outcome", 0.0) >= 1.0 for e in episodes) / n,
            "tool_use": tool_use(episodes),
            "episodes": stats.episodes,
            "unusable_episodes": stats.unusable,
            "zero_variance_groups": stats.zero_variance_groups,
            "samples": stats.samples,
            "generated_tokens": gen_tokens,
            "calls": sum(len(e.calls) for e in episodes),
            "drift_calls": sum(call_drifted(c) for e in episodes for c in e.calls),
            "rollout_s": rollout_s,
            "rollout_tokens_per_s": gen_tokens / gen_s if gen_s else 0.0,
            "train_s": train_metrics.get("train/step_s", 0.0),
            "publish_s": publish_s,
            "publish_mb": self.published_bytes / 1e6,
            "step_s": step_s,
            "memory/engine_released_gb": released / 1e9,
            # the job process's peak resident memory so far (Linux reports ru_maxrss in KiB); sandboxes and
            # worker processes are not in it
            "memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "policy_version": self.version,
            "sched/max_version_gap": gap,
            "sched/dropped_groups": st["dropped"],
            "sched/cancelled_groups": st["cancelled"],
            "sched/in_flight_groups": len(self._running),
            "sched/masked_tokens": masked,
            **{f"sched/{k}": st[k] for k in ("all_equal_groups", "overdrawn_groups", "skipped_tasks", "short_batches")
               if k in st},
            **({"sched/curriculum_stage": float(self.curriculum.stage(step)),
                "sched/curriculum_skipped": float(self.curriculum.skipped)} if self.curriculum is not None else {}),
            "rollout/infra_failures": self.infra_failures,
            **({f"rollout/{k}": v for k, v in self.workers.stats().items()} if self.workers else {}),
            **{f"dispatch/{k}": v for k, v in self.engines.dispatch_stats().items()},
            **{f"spec/{k}": v for k, v in self.engines.spec_stats().items()},
            **{k: v for k, v in train_metrics.items() if k != "train/step"},
        }

    # -- evaluation -------------------------------------------------------------------------------
    async def evaluate(self, n: int, split: str = "eval") -> dict[str, float]:
        """Held-out success: one episode per task of ``split`` (eval; a suite may offer more held-out
        splits, e.g. code_repair's eval_perturbed) at ``eval_temperature``."""
        if n <= 0:
            return {}
        tasks = self.suite.tasks(split, n, seed=0)
        t0 = time.perf_counter()
        episodes = await self.run_groups(tasks, 1, temperature=self.cfg.rollout.eval_temperature,
                                         tag=f"{split}-v{self.version}")
        if not self._running:  # the held-out episodes' cached KV serves no training rollout: it goes before them
            await self.engines.release_memory()
        return {
            "eval_success": sum(e.reward_components.get("outcome", 0.0) >= 1.0 for e in episodes) / len(episodes),
            "eval_reward": sum(e.reward or 0.0 for e in episodes) / len(episodes),
            "eval_tool_use": tool_use(episodes),
            "eval_s": time.perf_counter() - t0,
        }


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def tool_use(episodes: list[Episode]) -> float:
    """Fraction of episodes in which the agent ran at least one tool (a recorded ``kind=tool`` interaction)."""
    if not episodes:
        return 0.0
    return sum(any(i.get("kind") == "tool" for i in e.interactions) for e in episodes) / len(episodes)


def make_judge(cfg: JudgeConfig, gateway: Gateway) -> Judge | None:
    """The judge rollout.judge configures (None when off): the served policy, or another endpoint."""
    if cfg.mode == "off":
        return None
    if cfg.base_url is None:
        return Judge(GatewayJudgeClient(gateway), max_tokens=cfg.max_tokens)
    client = OpenAIJudgeClient(cfg.base_url, cfg.model or gateway.model_name, os.environ.get(cfg.api_key_env, "none"))
    return Judge(client, max_tokens=cfg.max_tokens)


def draw_tasks(suite: TaskSuite, seed: int, batch_tasks: int, draw: int) -> list[Task]:
    """Draw ``draw`` of the task stream: the tasks a synchronous step ``draw`` trains on."""
    return suite.tasks("train", batch_tasks, seed=derive_seed(seed, "tasks", draw) % 2**31)


def write_step_timeline(timeline: Timeline, run_dir: str | Path, step: int, title: str) -> None:
    """The step's Gantt PNG, and its spans appended to spans.jsonl, under <run_dir>/timeline/."""
    d = Path(run_dir) / "timeline"
    d.mkdir(parents=True, exist_ok=True)
    timeline.gantt(d / f"step{step + 1:04d}.png", title=title, step=step)
    timeline.write_jsonl(d / "spans.jsonl", step=step, append=True)
