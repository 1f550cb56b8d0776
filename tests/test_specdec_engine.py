"""Speculative decoding in the built-in engine is lossless: greedy tokens, log-probs (raw and sampling)
and sampled distributions are the policy's, with the prefix cache, weight updates, aborts, stops and
limits; the KV of rejected draft tokens is rolled back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers.spec_checks import assert_policy_logprobs

from arborl.config import EngineConfig, SpecConfig
from arborl.engine import LLMEngine
from arborl.engine.specdec import Draft
from arborl.engine.specdec.verify import sampling_logprobs
from arborl.models import tiny_llama
from arborl.types import FinishReason, GenerateRequest, SamplingParams

VOCAB = 512
EOS = VOCAB - 1


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is faster


def make_model(seed: int = 0, vocab: int = VOCAB, **kw):
    return tiny_llama(layers=2, hidden=64, vocab=vocab, heads=4, kv_heads=2, seed=seed, **kw)


def make_engine(model, *, spec: bool = True, eos: int = EOS, batch: int = 8, **spec_kw) -> LLMEngine:
    spec_kw.setdefault("adaptive", False)
    cfg = EngineConfig(max_seq_len=256, max_batch_size=batch, spec=SpecConfig(enabled=spec, **spec_kw))
    return LLMEngine(model, cfg, eos_token_ids=[eos])


def prompt(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (n,), generator=g).tolist()


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


class ReplayDrafter:
    """Proposes the next k tokens of a known reference output, with one wrong token every third
    step, so that steps accept all, some and none of a draft. ``paths`` > 1 adds wrong siblings."""

    def __init__(self, refs: dict[str, list[int]], paths: int = 1) -> None:
        self.refs, self.paths, self.calls = refs, paths, 0

    def sync(self, seq) -> None:
        pass

    def propose(self, seqs, k):
        self.calls += 1
        out = []
        for seq in seqs:
            ref = self.refs.get(seq.request_id, [])
            cont = ref[len(seq.output) : len(seq.output) + k]
            if cont and self.calls % 3 == 0:
                j = self.calls % len(cont)
                cont = cont[:j] + [(cont[j] + 1) % EOS] + cont[j + 1 :]
            paths = [cont] if cont else []
            for p in range(1, self.paths):  # decoys first, so the right path is not always the first child
                if cont:
                    paths.insert(0, [(cont[0] + 7 * p) % EOS] + cont[1:])
            out.append(Draft.from_paths(paths))
        return out

    def release(self, seq) -> None:
        pass

    def weights_updated(self) -> None:
        pass


def serve(eng: LLMEngine, reqs: list[GenerateRequest]):
    return eng.generate(reqs)


def requests(params: SamplingParams, n: int = 4, plen: int = 12) -> list[GenerateRequest]:
    return [GenerateRequest(prompt(i, plen + i), params, request_id=f"r{i}") for i in range(n)]


def assert_same(a, b, atol=1e-5):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.versions == y.versions
        assert x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= atol
        assert max(abs(p - q) for p, q in zip(x.sample_logprobs, y.sample_logprobs)) <= atol


def test_greedy_replay_drafts_accept_reject_and_match_plain_decoding():
    model = make_model()
    plain = serve(make_engine(model, spec=False), requests(greedy()))
    for paths in (1, 3):
        eng = make_engine(model, num_tokens=5, num_paths=paths)
        eng.spec.drafter = ReplayDrafter({r.request_id: r.token_ids for r in plain}, paths)
        assert_same(plain, serve(eng, requests(greedy())))
        m = eng.spec.metrics
        # every draft had a right path: full accepts, partial ones, and wrong first tokens all happened
        assert m.drafts > 0 and 0 < m.accepted_tokens < m.draft_tokens
        assert eng.stats.decode_steps < sum(len(r.token_ids) for r in plain) / 4 * 0.8  # fewer forwards
        st = eng.stats_dict()
        assert st["spec_mean_acceptance_length"] == 1 + m.accepted_tokens / m.drafts
        assert st["spec_acceptance_per_position"][0] >= st["spec_acceptance_per_position"][-1]


def test_suffix_drafter_greedy_self_group_multipath_match_plain_decoding():
    model = make_model()
    # two at a time: the later members of the group draft from the earlier ones' finished answers
    reqs = lambda: [GenerateRequest(prompt(7, 20), greedy(40, seed=i), request_id=f"g{i}", group_id="grp-a")
                    for i in range(4)]
    plain = serve(make_engine(model, spec=False, batch=2), reqs())
    accepted = {}
    for name, kw in (("self", {"group_trees": False}), ("group", {}), ("multipath", {"num_paths": 4})):
        eng = make_engine(model, num_tokens=4, batch=2, **kw)
        eng.spec.drafter.groups = type(eng.spec.drafter.groups)(8)  # a fresh group store per variant
        assert_same(plain, serve(eng, reqs()))
        accepted[name] = eng.spec.metrics.accepted_tokens
    assert accepted["group"] >= 60 and accepted["multipath"] >= 60  # members 3 and 4: ~all of 2 x 39 tokens
    assert accepted["self"] < accepted["group"] / 2


def test_prefix_cache_weight_update_and_abort_with_drafts():
    old, new = make_model(seed=0), make_model(seed=1)
    # prefix cache: a second round of the same prompts hits the cache and still matches plain decoding
    plain = serve(make_engine(old, spec=False), requests(greedy()))
    eng = make_engine(make_model(seed=0), num_tokens=4)
    eng.spec.drafter = ReplayDrafter({r.request_id: r.token_ids for r in plain})
    serve(eng, requests(greedy()))
    again = serve(eng, requests(greedy()))
    assert eng.stats.cached_prompt_tokens > 0
    assert_same(plain, again)

    # weight update mid-request: tokens before carry version 0 and the old policy's log-probs, after: 1 / new
    ref_new = serve(make_engine(new, spec=False), requests(greedy(), n=1))[0]
    eng = make_engine(make_model(seed=0), num_tokens=4)
    eng.spec.drafter = ReplayDrafter({"r0": plain[0].token_ids})
    seq = eng.add_request(requests(greedy(), n=1)[0])
    for _ in range(3):
        eng.step()
    before = len(seq.output)
    assert 3 < before < 24  # drafts were accepted before the update
    eng.update_weights(new.state_dict(), version=1)
    eng.spec.drafter.refs["r0"] = plain[0].token_ids[:before] + ref_new.token_ids  # drafts keep matching
    res = eng.run_until_done()[0]
    assert res.versions == [0] * before + [1] * (24 - before)
    assert res.token_ids[:before] == plain[0].token_ids[:before]
    cont = serve(make_engine(new, spec=False), [GenerateRequest(res.prompt_token_ids + res.token_ids[:before],
                                                                greedy(24 - before), request_id="c")])[0]
    assert res.token_ids[before:] == cont.token_ids
    assert max(abs(p - q) for p, q in zip(res.logprobs[before:], cont.logprobs)) <= 1e-5

    # abort: what was generated so far comes back, a prefix of the full answer
    eng = make_engine(make_model(seed=0), num_tokens=4)
    eng.spec.drafter = ReplayDrafter({"r0": plain[0].token_ids})
    eng.add_request(requests(greedy(), n=1)[0])
    eng.step()
    eng.step()
    eng.abort("r0")
    res = eng.run_until_done()[0]
    assert res.finish_reason == FinishReason.ABORT
    assert 2 < len(res.token_ids) < 24 and res.token_ids == plain[0].token_ids[: len(res.token_ids)]


def test_stops_and_max_tokens_inside_an_accepted_draft():
    model = make_model()
    ref = serve(make_engine(model, spec=False), requests(greedy(30), n=1))[0].token_ids
    stop_tok = ref[9]
    first = ref.index(stop_tok)
    for params, want in ((greedy(30, stop_token_ids=[stop_tok]), ref[: first + 1]), (greedy(7), ref[:7])):
        eng = make_engine(model, num_tokens=6)
        eng.spec.drafter = ReplayDrafter({"r0": ref})
        res = serve(eng, requests(params, n=1))[0]
        assert res.token_ids == want
        assert eng.spec.metrics.accepted_tokens > 0


def test_drafts_end_at_a_stop_token():
    """Nothing drafted after a stop token is verified (it could never be emitted): stop_token_ids, and
    the engine's EOS unless ignore_eos."""
    model = make_model()
    ref = serve(make_engine(model, spec=False), requests(greedy(30), n=1))[0].token_ids
    stop_tok = ref[9]
    first = ref.index(stop_tok)
    cases = ((greedy(30, stop_token_ids=[stop_tok]), EOS, True), (replace(greedy(30), ignore_eos=False), stop_tok, True),
             (greedy(30), stop_tok, False))  # ignore_eos: EOS is an ordinary token, drafts go through it
    for params, eos, cut in cases:
        eng = make_engine(model, num_tokens=6, eos=eos)
        eng.spec.drafter = ReplayDrafter({"r0": ref})
        verified: list[tuple[list[int], list[int]]] = []
        verify = eng.runner.verify

        def recording(items, verify=verify, verified=verified):
            verified.extend((toks, parents) for _, _, toks, parents in items)
            return verify(items)

        eng.runner.verify = recording
        res = serve(eng, requests(params, n=1))[0]
        assert res.token_ids == (ref[: first + 1] if cut else ref)
        under_stop = [i for toks, parents in verified for i in range(1, len(toks)) if toks[parents[i]] == stop_tok]
        assert (under_stop == []) == cut
        assert any(stop_tok in toks[1:] for toks, _ in verified)  # the stop token itself is drafted


