"""SFT on chat transcripts (issue 31): rendered by the gateway's own renderer with loss on the assistant's
tokens only, trained by the policy trainer (tree packing, LoRA or full), `arborl sft` writes a run
directory whose checkpoint is a Hugging Face model directory, and fine-tuning a tiny model raises the
log-likelihood of held-out demonstrations."""

from __future__ import annotations

import json

import pytest
import torch

from arborl.config import load_config
from arborl.gateway.render import ChatRenderer, normalize_messages
from arborl.gateway.transcript import transcript_sample
from arborl.models import load_model
from arborl.run.sft import TranscriptError, read_transcripts, sft

TOOLS = [{"type": "function", "function": {"name": "echo", "description": "say a word back",
                                           "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "sugar", "ocean", "pearl", "cedar",
         "amber", "raven", "delta", "ember", "flint", "grove", "haven", "ivory", "jolly", "kiwi", "lunar", "mango"]


def transcript(word: str) -> dict:
    return {"messages": [
        {"role": "system", "content": "You repeat words with the echo tool."},
        {"role": "user", "content": f"Repeat the word {word}."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": json.dumps({"text": word})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": word},
        {"role": "assistant", "content": f"I said {word}."},
    ], "tools": TOOLS}


def _cfg(tmp_path, *extra):
    return load_config(None, [f"runs_dir={tmp_path}", "name=sft", "model.source=tiny", "model.tiny_tokenizer=smollm2",
                              "model.tiny_layers=2", "model.tiny_hidden=64", *extra])


def test_loss_is_on_the_assistant_tokens_only_and_the_layout_is_the_gateways(tmp_path):
    tok = load_model(_cfg(tmp_path).model).tokenizer
    r = ChatRenderer(tok)
    t = transcript("apple")
    s = transcript_sample(r, t["messages"], t["tools"])
    assert len(s.token_ids) == len(s.loss_mask) and s.loss_mask[0] == 0
    # the trained spans, decoded, are exactly what the assistant wrote (tool call in the gateway's format) + end of turn
    spans, cur = [], []
    for tid, m in zip(s.token_ids, s.loss_mask):
        if m:
            cur.append(tid)
        elif cur:
            spans.append(cur)
            cur = []
    spans.append(cur) if cur else None
    texts = [tok.decode(x) for x in spans]
    assert texts == ['<tool_call>{"name": "echo", "arguments": {"text": "apple"}}</tool_call><|im_end|>',
                     "I said apple.<|im_end|>"]
    # untrained: system + tools prompt, user, role headers, the tool result, the bridges
    untrained = tok.decode([tid for tid, m in zip(s.token_ids, s.loss_mask) if not m])
    assert "Repeat the word apple." in untrained and "<tools>" in untrained and "<|im_start|>tool\napple" in untrained
    assert "I said" not in untrained and "\"text\": \"apple\"" not in untrained
    # the first prompt is exactly the tokens the gateway would serve the first call with
    msgs = normalize_messages(t["messages"])
    prompt = r.encode(r.render(msgs[:2], t["tools"], add_generation_prompt=True))
    assert s.token_ids[: len(prompt)] == prompt and not any(s.loss_mask[: len(prompt)])
    assert s.loss_mask[len(prompt)] == 1
    # and the whole sample is the full rendering, cut after the last end-of-turn token
    full = r.render(msgs, t["tools"], add_generation_prompt=False)
    assert s.token_ids == r.encode(full[: full.rindex("<|im_end|>") + len("<|im_end|>")])


def test_a_transcript_without_an_assistant_turn_is_refused_with_its_row(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = _cfg(tmp_path, f"train.sft.files=[{f}]")
    with pytest.raises(TranscriptError, match=r"bad.jsonl:1: .*no assistant message"):
        sft(cfg)
    f.write_text("{not json\n")
    with pytest.raises(TranscriptError, match="bad.jsonl:1"):
        read_transcripts([f])


@pytest.mark.parametrize("lora", [0, 4])
def test_sft_raises_the_log_likelihood_of_held_out_demos(tmp_path, lora):
    f = tmp_path / "demos.jsonl"
    f.write_text("".join(json.dumps(transcript(w)) + "\n" for w in WORDS))
    cfg = _cfg(tmp_path, f"train.sft.files=[{f}]", "train.sft.epochs=3", "train.sft.batch_transcripts=4",
               "train.sft.heldout_fraction=0.25", "train.lr=3e-3", f"train.lora_rank={lora}", "train.packing=tree")
    summary = sft(cfg)
    assert summary["sft_heldout_transcripts"] == 6 and summary["sft_transcripts"] == 18
    assert summary["sft_heldout_nll_after"] < summary["sft_heldout_nll_before"] - 0.5, summary
    run = tmp_path / "sft"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if x["kind"] == "step"]
    assert len(steps) == summary["steps"] == 15 and steps[-1]["loss/total"] < steps[0]["loss/total"]
    # tree packing: the transcripts share their system + tools prefix, computed once per micro-batch
    assert all(x["train/packed_tokens"] < x["train/flat_tokens"] for x in steps)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "checkpoint")  # a Hugging Face model directory (LoRA merged)
    assert model.config.num_hidden_layers == 2
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file() and (run / "curves.png").is_file()


@pytest.mark.parametrize("full_finetune", [True, False])
def test_lora_after_a_full_warm_start_trains_every_weight_in_sft_and_only_adapters_in_rl(tmp_path, full_finetune):
    """train.sft.full_finetune with train.lora_rank: the warm start moves weights LoRA does not adapt (the
    embeddings), RL then trains adapters on top of them and leaves those weights as SFT left them; a
    resumed run rebuilds that base from checkpoint-sft. Without the knob the warm start trains adapters."""
    import safetensors.torch

    from arborl.run.job import train
    from helpers.tiny_run import tiny_cfg

    f = tmp_path / "demos.jsonl"
    f.write_text("".join(json.dumps(transcript(w)) + "\n" for w in WORDS[:8]))
    over = [f"train.sft.files=[{f}]", "train.sft.batch_transcripts=4", "train.sft.heldout_fraction=0",
            "train.sft.lr=1e-2", "train.lora_rank=4", f"train.sft.full_finetune={str(full_finetune).lower()}",
            "rollout.checkpoint_every=1"]
    cfg = tiny_cfg(tmp_path, "lora-rl", *over, "rollout.steps=1")
    start = load_model(cfg.model).model.state_dict()["model.embed_tokens.weight"]
    train(cfg)
    run = cfg.run_dir
    sft_embed = safetensors.torch.load_file(str(run / "checkpoint-sft" / "model.safetensors"))["model.embed_tokens.weight"]
    assert (run / "checkpoint" / "lora.safetensors").is_file()  # RL trained adapters
    if not full_finetune:  # LoRA in the warm start too: the embeddings never move
        assert torch.equal(sft_embed, start)
        return
    assert not torch.equal(sft_embed, start)  # the warm start trained every weight
    after = safetensors.torch.load_file(str(run / "checkpoint" / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(after, sft_embed)  # RL: adapters only, on the fine-tuned weights
    train(tiny_cfg(tmp_path, "lora-rl", *over, "rollout.steps=2"), resume=True)  # rebuilt from checkpoint-sft
    resumed = safetensors.torch.load_file(str(run / "checkpoint" / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(resumed, sft_embed)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(x).get("kind") == "step"] == [1, 2]


def test_sft_mode_leaves_no_gradients_or_optimiser_state_behind():
    """The warm start's gradients (a whole model's worth under full fine-tuning) and AdamW moments go with it:
    RL after it holds neither."""
    from arborl.config import TrainConfig
    from arborl.models import tiny_llama
    from arborl.train.sft import sft_epochs, sft_mode
    from arborl.train.trainer import Trainer
    from arborl.types import Sample

    trainer = Trainer(tiny_llama(layers=2, hidden=32, vocab=16, heads=4, kv_heads=2, seed=0), TrainConfig())
    toks = [1, 2, 3, 4, 5, 6]
    mask = [0, 0, 1, 1, 1, 1]
    sample = Sample(episode_id="e", group_id="g", token_ids=toks, loss_mask=mask, rollout_logprobs=[0.0] * 6,
                    versions=[0] * 6, chunk_ids=[0] * 6, advantages=[0.0] * 6)
    rl_optimizer = trainer.optimizer
    with sft_mode(trainer, trainer.cfg) as t:
        sft_epochs(t, [sample], epochs=1, batch=1)
        assert any(p.grad is not None for p in t.params) and t.optimizer.state
    assert all(p.grad is None for p in trainer.params)
    assert trainer.optimizer is rl_optimizer and not rl_optimizer.state
