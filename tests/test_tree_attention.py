"""The engine's decode / verify / prefill attention kernel (engine.attention): right against a float64
reference, and batch-invariant — a token's result does not depend on the other rows, the cache's
padding, prefill chunking or whether it is decoded or verified in a draft tree — which is what makes
speculative, batched and alone decoding record bitwise equal log-probs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from arborl.config import EngineConfig
from arborl.engine import LLMEngine
from arborl.engine import tree_attention as tk
from arborl.engine.model_runner import ModelRunner
from arborl.models import tiny_llama
from arborl.types import ArborlError, GenerateRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 512
EOS = VOCAB - 1
HQ, HKV = 6, 2


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    # CI builds it (g++ and ninja are on the image): a build failure must fail here, not skip
    assert tk.available(), tk.build_error()


def _cache(slots: int = 4, cap: int = 96, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, HKV, cap, d, generator=g), torch.randn(slots, HKV, cap, d, generator=g)


def _reference(q, kc, vc, slot, keys, scale):
    """float64 attention of one row [Hq, D] over slot positions ``keys``."""
    k = kc[slot][:, keys].double().repeat_interleave(HQ // HKV, 0)  # [Hq, L, D]
    v = vc[slot][:, keys].double().repeat_interleave(HQ // HKV, 0)
    w = torch.softmax((q.double().unsqueeze(1) @ k.transpose(1, 2)) * scale, -1)  # [Hq, 1, L]
    return (w @ v).squeeze(1)


@pytest.mark.parametrize("d", [64, 16, 40])  # the AVX2 paths (64) and the generic ones
def test_kernel_matches_a_float64_reference_for_prefix_and_tree_rows(d):
    kc, vc = _cache(d=d)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, HQ, d, generator=g)
    rows = [  # (slot, prefix, extra positions)
        (0, 37, [37]),  # a decode row
        (1, 0, [0]),  # the first token of a slot
        (2, 50, [50, 52, 55]),  # a draft-tree node: the prefix, then its ancestors
        (3, 81, []),  # a prefill row: keys [0, 81)
        (2, 9, [60, 61]),
    ]
    width = max(len(e) for _, _, e in rows)
    out = tk.tree_attention(q, kc, vc, torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                            torch.tensor([e + [-1] * (width - len(e)) for _, _, e in rows]), 0.125)
    for i, (slot, prefix, extra) in enumerate(rows):
        ref = _reference(q[i], kc, vc, slot, list(range(prefix)) + extra, 0.125)
        assert torch.allclose(out[i].double(), ref, atol=2e-6), (i, (out[i].double() - ref).abs().max())


def test_a_row_is_bitwise_the_same_alone_batched_padded_and_as_a_tree_node():
    kc, vc = _cache(slots=8, cap=128)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(8, HQ, 64, generator=g)
    pos = torch.tensor([70, 33, 101, 5, 64, 90, 17, 120])
    slots = torch.arange(8)
    batched = tk.tree_attention(q, kc, vc, slots, pos, pos[:, None], 0.125)
    for i in range(8):
        alone = tk.tree_attention(q[i : i + 1], kc, vc, slots[i : i + 1], pos[i : i + 1], pos[i : i + 1, None], 0.125)
        assert torch.equal(alone, batched[i : i + 1])
    # a bigger cache (capacity 256): same values at the same positions
    big_k = torch.zeros(8, HKV, 256, 64)
    big_v = torch.zeros(8, HKV, 256, 64)
    big_k[:, :, :128], big_v[:, :, :128] = kc, vc
    assert torch.equal(tk.tree_attention(q, big_k, big_v, slots, pos, pos[:, None], 0.125), batched)
    # as a prefill row (keys [0, p]) and as a tree node at depth 3 whose ancestors hold the same keys
    assert torch.equal(tk.tree_attention(q[:1], kc, vc, slots[:1], pos[:1] + 1, torch.empty(1, 0, dtype=torch.long), 0.125),
                       batched[:1])
    node = tk.tree_attention(q[:1], kc, vc, slots[:1], torch.tensor([67]), torch.tensor([[67, 68, 69, 70]]), 0.125)
    assert torch.equal(node, batched[:1])
    # ... while SDPA's result for the same row moves with the batch (why the kernel exists)
    sdpa_mask = (torch.arange(128)[None, :] <= pos[:, None])[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=sdpa_mask, scale=0.125,
                                                            enable_gqa=True)[:, :, 0]
    assert torch.allclose(sdpa, batched, atol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 40])
def test_every_isa_path_matches_the_scalar_path_and_keeps_rows_batch_invariant(d):
    """Each path this CPU has (scalar, avx2, avx512f), forced: within 1e-6 of the scalar path (the
    weighted sum of V is bitwise the same chain; q.k sums 8 or 16 lanes first), against a float64
    reference, and a row's result alone bitwise the one it gets in a batch on that path."""
    from arborl.engine import cpu_kernels

    kc, vc = _cache(slots=6, cap=160, d=d)
    g = torch.Generator().manual_seed(d)
    q = torch.randn(6, HQ, d, generator=g)
    pos, slots = torch.tensor([70, 33, 101, 5, 150, 17]), torch.arange(6)
    with cpu_kernels.forced_isa("scalar"):
        ref = tk.tree_attention(q, kc, vc, slots, pos, pos[:, None], 0.125)
    for i in range(6):
        want = _reference(q[i], kc, vc, i, list(range(int(pos[i]) + 1)), 0.125)
        assert torch.allclose(ref[i].double(), want, atol=2e-6)
    for name in cpu_kernels.isas():
        with cpu_kernels.forced_isa(name):
            out = tk.tree_attention(q, kc, vc, slots, pos, pos[:, None], 0.125)
            assert (out - ref).abs().max() <= 1e-6, name
            for i in (0, 4):
                alone = tk.tree_attention(q[i : i + 1], kc, vc, slots[i : i + 1], pos[i : i + 1], pos[i : i + 1, None], 0.125)
                assert torch.equal(alone, out[i : i + 1]), name