def test_rejected_draft_kv_is_rolled_back():
    """After steps that rejected draft tokens, the slot's KV equals a fresh prefill of the tokens."""
    model = make_model()
    plain = serve(make_engine(model, spec=False), requests(greedy(30), n=2))
    eng = make_engine(model, num_tokens=5)
    eng.spec.drafter = ReplayDrafter({r.request_id: r.token_ids for r in plain})
    seqs = [eng.add_request(r) for r in requests(greedy(30), n=2)]
    for _ in range(4):
        eng.step()
    assert eng.spec.metrics.accepted_tokens < eng.spec.metrics.draft_tokens  # something was rejected
    assert all(s.slot >= 0 for s in seqs)
    fresh = make_engine(model, spec=False)
    for seq in seqs:
        n = seq.kv_len
        assert n == len(seq.tokens) - 1
        fresh.runner.prefill([(0, seq.tokens[:n], 0)])
        got = eng.runner.kv.read(seq.slot, 0, n)
        want = fresh.runner.kv.read(0, 0, n)
        assert torch.allclose(got, want, atol=1e-5)


def test_truncated_sampling_logprobs_match_plain_engine():
    model = make_model()
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=20, ignore_eos=True, seed=3)
    plain = serve(make_engine(model, spec=False), requests(params))
    eng = make_engine(model, num_tokens=4)
    eng.spec.drafter = ReplayDrafter({r.request_id: r.token_ids for r in plain})
    spec = serve(eng, requests(params))
    # the drafter proposes the plain run's tokens; whatever the stream, every token's log-probs are the policy's
    ref = make_engine(model, spec=False)
    for r in spec:
        prompt_ids = r.prompt_token_ids
        for i, tok in enumerate(r.token_ids[:8]):
            logits = ref.runner.prefill([(0, prompt_ids + r.token_ids[:i], 0)])[0].float()
            assert abs(float(torch.log_softmax(logits, -1)[tok]) - r.logprobs[i]) <= 1e-5
            # the sampling log-prob: temperature 0.7, top-k 20, top-p 0.9, renormalised
            assert abs(float(sampling_logprobs(logits[None], params)[0, tok]) - r.sample_logprobs[i]) <= 1e-5
    assert eng.spec.metrics.accepted_tokens > 0


