"""report.loggers: metrics.jsonl, TensorBoard, W&B (offline) and MLflow (local file store) get the same
scalars, read back with each tool's own reader; the knob sends a real training run's rows to the listed
trackers; a logger of the user's own by path; a bad name stops the run before it writes anything."""

from __future__ import annotations

import glob
import json
import math
import struct

import pytest
from helpers.tiny_run import tiny_cfg

from arborl.run.job import train
from arborl.report.loggers import LoggerUnavailableError, RunLoggers, scalars


@pytest.fixture(autouse=True)
def _no_wandb_service_left():
    """W&B keeps its service process (wandb-core) for the life of the process that used it; it ends here,
    so the suite leaves no process behind (tests/conftest.py)."""
    yield
    import sys

    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()

ROWS = [
    {"kind": "eval", "step": 0, "eval_success": 0.25},
    {"kind": "step", "step": 1, "reward": 0.5, "loss/total": 1.25, "samples": 16, "note": "text", "gap": None},
    {"kind": "step", "step": 2, "reward": 0.75, "loss/total": float("nan"), "samples": 12, "flag": True},
]
WANT = {  # metric -> [(step, value)]: finite numbers only, strings / None / NaN left out
    "eval_success": [(0, 0.25)], "reward": [(1, 0.5), (2, 0.75)], "loss/total": [(1, 1.25)],
    "samples": [(1, 16.0), (2, 12.0)], "flag": [(2, 1.0)],
}


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The history records of the offline run's .wandb file (W&B's LevelDB-style log of protobuf Records:
    a 7-byte file header, 32 KiB blocks, each record chunk behind a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (f,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(f, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", {}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                for k, v in items.items():
                    if not k.startswith("_"):
                        out.setdefault(k, []).append((rec.history.step.num, pytest.approx(v)))
    return out


def mlflow_metrics(run_dir) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("arborl").experiment_id])
    hist = {k: [(m.step, pytest.approx(m.value)) for m in client.get_metric_history(run.info.run_id, k)]
            for k in run.data.metrics}
    return hist, run.data.params


def test_every_logger_records_the_same_scalars(tmp_path):
    log = RunLoggers(["jsonl", "tensorboard", "wandb", "mlflow"], tmp_path, "t", {"train": {"lr": 0.1}, "seed": 3})
    for row in ROWS:
        log.write(row)
    log.close()
    # metrics.jsonl keeps the whole rows (NaN as null), as before
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1, 2] and kept[1]["note"] == "text" and kept[2]["loss/total"] is None
    assert tensorboard_scalars(tmp_path / "tensorboard") == WANT
    assert wandb_history(tmp_path) == WANT
    hist, params = mlflow_metrics(tmp_path)
    assert hist == WANT
    assert params == {"train.lr": "0.1", "seed": "3"}


def test_scalars_are_the_finite_numbers_of_a_row():
    row = {"step": 3, "kind": "step", "a": 1, "b": math.inf, "c": "x", "d": None, "e": False}
    assert scalars(row) == {"a": 1.0, "e": 0.0}


def test_report_loggers_knob_sends_a_runs_metrics_to_tensorboard(tmp_path):
    assert tiny_cfg(tmp_path, "plain").report.loggers == ["jsonl"]  # the default: metrics.jsonl only
    plain = RunLoggers(["jsonl"], tmp_path / "plain", "plain", {})
    plain.write(ROWS[1])
    plain.close()
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["metrics.jsonl"]
    on = tiny_cfg(tmp_path, "tracked", "rollout.steps=2", "report.loggers=jsonl,tensorboard")
    train(on)
    rows = [json.loads(x) for x in (on.run_dir / "metrics.jsonl").read_text().splitlines()]
    tb = tensorboard_scalars(on.run_dir / "tensorboard")
    assert tb["reward"] == [(r["step"], pytest.approx(r["reward"])) for r in rows if r["kind"] == "step"]
    assert tb["rollout_tokens_per_s"] == [(r["step"], pytest.approx(r["rollout_tokens_per_s"])) for r in rows]


def test_a_logger_of_ones_own_by_path(tmp_path):
    mine = tmp_path / "my_logger.py"
    mine.write_text(
        "import json\n"
        "class Mine:\n"
        "    def __init__(self, run_dir, run_name, config):\n"
        "        self.f = open(run_dir / 'mine.txt', 'w')\n"
        "    def log(self, scalars, step):\n"
        "        self.f.write(json.dumps([step, scalars]) + '\\n')\n"
        "    def close(self):\n"
        "        self.f.close()\n")
    log = RunLoggers([f"{mine}:Mine"], tmp_path, "t", {})
    log.write(ROWS[1])
    log.close()
    assert json.loads((tmp_path / "mine.txt").read_text()) == [1, {"reward": 0.5, "loss/total": 1.25, "samples": 16.0}]
    assert (tmp_path / "metrics.jsonl").is_file()  # always written too


def test_unknown_logger_stops_the_run_before_it_writes(tmp_path):
    cfg = tiny_cfg(tmp_path, "bad", "rollout.steps=1", "report.loggers=jsonl,tensorbored")
    with pytest.raises(LoggerUnavailableError,
                       match="unknown logger 'tensorbored': choose one of jsonl, mlflow, tensorboard, wandb"):
        train(cfg)
    assert not cfg.run_dir.exists()