@pytest.mark.parametrize("d", [64, 40])
def test_a_bf16_cache_is_the_float32_kernel_on_its_rounded_values_on_every_path(d):
    """The CPU bf16 rollout's cache: each key and value widened exactly, so on every path the result is
    bitwise the float32 kernel's over the bf16-rounded cache; a row's own K/V written rounded (nearest
    even); a bf16 k_cache with a float32 v_cache refused."""
    from arborl.engine import cpu_kernels

    kc, vc = _cache(slots=3, cap=64, d=d)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    g = torch.Generator().manual_seed(d)
    q, k_new, v_new = torch.randn(3, HQ, d, generator=g), torch.randn(3, HKV, d, generator=g), torch.randn(3, HKV, d, generator=g)
    slots, prefix, pos = torch.arange(3), torch.tensor([40, 9, 60]), torch.tensor([[40], [9], [60]])
    for name in cpu_kernels.isas():
        with cpu_kernels.forced_isa(name):
            k32, v32 = kb.float(), vb.float()
            want = tk.tree_attention(q, k32, v32, slots, prefix, pos, 0.125, (k_new.bfloat16().float(), v_new.bfloat16().float(), prefix))
            k16, v16 = kb.clone(), vb.clone()
            got = tk.tree_attention(q, k16, v16, slots, prefix, pos, 0.125, (k_new, v_new, prefix))
            assert torch.equal(got, want), name
            assert torch.equal(k16.float(), k32) and torch.equal(v16.float(), v32), name
    with pytest.raises(RuntimeError, match="v_cache has dtype"):
        tk.tree_attention(q, kb, vc, slots, prefix, pos, 0.125)


def test_bad_inputs_are_clear_errors():
    kc, vc = _cache()
    q = torch.randn(2, HQ, 64)
    ok = dict(row_slot=torch.tensor([0, 1]), prefix=torch.tensor([3, 4]), extra=torch.tensor([[3], [4]]))
    with pytest.raises(RuntimeError, match="prefix 500 > capacity"):
        tk.tree_attention(q, kc, vc, ok["row_slot"], torch.tensor([500, 4]), ok["extra"], 0.1)
    with pytest.raises(RuntimeError, match="slot 9 out of range"):
        tk.tree_attention(q, kc, vc, torch.tensor([0, 9]), ok["prefix"], ok["extra"], 0.1)
    with pytest.raises(RuntimeError, match="attends to no key"):
        tk.tree_attention(q, kc, vc, ok["row_slot"], torch.tensor([0, 4]), torch.tensor([[-1], [4]]), 0.1)
    with pytest.raises(RuntimeError, match="query heads over"):
        tk.tree_attention(torch.randn(2, 5, 64), kc, vc, ok["row_slot"], ok["prefix"], ok["extra"], 0.1)
    with pytest.raises(RuntimeError, match="dtype"):
        tk.tree_attention(q.double(), kc, vc, ok["row_slot"], ok["prefix"], ok["extra"], 0.1)