def test_draft_model_drafter_greedy_sampled_and_weight_update():
    model = tiny_llama(layers=3, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    plain = serve(make_engine(model, spec=False), requests(greedy(30)))
    eng = make_engine(model, drafter="draft_model", draft_layers=2, num_tokens=4)
    assert_same(plain, serve(eng, requests(greedy(30))))
    m = eng.spec.metrics
    assert m.drafts > 0 and 0 < m.accepted_tokens < m.draft_tokens
    # all layers: the drafter is the policy itself, so every greedy draft is accepted
    eng = make_engine(model, drafter="draft_model", draft_layers=3, num_tokens=4)
    assert_same(plain, serve(eng, requests(greedy(30))))
    assert eng.spec.metrics.accepted_tokens == eng.spec.metrics.draft_tokens
    # sampled: same seeds, log-probs of every token are the policy's (checked against a plain forward)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1)
    res = serve(make_engine(model, drafter="draft_model", draft_layers=3, num_tokens=4), requests(params, n=2))
    assert_policy_logprobs(make_engine(model, spec=False), res)
    # a weight update mid-request: the shared layers change, the draft KV is recomputed, still exact
    new = tiny_llama(layers=3, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=1)
    eng = make_engine(tiny_llama(layers=3, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0),
                      drafter="draft_model", draft_layers=3, num_tokens=4)
    seq = eng.add_request(requests(greedy(30), n=1)[0])
    eng.step()
    eng.step()
    before = len(seq.output)
    eng.update_weights(new.state_dict(), version=1)
    res = eng.run_until_done()[0]
    assert res.token_ids[:before] == plain[0].token_ids[:before]
    cont = serve(make_engine(new, spec=False), [GenerateRequest(res.prompt_token_ids + res.token_ids[:before],
                                                                greedy(30 - before), request_id="c")])[0]
    assert res.token_ids[before:] == cont.token_ids
    assert eng.spec.metrics.accepted_tokens == eng.spec.metrics.draft_tokens  # the drafter follows the new weights


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=24, ignore_eos=True),
], ids=["t1", "truncated"])
def test_sampled_speculation_emits_the_tokens_plain_sampling_emits_with_the_same_seed(params):
    """Position-keyed draws (sampling.position_uniform): speculation changes how many forwards a text
    takes, never the text. Drafts are the plain texts with a wrong token every third step (and decoy
    siblings for multi-path), so steps accept all, part and none of a draft."""
    model = make_model()
    reqs = lambda: [GenerateRequest(prompt(i, 12 + i), replace(params, seed=50 + i), request_id=f"r{i}")
                    for i in range(4)]
    plain = serve(make_engine(model, spec=False), reqs())
    assert len({tuple(r.token_ids) for r in plain}) == 4
    for paths in (1, 3):
        eng = make_engine(model, num_tokens=5, num_paths=paths)
        eng.spec.drafter = ReplayDrafter({r.request_id: r.token_ids for r in plain}, paths)
        assert_same(plain, serve(eng, reqs()))
        m = eng.spec.metrics
        assert m.drafts > 0 and 0 < m.accepted_tokens < m.draft_tokens
    # and a draft that is never right leaves the text alone too
    eng = make_engine(model, num_tokens=3)
    eng.spec.drafter = ReplayDrafter({r.request_id: [(t + 1) % EOS for t in r.token_ids] for r in plain})
    assert_same(plain, serve(eng, reqs()))
    assert eng.spec.metrics.drafts > 0


