"""What a run directory holds, the checks before a run starts or resumes in it, and the clean-up a
resume does after a process that died (episodes it left ``running`` are marked aborted)."""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from arborl.config import DataPoolConfig
from arborl.datapool import DataPool
from arborl.report import plural
from arborl.run_config import CHANGES_FILE, CONFIG_FILE
from arborl.train.checkpoint import has_checkpoint
from arborl.types import ArborlError, EpisodeStatus

METRICS_FILE = "metrics.jsonl"
SFT_CHECKPOINT = "checkpoint-sft"  # the policy after train.sft's warm start, before RL (an HF directory)
# what a run writes; --overwrite deletes these and nothing else
OUTPUTS = (CONFIG_FILE, CHANGES_FILE, "serve.config.yaml", METRICS_FILE, "summary.json", "curves.png", "checkpoint",
           SFT_CHECKPOINT, "timeline", "eval", "tensorboard", "wandb", "mlruns")  # the last three: report.loggers


class RunExistsError(ArborlError):
    """A new run was started in a directory that already holds one."""


class NothingToResumeError(ArborlError):
    """--resume names a run without a checkpoint."""


def resume_command(run_dir: str | Path) -> str:
    return f"arborl train --resume {shlex.quote(str(run_dir))}"


class RunDir:
    def __init__(self, path: str | Path, datapool: DataPoolConfig) -> None:
        self.path = Path(path)
        self.datapool = datapool

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint"

    @property
    def sft_checkpoint(self) -> Path:
        return self.path / SFT_CHECKPOINT

    @property
    def datapool_file(self) -> Path:
        return self.path / self.datapool.filename

    def has_checkpoint(self) -> bool:
        return has_checkpoint(self.checkpoint)

    def logged_steps(self) -> int:
        f = self.path / METRICS_FILE
        if not f.is_file():
            return 0
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        return max((r.get("step", 0) for r in rows if r.get("kind") == "step"), default=0)

    def holds_run(self) -> bool:
        """A checkpoint, a logged step or a data pool (``arborl serve`` records sessions there too): what a new
        run must not mix with or delete."""
        return self.has_checkpoint() or self.logged_steps() > 0 or self.datapool_file.exists()

    def _outputs(self) -> list[Path]:
        pool = self.datapool_file
        names = [*OUTPUTS, pool.name, pool.name + "-wal", pool.name + "-shm"]
        return [self.path / n for n in names] + list(self.path.glob(".checkpoint.*"))

    @contextlib.contextmanager
    def starting(self, *, fresh: bool) -> Iterator[None]:
        """The directory, made for a start. ``fresh`` (not a resume): what an earlier run wrote there is
        deleted first (--overwrite; or check_new passed, so at most a config.yaml or evaluations without a
        data pool), and when the start fails before it has logged a step or saved a checkpoint, what it
        wrote and the directories it made are removed again, so the same command runs again as it is."""
        made = [d for d in (self.path, *self.path.parents) if not d.exists()]  # deepest first
        if fresh:
            self.clear()
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            yield
        except BaseException:
            if fresh and not self.has_checkpoint() and self.logged_steps() == 0:  # its data pool is its own
                self.clear()
                for d in made:
                    try:
                        d.rmdir()  # only when empty: a file of the user's keeps it
                    except OSError:
                        break
            raise

    def check_new(self) -> None:
        """RunExistsError when a new run would mix its outputs with an earlier one's."""
        if not self.holds_run():
            return
        logged = f"{plural(self.logged_steps(), 'step')} logged"
        if self.has_checkpoint():
            raise RunExistsError(
                f"{self.path} already holds a run ({logged}): continue it with `{resume_command(self.path)}`, "
                "start it again from scratch with --overwrite (deletes its outputs), or choose another name (--set name=...)")
        raise RunExistsError(
            f"{self.path} already holds a run without a checkpoint ({logged}): continue it with "
            f"`{resume_command(self.path)}` (from step 0, the episodes it committed kept), start it again with "
            "--overwrite (deletes its outputs), or choose another name (--set name=...)")

    def check_resumable(self) -> None:
        if not self.path.is_dir():
            raise NothingToResumeError(f"nothing to resume: {self.path} does not exist (start the run without --resume)")
        if not self.has_checkpoint() and not (self.path / CONFIG_FILE).is_file():
            raise NothingToResumeError(
                f"{self.path} has no run to resume (no checkpoint, no {CONFIG_FILE}): start it without --resume")

    def clear(self) -> None:
        """Delete the outputs of an earlier run (only the files arborl writes)."""
        for p in self._outputs():
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()

    def abort_running_episodes(self) -> tuple[int, int]:
        """Mark the episodes a dead process left in flight as aborted (they are never trained; their groups run
        them again): those still ``running``, and training-group members it finished but had not scored.
        Returns (how many, the tokens their calls had generated: decoded and discarded)."""
        if not self.datapool_file.is_file():
            return 0, 0
        with DataPool.from_config(self.path, self.datapool) as pool:
            stale = pool.episodes(status=EpisodeStatus.RUNNING, with_calls=False)
            stale += [e for e in pool.episodes(status=[EpisodeStatus.FINISHED, EpisodeStatus.FAILED, EpisodeStatus.ABORTED],
                                               with_calls=False)
                      if e.reward is None and "member" in e.meta and not e.meta.get("aborted")]
            tokens = 0
            for e in stale:  # only these episodes' calls are read: the pool may hold a whole run's
                tokens += sum(len(c.completion_token_ids) for c in pool.calls(e.episode_id))
                pool.update_episode(e.episode_id, status=EpisodeStatus.ABORTED, finished_at=time.time(),
                                    meta={**e.meta, "aborted": "in flight when the process stopped"})
        return len(stale), tokens

    def remove_stale_saves(self) -> None:
        """The temporary directory of a checkpoint save that a kill interrupted (the checkpoint before it is
        intact), and a replaced checkpoint's leftover once the new one is in place."""
        for tmp in self.path.glob(f".{self.checkpoint.name}.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        if self.checkpoint.is_dir():
            for old in self.path.glob(f".{self.checkpoint.name}.old-*"):
                shutil.rmtree(old, ignore_errors=True)