def test_new_kv_rows_are_written_before_any_row_attends():
    kc, vc = _cache(slots=2, cap=32)
    g = torch.Generator().manual_seed(7)
    q, k_new, v_new = torch.randn(2, HQ, 64, generator=g), torch.randn(2, HKV, 64, generator=g), torch.randn(2, HKV, 64, generator=g)
    # two nodes of one slot: node 2 (position 11) attends to node 1's key (position 10), written in the same call
    rows, prefix, extra = torch.tensor([0, 0]), torch.tensor([10, 10]), torch.tensor([[10, -1], [10, 11]])
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k[0, :, 10:12], ref_v[0, :, 10:12] = k_new.transpose(0, 1), v_new.transpose(0, 1)
    expected = tk.tree_attention(q, ref_k, ref_v, rows, prefix, extra, 0.125)
    got = tk.tree_attention(q, kc, vc, rows, prefix, extra, 0.125, (k_new, v_new, torch.tensor([10, 11])))
    assert torch.equal(got, expected) and torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    with pytest.raises(RuntimeError, match="outside capacity"):
        tk.tree_attention(q, kc, vc, rows, prefix, extra, 0.125, (k_new, v_new, torch.tensor([10, 32])))


def _model():
    return tiny_llama(layers=2, hidden=128, heads=2, kv_heads=1, vocab=VOCAB, seed=4)  # head_dim 64


def _engine(model, attention: str, batch: int = 8, **kw) -> LLMEngine:
    cfg = EngineConfig(max_seq_len=256, max_batch_size=batch, attention=attention, **kw)
    return LLMEngine(model, cfg, eos_token_ids=[EOS])


def _requests(n: int = 6) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, EOS, (20,), generator=g).tolist()  # a common prefix: prefix-cache hits
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    return [GenerateRequest(shared + torch.randint(0, EOS, (3 + 4 * i,), generator=g).tolist(), replace(params, seed=i))
            for i in range(n)]


def test_engine_logprobs_are_bitwise_equal_batched_and_alone_with_the_kernel_only():
    model = _model()
    batched = _engine(model, "kernel").generate(_requests())
    alone = [_engine(model, "kernel", prefix_cache=False).generate([r])[0] for r in _requests()]
    for a, b in zip(batched, alone):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # bitwise: prefix-cache hits, batch, slot moves change nothing
    sdpa = _engine(model, "sdpa").generate(_requests())
    # the knob switches the path: SDPA gives the same tokens, log-probs close but not bit-equal
    assert [r.token_ids for r in sdpa] == [r.token_ids for r in batched]
    diffs = [abs(x - y) for a, b in zip(sdpa, batched) for x, y in zip(a.logprobs, b.logprobs)]
    assert 0 < max(diffs) < 1e-4


def test_prefill_chunks_give_the_same_kv_and_logits():
    model = _model()
    runner = ModelRunner(model, slots=2, max_len=128, packed=True, attention="kernel")
    prompt = torch.randint(0, EOS, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    whole = runner.prefill([(0, prompt, 0)])
    runner.prefill([(1, prompt[:23], 0)])
    runner.prefill([(1, prompt[23:41], 23)])
    chunked = runner.prefill([(1, prompt[41:], 41)])
    assert torch.equal(whole, chunked)
    assert torch.equal(runner.kv.read(0, 0, 60), runner.kv.read(1, 0, 60))


def test_attention_knob_choices_and_errors():
    model = _model()
    assert ModelRunner(model, slots=1, max_len=32, attention="auto").tree_kernel
    assert not ModelRunner(model, slots=1, max_len=32, attention="sdpa").tree_kernel
    bf16 = tiny_llama(layers=1, hidden=64, vocab=VOCAB, dtype=torch.bfloat16)
    assert not ModelRunner(bf16, slots=1, max_len=32, attention="auto").tree_kernel  # auto falls back
    with pytest.raises(ArborlError, match="float32 on the CPU"):
        ModelRunner(bf16, slots=1, max_len=32, attention="kernel")
    with pytest.raises(ArborlError, match="auto, kernel or sdpa"):
        ModelRunner(model, slots=1, max_len=32, attention="flash")


def test_packed_verify_gives_each_tree_what_it_gets_alone_and_what_decode_gives():
    model = _model()
    runner = ModelRunner(model, slots=3, max_len=128, packed=True, attention="kernel")  # packed: row-invariant GEMMs
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, EOS, (n,), generator=g).tolist() for n in (9, 17, 12)]

    def fresh():
        runner.prefill([(s, p, 0) for s, p in enumerate(prompts)])

    trees = [(0, 9, [3, 7, 8, 9], [-1, 0, 1, 0]), (1, 17, [4], [-1]), (2, 12, [5, 6, 2], [-1, 0, 1])]
    fresh()
    together = runner.verify(trees)
    assert runner.last_hidden.shape[:2] == (3, 4)
    for i, t in enumerate(trees):
        fresh()
        alone = runner.verify([t])
        assert torch.equal(alone[0, : len(t[2])], together[i, : len(t[2])])
    # the chain 5 -> 6 -> 2 of slot 2, verified as a tree, is what decoding it token by token gives
    fresh()
    stepwise = [runner.decode([0, 0, tok], [0, 0, 12 + j])[2] for j, tok in enumerate([5, 6, 2])]
    assert all(torch.equal(together[2, j], stepwise[j]) for j in range(3))