def test_draft_model_path_drafts_from_a_separate_checkpoint(tmp_path):
    """engine.spec.draft_model_path: an HF checkpoint of the same vocabulary drafts, and the outputs
    stay the policy's (greedy tokens and log-probs identical to plain decoding); a weight update leaves
    the separate drafter's weights and draft KV as they were, still exact. The policy itself saved as
    the checkpoint has every draft accepted; another random model drafts and is mostly rejected."""
    model = tiny_llama(layers=3, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    plain = serve(make_engine(model, spec=False), requests(greedy(30)))
    model.save_pretrained(tmp_path / "same")
    tiny_llama(layers=1, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=5).save_pretrained(tmp_path / "other")
    eng = make_engine(model, drafter="draft_model", draft_model_path=str(tmp_path / "same"), num_tokens=4)
    assert_same(plain, serve(eng, requests(greedy(30))))
    m = eng.spec.metrics
    assert m.drafts > 0 and m.accepted_tokens == m.draft_tokens
    assert eng.spec.drafter.model is not model and len(eng.spec.drafter.model.model.layers) == 3
    eng = make_engine(model, drafter="draft_model", draft_model_path=str(tmp_path / "other"), num_tokens=4)
    assert_same(plain, serve(eng, requests(greedy(30))))
    m = eng.spec.metrics
    assert m.drafts > 0 and m.accepted_tokens < m.draft_tokens
    # a weight update mid-request: the policy changes, the drafter (the old policy) does not; still exact
    new = tiny_llama(layers=3, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=1)
    eng = make_engine(tiny_llama(layers=3, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0),
                      drafter="draft_model", draft_model_path=str(tmp_path / "same"), num_tokens=4)
    seq = eng.add_request(requests(greedy(30), n=1)[0])
    eng.step()
    eng.step()
    before = len(seq.output)
    eng.update_weights(new.state_dict(), version=1)
    res = eng.run_until_done()[0]
    assert res.token_ids[:before] == plain[0].token_ids[:before]
    cont = serve(make_engine(new, spec=False), [GenerateRequest(res.prompt_token_ids + res.token_ids[:before],
                                                                greedy(30 - before), request_id="c")])[0]
    assert res.token_ids[before:] == cont.token_ids
    assert eng.spec.metrics.accepted_tokens < eng.spec.metrics.draft_tokens  # the drafter kept the old weights


def test_draft_model_path_of_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from arborl.config import ModelConfig
    from arborl.engine.specdec.draft_model import DraftModelError
    from arborl.models.loading import ensure_smollm2_dir

    model = tiny_llama(layers=1, hidden=32, vocab=VOCAB, heads=4, kv_heads=2)
    tiny_llama(layers=1, hidden=32, vocab=VOCAB // 2, heads=4, kv_heads=2).save_pretrained(tmp_path / "half")
    with pytest.raises(DraftModelError, match="vocabulary of 256 tokens, the policy 512"):
        make_engine(model, drafter="draft_model", draft_model_path=str(tmp_path / "half"))
    with pytest.raises(DraftModelError, match="not a Hugging Face model directory"):
        make_engine(model, drafter="draft_model", draft_model_path=str(tmp_path / "nowhere"))
    # the same vocabulary size, another tokenizer: two tokens' ids swapped
    smol = ensure_smollm2_dir(ModelConfig().cache_dir)
    tok = AutoTokenizer.from_pretrained(str(smol))
    policy = tiny_llama(layers=1, hidden=32, vocab=len(tok), heads=4, kv_heads=2)
    for name, swap in (("same-tok", False), ("other-tok", True)):
        policy.save_pretrained(tmp_path / name)
        spec = json.loads((smol / "tokenizer.json").read_text())
        if swap:
            vocab = spec["model"]["vocab"]
            vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
        (tmp_path / name / "tokenizer.json").write_text(json.dumps(spec))
    cfg = EngineConfig(max_seq_len=64, max_batch_size=2,
                       spec=SpecConfig(enabled=True, drafter="draft_model", draft_model_path=str(tmp_path / "same-tok")))
    LLMEngine(policy, cfg, eos_token_ids=[0], tokenizer=tok)
    cfg.spec.draft_model_path = str(tmp_path / "other-tok")
    with pytest.raises(DraftModelError, match="tokenizer is not the policy's \\(2 tokens have another id"):
        LLMEngine(policy, cfg, eos_token_ids=[0], tokenizer=tok)


@pytest.mark.parametrize("params", [greedy(48), SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_prompt_lookup_drafts_are_lossless(params, monkeypatch):
    """engine.spec.prompt_lookup: the request's own most recent match adds a path to the group's drafts;
    greedy tokens, sampled tokens (position-keyed draws, same seed) and log-probs are plain decoding's."""
    import arborl.engine.specdec.suffix as suffix

    proposed = []
    real = suffix.lookup_path

    def counting(*a, **kw):
        out = real(*a, **kw)
        proposed.append(len(out))
        return out

    monkeypatch.setattr(suffix, "lookup_path", counting)
    model = make_model()
    span = prompt(3, 10)  # a "file" the prompt holds twice, as an agent's context repeats what it read
    reqs = lambda: [GenerateRequest(prompt(i, 6) + span + prompt(10 + i, 4) + span[:5], replace(params, seed=70 + i),
                                    request_id=f"p{i}", group_id="grp") for i in range(4)]
    plain = serve(make_engine(model, spec=False, batch=2), reqs())
    # 1-token matches: a tiny random model does not re-type its prompt, but its tokens recur
    eng = make_engine(model, num_tokens=4, batch=2, prompt_lookup=True, min_match=1)
    eng.spec.drafter.groups = type(eng.spec.drafter.groups)(8)
    assert_same(plain, serve(eng, reqs()))
    assert sum(1 for n in proposed if n) >= 10 and eng.spec.metrics.drafts > 0
