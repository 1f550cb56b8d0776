"""Every checkpoint is a complete Hugging Face directory (LoRA merged) that transformers loads to the
trainer's logits; `arborl export` writes one; model.source=hf trains, evaluates and serves it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from helpers.tiny_run import ENV, arborl_cmd, overrides, set_args, tiny_cfg
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from arborl.cli import app
from arborl.config import ModelConfig
from arborl.run.job import train
from arborl.models import load_model, tiny_llama
from arborl.models.hf_dir import save_hf_dir
from arborl.models.loading import load_tokenizer
from arborl.train.checkpoint import load_checkpoint
from arborl.train.trainer import Trainer

PROMPT = "What is 2 plus 3? Answer with one number."


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished one-step run (full fine-tuning)."""
    root = tmp_path_factory.mktemp("runs")
    cfg = tiny_cfg(root, "hf", "rollout.steps=1")
    train(cfg)
    return cfg.run_dir


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_checkpoint_loads_in_transformers_with_the_trainers_logits(tmp_path, lora):
    cfg = tiny_cfg(tmp_path, "run", "rollout.steps=1", *(["train.lora_rank=4", "train.lora_alpha=64"] if lora else []))
    train(cfg)
    ckpt = cfg.run_dir / "checkpoint"
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    ids = tokenizer(PROMPT)["input_ids"]
    assert ids == load_tokenizer(cfg.model)(PROMPT)["input_ids"] and tokenizer.chat_template
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert names == {k for k in tiny_llama(layers=1, hidden=32, vocab=len(tokenizer)).state_dict()}

    trainer = Trainer(load_model(cfg.model).model, cfg.train)  # the trainer as a resume rebuilds it
    load_checkpoint(ckpt, trainer)
    trained = _logits(trainer.model, ids)  # under LoRA: the base model plus its adapters, unmerged
    assert torch.allclose(_logits(hf, ids), trained, atol=1e-4)
    assert (trained - _logits(load_model(cfg.model).model, ids)).abs().max() > 1e-2  # the step moved the policy


def test_export_command_writes_a_directory_that_hf_source_trains_and_evaluates(run, tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "exp")])
    assert out.exit_code == 0, out.output
    exp = Path(out.stdout.strip())
    assert exp == tmp_path / "exp"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exp.iterdir()}
    assert not (exp / "trainer.pt").exists()
    again = runner.invoke(app, ["export", str(run), "--out", str(exp)])
    assert again.exit_code == 2 and "already exists" in again.output

    loaded = load_model(ModelConfig(source="hf", path=str(exp)))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    assert torch.equal(_logits(loaded.model, ids), _logits(AutoModelForCausalLM.from_pretrained(run / "checkpoint"), ids))
    assert loaded.eos_token_ids == [loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")]

    hf_args = ["--set", "model.source=hf", "--set", f"model.path={exp}"]
    ev = runner.invoke(app, ["eval", *set_args(overrides(tmp_path, "ev", "rollout.eval_tasks=4")), *hf_args])
    assert ev.exit_code == 0, ev.output
    assert json.loads(ev.stdout.strip().splitlines()[-1])["eval_reward"] >= 0.0
    more = tiny_cfg(tmp_path, "more", "rollout.steps=1", "model.source=hf", f"model.path={exp}")
    assert train(more)["steps"] == 1


def test_eval_of_a_checkpoint_uses_its_runs_config(run):
    runner = CliRunner()
    ckpt = str(run / "checkpoint")
    ok = runner.invoke(app, ["eval", "--checkpoint", ckpt, "--set", "rollout.eval_tasks=2"])  # model from the run
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout.strip().splitlines()[-1])["checkpoint"] == ckpt
    bad = runner.invoke(app, ["eval", "--checkpoint", ckpt, "--set", "model.tiny_layers=2"])
    assert bad.exit_code == 2
    assert f"cannot evaluate {ckpt} with model.tiny_layers=2: the run has model.tiny_layers=1" in bad.output


def test_export_rebuilds_a_checkpoint_of_an_older_arborl(run, tmp_path):
    old = tmp_path / "old"
    (old / "checkpoint").mkdir(parents=True)
    shutil.copy(run / "config.yaml", old / "config.yaml")
    for f in ("model.safetensors", "trainer.pt"):  # all an older checkpoint held
        shutil.copy(run / "checkpoint" / f, old / "checkpoint" / f)
    exp = CliRunner().invoke(app, ["export", str(old)])
    assert exp.exit_code == 0, exp.output
    rebuilt = AutoModelForCausalLM.from_pretrained(old / "export")
    ids = AutoTokenizer.from_pretrained(old / "export")(PROMPT)["input_ids"]
    assert torch.equal(_logits(rebuilt, ids), _logits(AutoModelForCausalLM.from_pretrained(run / "checkpoint"), ids))


def test_serve_serves_a_checkpoint(run, tmp_path):
    env = {**ENV, "ARBORL_ADMIN_KEY": "k"}
    cmd = arborl_cmd("serve", "--port", "0", "--set", "model.source=hf", "--set", f"model.path={run / 'checkpoint'}",
                     "--set", f"runs_dir={tmp_path}", "--set", "name=svc", "--set", "engine.max_seq_len=256",
                     "--set", "engine.num_threads=1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.endswith("/v1"), proc.stderr.read() if proc.poll() is not None else url
        s = httpx.post(url + "/sessions", json={"task_id": "t"}, headers={"Authorization": "Bearer k"}, timeout=30).json()
        r = httpx.post(url + "/chat/completions", headers={"Authorization": f"Bearer {s['api_key']}"}, timeout=60,
                       json={"model": "checkpoint", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopped: 1 call(s) recorded" in err


def test_loading_prints_no_progress_bar_and_a_tokenizerless_directory_loads(tmp_path, capfd):
    model = tiny_llama(layers=1, hidden=32, vocab=64)
    model.generation_config.eos_token_id = 63
    save_hf_dir(tmp_path / "m", model.state_dict(), model)
    loaded = load_model(ModelConfig(source="hf", path=str(tmp_path / "m")))
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out
    assert loaded.tokenizer is None and loaded.eos_token_ids == [63]
    assert torch.equal(_logits(loaded.model, [1, 2, 3]), _logits(model, [1, 2, 3]))
