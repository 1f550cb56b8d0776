"""Where each metrics row of a run goes (``report.loggers``): ``jsonl`` (metrics.jsonl, always written:
resume, the summary and the dashboard read it), ``tensorboard`` (event files in <run_dir>/tensorboard),
``wandb`` (offline: <run_dir>/wandb, upload later with ``wandb sync``) and ``mlflow`` (the local file store
<run_dir>/mlruns). Every logger gets the same scalars: the row's finite numbers, at the row's step.

A logger is made by ``factory(run_dir, run_name, config)`` and has ``log(scalars, step)`` and
``close()``; register your own in ``LOGGERS`` or name it by ``module:attr`` / ``file.py:attr``. The
trackers are optional extras, imported only when listed (``pip install 'arborl[tensorboard]'``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from arborl.registry import Registry, RegistryError
from arborl.report.metrics import MetricsLog
from arborl.types import ArborlError


class Logger(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


LoggerFactory = Callable[[Path, str, dict[str, Any]], Logger]
LOGGERS: Registry[LoggerFactory] = Registry("logger")

# the Python package each built-in tracker needs, and the extra that installs it
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class LoggerUnavailableError(ArborlError):
    """A logger in report.loggers is unknown or its package is not installed."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (bools as 0/1), without ``step``: what every logger records."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, str) or v is None:
            continue
        if isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: the run's knobs as tracker parameters."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = str(v)
    return out


def check_loggers(names: Iterable[str]) -> None:
    """LoggerUnavailableError (before a run writes anything) for an unknown name or a missing package."""
    for name in names:
        try:
            LOGGERS.get(name)
        except RegistryError as e:
            raise LoggerUnavailableError(f"report.loggers: {e}") from None
        if name in _NEEDS:
            module, extra = _NEEDS[name]
            if importlib.util.find_spec(module) is None:
                raise LoggerUnavailableError(
                    f"report.loggers lists {name!r} but the {module} package is not installed: "
                    f"pip install 'arborl[{extra}]' (or drop {name} from report.loggers)")


@LOGGERS.register("jsonl")
class JsonlLogger:
    """metrics.jsonl: one JSON object per row (the row as given, not only its scalars)."""

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        self.metrics = MetricsLog(Path(run_dir) / "metrics.jsonl")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.metrics.write({"step": step, **scalars})

    def close(self) -> None:
        pass


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
    """Event files under <run_dir>/tensorboard (``tensorboard --logdir runs``); one tag per metric."""

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()  # a running job's curves show in TensorBoard as they come

    def close(self) -> None:
        self.writer.close()


@LOGGERS.register("wandb")
class WandbLogger:
    """A Weights & Biases run in offline mode under <run_dir>/wandb (no network; ``wandb sync`` uploads it)."""

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project="arborl", name=run_name, dir=str(run_dir), mode="offline", config=config,
                              reinit="create_new", settings=wandb.Settings(silent=True, console="off"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


@LOGGERS.register("mlflow")
class MlflowLogger:
    """An MLflow run in the local file store <run_dir>/mlruns (``mlflow ui --backend-store-uri ...``),
    experiment ``arborl``, the config as parameters."""

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        # MLflow 3 refuses a new file store unless asked; a local file store needs no database or server
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=(Path(run_dir) / "mlruns").resolve().as_uri())
        exp = self.client.get_experiment_by_name("arborl")
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment("arborl")
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        params = [Param(k, v[:6000]) for k, v in flat_params(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class RunLoggers(MetricsLog):
    """metrics.jsonl (a ``MetricsLog``: written, read back, truncated on resume) and every other logger
    of ``names``: ``write(row)`` goes to all of them."""

    def __init__(self, names: Iterable[str], run_dir: str | Path, run_name: str, config: dict[str, Any]) -> None:
        run_dir = Path(run_dir)
        super().__init__(run_dir / "metrics.jsonl")
        check_loggers(names)
        self.others: list[Logger] = []
        try:
            for name in dict.fromkeys(names):
                if name != "jsonl":
                    self.others.append(LOGGERS.get(name)(run_dir, run_name, config))
        except BaseException:
            self.close()
            raise

    def write(self, record: dict[str, Any]) -> None:
        super().write(record)
        values = scalars(record)
        step = int(record.get("step", 0))
        for logger in self.others:
            logger.log(values, step)

    def close(self) -> None:
        for logger in self.others:
            logger.close()
        self.others = []
