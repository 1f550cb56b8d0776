"""The mtp drafter and its online training: the loss against a float64 reference, lossless decoding
with the head (greedy, sampled log-probs, prefix cache, a weight update mid-request, abort), training
raising acceptance, the head travelling with the policy weights, save/load, the knobs, and a tiny
end-to-end run with train.mtp on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.spec_checks import assert_policy_logprobs
from helpers.tiny_run import tiny_cfg

from arborl.config import Config, EngineConfig, MTPTrainConfig, SpecConfig
from arborl.engine import LLMEngine
from arborl.engine.backends import builtin
from arborl.engine.specdec.mtp import MTPHead, head_state, load_head, save_head
from arborl.export import export_run
from arborl.run.job import train
from arborl.models import load_model, tiny_llama
from arborl.train.mtp import MTPTrainer, generated_runs, make_mtp_trainer, mtp_loss
from arborl.types import (
    ArborlError,
    FinishReason,
    GenerateRequest,
    Sample,
    SamplingParams,
)

VOCAB = 128
EOS = VOCAB - 1


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is faster


def model(seed: int = 0):
    return tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=seed)


def engine(policy, *, spec: bool = True, **kw) -> LLMEngine:
    cfg = EngineConfig(max_seq_len=256, max_batch_size=16,
                       spec=SpecConfig(enabled=spec, drafter="mtp", adaptive=False, num_tokens=3, **kw))
    return LLMEngine(policy, cfg, eos_token_ids=[EOS])


def prompts(n: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, EOS, (8,), generator=g).tolist() for _ in range(n)]


def requests(params: SamplingParams, n: int = 12) -> list[GenerateRequest]:
    return [GenerateRequest(p, params, request_id=f"r{i}") for i, p in enumerate(prompts(n))]


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def samples(results) -> list[Sample]:
    out = []
    for r in results:
        n, m = len(r.prompt_token_ids), len(r.token_ids)
        out.append(Sample("e", "g", r.prompt_token_ids + r.token_ids, [0] * n + [1] * m, [0.0] * (n + m),
                          [-1] * (n + m), [0] * (n + m), [0.0] * (n + m)))
    return out


def acceptance(eng: LLMEngine) -> float:
    """How often the first draft token was accepted."""
    per_pos = eng.stats_dict()["spec_acceptance_per_position"]
    return per_pos[0] if per_pos else 0.0


@pytest.fixture(scope="module")
def trained():
    """A head trained on the greedy rollouts of ``prompts()`` (the acceptance before and after each step)."""
    policy = model()
    rollouts = engine(policy, spec=False).generate(requests(greedy()))
    tr = MTPTrainer(policy, MTPTrainConfig(enabled=True, lr=1e-2, iters=10))
    accs, metrics = [], []
    for step in range(3):
        eng = engine(policy)
        eng.update_weights(tr.state(), version=step)
        assert [r.token_ids for r in eng.generate(requests(greedy()))] == [r.token_ids for r in rollouts]
        accs.append(acceptance(eng))
        metrics.append(tr.train_step(samples(rollouts)))
    eng = engine(policy)
    eng.update_weights(tr.state(), version=3)
    eng.generate(requests(greedy()))
    accs.append(acceptance(eng))
    return policy, tr, rollouts, accs, metrics


def test_loss_matches_a_float64_reference():
    g = torch.Generator().manual_seed(1)
    n, v = 5, 11
    pl, hl = torch.randn(n, v, generator=g) * 2, torch.randn(n, v, generator=g) * 2
    nxt = torch.randint(0, v, (n,), generator=g)
    for k in (1, 3, v):
        want = []
        for i in range(n):
            p = [math.exp(x) for x in pl[i].double().tolist()]
            top = sorted(range(v), key=lambda j: -p[j])[:k]
            z = sum(p[j] for j in top)
            lse = math.log(sum(math.exp(x) for x in hl[i].double().tolist()))
            want.append(sum(p[j] / z * (math.log(p[j] / z) - (float(hl[i, j]) - lse)) for j in top))
        got = mtp_loss(pl, hl, nxt, "topk_kl", k)
        assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    ce = [-(float(hl[i, nxt[i]]) - math.log(sum(math.exp(x) for x in hl[i].double().tolist()))) for i in range(n)]
    assert torch.allclose(mtp_loss(pl, hl, nxt, "hard_ce", 3).double(), torch.tensor(ce, dtype=torch.float64), atol=1e-5)
    assert generated_runs([0, 1, 1, 0, 0, 1, 1, 1]) == [(1, 3), (5, 8)]


def test_training_raises_acceptance_and_the_engine_drafts_what_was_trained(trained):
    _, _, _, accs, metrics = trained
    assert accs[0] < 0.1, accs  # the head as initialised from the last layer
    assert accs[-1] > 0.5 and accs[-1] > accs[1] > accs[0], accs
    losses = [m["mtp/loss"] for m in metrics]
    assert losses[2] < losses[1] < losses[0]
    # the engine's first-position acceptance is what training measured: the contexts agree
    assert abs(metrics[2]["mtp/top1_agreement"] - accs[2]) < 0.2, (metrics, accs)


def test_mtp_drafts_are_lossless(trained):
    policy, tr, _, _, _ = trained
    head = tr.state()
    # greedy (in the fixture, too): identical tokens; log-probs equal to the plain engine's
    plain = engine(policy, spec=False).generate(requests(greedy()))
    eng = engine(policy)
    eng.update_weights(head, version=0)
    spec = eng.generate(requests(greedy()))
    assert acceptance(eng) > 0.5
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    # prefix cache: the same prompts again
    again = eng.generate(requests(greedy()))
    assert eng.stats.cached_prompt_tokens > 0 and [r.token_ids for r in again] == [r.token_ids for r in plain]
    # sampled: every log-prob is the policy's (a plain forward over the stream)
    res = eng.generate([GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=i),
                                        request_id=f"s{i}") for i, p in enumerate(prompts(4))])
    assert_policy_logprobs(engine(policy, spec=False), res)
    # a weight update (policy + head) mid-request: versions switch, tokens continue as the new policy's
    new = model(seed=1)
    new_head = head_state(MTPHead(new))
    eng = engine(model())
    eng.update_weights(head, version=0)
    seq = eng.add_request(requests(greedy(), n=1)[0])
    for _ in range(4):
        eng.step()
    before = len(seq.output)
    assert before > 4  # drafts were accepted
    eng.update_weights({**new.state_dict(), **new_head}, version=1)
    assert all(torch.equal(v, eng.spec.drafter.head.state_dict()[k[4:]]) for k, v in new_head.items())
    res = eng.run_until_done()[0]
    assert res.versions == [0] * before + [1] * (32 - before)
    assert res.token_ids[:before] == plain[0].token_ids[:before]
    cont = engine(new, spec=False).generate([GenerateRequest(res.prompt_token_ids + res.token_ids[:before],
                                                             greedy(32 - before), request_id="c")])[0]
    assert res.token_ids[before:] == cont.token_ids
    # abort: a prefix of the full answer comes back
    eng = engine(policy)
    eng.update_weights(head, version=0)
    eng.add_request(requests(greedy(), n=1)[0])
    for _ in range(3):
        eng.step()
    eng.abort("r0")
    res = eng.run_until_done()[0]
    assert res.finish_reason == FinishReason.ABORT
    assert 3 < len(res.token_ids) < 32 and res.token_ids == plain[0].token_ids[: len(res.token_ids)]


def test_head_saved_and_loaded_by_mtp_path(trained, tmp_path):
    policy, tr, _, _, _ = trained
    path = tmp_path / "head.pt"
    save_head(tr.head, path)
    eng = engine(policy, mtp_path=str(path))
    assert all(torch.equal(v, eng.spec.drafter.head.state_dict()[k[4:]]) for k, v in tr.state().items())
    eng.generate(requests(greedy()))
    assert acceptance(eng) > 0.5
    with pytest.raises(ArborlError, match="mtp_path"):
        engine(policy, mtp_path=str(tmp_path / "missing.pt"))
    # a head of another shape is refused with the reason
    other = tiny_llama(layers=1, hidden=32, vocab=VOCAB, heads=4, kv_heads=2)
    with pytest.raises(ArborlError, match="do not fit"):
        engine(other).update_weights({**other.state_dict(), **tr.state()}, version=1)


def test_knobs_top_k_loss_kind_and_off(trained):
    policy, _, rollouts, _, _ = trained
    data = samples(rollouts[:4])
    out = {}
    for name, kw in (("k20", {}), ("k1", {"top_k": 1}), ("ce", {"loss": "hard_ce"})):
        tr = MTPTrainer(policy, MTPTrainConfig(enabled=True, lr=1e-2, **kw))
        first = tr.train_step(data)["mtp/loss"]
        out[name] = (first, tr.state()["mtp.eh_proj.weight"])
    # the backbone is detached: no gradient reaches the policy, which stays trainable
    assert all(p.grad is None and p.requires_grad for p in policy.parameters())
    # K = 1 is cross-entropy on the policy's argmax: greedy rollouts sample exactly that token
    assert out["k1"][0] == pytest.approx(out["ce"][0], rel=1e-5)
    assert out["k20"][0] < out["k1"][0] - 0.1  # the soft target of 20 tokens is another (lower) loss
    assert not torch.equal(out["k20"][1], out["k1"][1])
    # off (the default): no head trainer; on without the mtp drafter: refused with what to set
    cfg = Config()
    assert make_mtp_trainer(cfg, policy) is None
    cfg.train.mtp.enabled = True
    with pytest.raises(ArborlError, match="engine.spec.drafter=mtp"):
        make_mtp_trainer(cfg, policy)
    cfg.engine.spec.enabled, cfg.engine.spec.drafter = True, "mtp"
    assert isinstance(make_mtp_trainer(cfg, policy), MTPTrainer)


def test_a_run_trains_and_publishes_the_head(tmp_path):
    head = tmp_path / "head.pt"
    cfg = tiny_cfg(tmp_path, "mtp", "rollout.steps=2", "rollout.max_tokens=12", "engine.spec.enabled=true",
                   "engine.spec.drafter=mtp", "engine.spec.adaptive=false", "train.mtp.enabled=true",
                   f"train.mtp.save_path={head}")
    train(cfg)
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 2 and all(r["mtp/tokens"] > 0 and r["mtp/loss"] > 0 for r in steps)
    assert steps[-1]["spec/spec_drafts"] > 0 and head.is_file()


MTP_RUN = ("rollout.max_tokens=12", "engine.spec.enabled=true", "engine.spec.drafter=mtp", "engine.spec.adaptive=false",
           "train.mtp.enabled=true")


def _mtp_steps(cfg) -> list[dict]:
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "step"]


def test_a_resumed_run_continues_the_head_and_an_export_carries_it(tmp_path):
    """The head and its optimiser are in the checkpoint: a run resumed after step 2 trains steps 3-4
    exactly as the straight run did (the head's loss and its agreement with the policy, i.e. the
    greedy acceptance of a first draft token), where a resume without them restarts the head. The
    head is exported beside the HF files, and engines and the head trainer of a model loaded from
    the export start from it."""
    learn = (*MTP_RUN, "train.lr=1e-5", "train.mtp.lr=0.01", "train.mtp.iters=3")  # the policy holds still, the head learns
    straight = tiny_cfg(tmp_path, "straight", *learn, "rollout.steps=4")
    train(straight)
    for name in ("resumed", "restarted"):
        train(tiny_cfg(tmp_path, name, *learn, "rollout.steps=2"))
    ckpt = tmp_path / "restarted" / "checkpoint"
    assert {"mtp.safetensors", "mtp_trainer.pt"} <= {f.name for f in ckpt.iterdir()}
    for f in ("mtp.safetensors", "mtp_trainer.pt"):  # what a checkpoint without the head would be
        (ckpt / f).unlink()
    resumed = tiny_cfg(tmp_path, "resumed", *learn, "rollout.steps=4")
    restarted = tiny_cfg(tmp_path, "restarted", *learn, "rollout.steps=4")
    train(resumed, resume=True)
    train(restarted, resume=True)
    a, b, c = _mtp_steps(straight), _mtp_steps(resumed), _mtp_steps(restarted)
    for other in (b, c):  # the same rollouts (episodes may finish in another order: the mean's last bit)
        assert [r["reward"] for r in other] == pytest.approx([r["reward"] for r in a], rel=1e-12)
    for key in ("mtp/loss", "mtp/top1_agreement"):
        # step 3 holds the resumed head's weights, step 4 its optimiser's moments too (without them: 1% off)
        assert [r[key] for r in b[2:]] == pytest.approx([r[key] for r in a[2:]], rel=1e-5), key
    assert c[2]["mtp/loss"] > a[2]["mtp/loss"] * 1.05  # a new head: its loss starts over

    out = export_run(straight.run_dir, tmp_path / "export")
    assert (out / "mtp.safetensors").is_file() and not (out / "mtp_trainer.pt").exists()
    served = tiny_cfg(tmp_path, "served", *MTP_RUN, "model.source=hf", f"model.path={out}")
    loaded = load_model(served.model)
    trained = MTPHead(loaded.model)
    load_head(trained, out)
    engine_head = builtin(served, loaded).engine.spec.drafter.head  # what `arborl serve` builds
    head_trainer = make_mtp_trainer(served, loaded.model).head  # what `arborl train` starts from
    fresh = MTPHead(loaded.model)
    for head in (engine_head, head_trainer):
        assert all(torch.equal(x, y) for x, y in zip(head_state(head).values(), head_state(trained).values()))
    assert not all(torch.equal(x, y) for x, y in zip(head_state(fresh).values(), head_state(trained).values()))
