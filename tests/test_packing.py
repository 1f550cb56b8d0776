"""Flat and prefix-tree packing (train/packing.py, train/tree_attention.py).

The contract: tree packing gives the same per-sample log-probs, entropies, loss and every
parameter gradient as flat packing, and flat packing gives the same log-probs as a plain
Hugging Face forward of each sample.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from arborl.models import tiny_llama
from arborl.train.packing import PackedBatch, pack, packed_logprobs
from arborl.train.tree_attention import block_plan, flex_works, resolve_backend, visibility_mask

VOCAB = 16
TOK = st.integers(0, 11)  # a small alphabet: random samples collide and share prefixes too


@st.composite
def sample_sets(draw, max_samples: int = 7) -> list[list[int]]:
    """Samples built like RL batches: fresh prompts, multi-turn extensions (B = A + more, loss
    tokens of A inside B's shared prefix), GRPO duplicates, prefixes, branches off a prefix."""
    samples: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_samples))):
        kind = draw(st.sampled_from(["new", "extend", "dup", "prefix", "branch"])) if samples else "new"
        if kind == "new":
            s = draw(st.lists(TOK, max_size=12))
        else:
            base = draw(st.sampled_from(samples))
            if kind == "extend":
                s = base + draw(st.lists(TOK, min_size=1, max_size=8))
            elif kind == "dup":
                s = list(base)
            elif kind == "prefix":
                s = base[: draw(st.integers(0, len(base)))]
            else:
                s = base[: draw(st.integers(0, len(base)))] + draw(st.lists(TOK, min_size=1, max_size=8))
        samples.append(s)
    return samples


_MODELS: dict[tuple, torch.nn.Module] = {}


class _Float64RMSNorm(torch.nn.Module):
    """RMSNorm in its input's dtype. Hugging Face's RMSNorm (and models/lean_backward.py, bitwise the same)
    computes in float32 even for a float64 model, so its backward rounds each gradient that passes it to
    float32: two samples' gradients summed at a shared tree node and added separately in the flat layout
    then differ at float32 precision, which cancellation can raise past a float64 tolerance (hypothesis
    found one: two identical samples, seed 303)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _exact_norms(model: torch.nn.Module) -> None:
    """Make a float64 model float64 throughout: its RMSNorms become ``_Float64RMSNorm``."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                setattr(module, child_name, _Float64RMSNorm(child))


def model_for(dtype: torch.dtype = torch.float64, tie: bool = False, arch: str = "llama") -> torch.nn.Module:
    key = (dtype, tie, arch)
    if key not in _MODELS:
        if arch == "llama":
            m = tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=1, dtype=dtype, tie_embeddings=tie)
        else:
            from transformers import Qwen2Config, Qwen2ForCausalLM

            cfg = Qwen2Config(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=tie, attn_implementation="sdpa", initializer_range=0.2,
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(2)
                m = Qwen2ForCausalLM(cfg)
            m = m.to(dtype).eval()
        if dtype == torch.float64:
            _exact_norms(m)
        _MODELS[key] = m
    return _MODELS[key]


def ppo_loss(logps, ents, samples, seed: int) -> torch.Tensor:
    """A PPO-clip loss with per-sample advantages, per-token masks (also on tokens that lie in
    prefixes shared with other samples), per-token old log-probs and an entropy bonus."""
    g = torch.Generator().manual_seed(seed)
    total = logps[0].new_zeros(())
    count = 0.0
    for lp, ent in zip(logps, ents):
        n = lp.shape[0]
        adv = float(torch.randn((), generator=g, dtype=torch.float64)) * 2
        mask = (torch.rand(n, generator=g, dtype=torch.float64) < 0.7).to(lp.dtype)
        old = lp.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64).to(lp.dtype)
        ratio = torch.exp(lp - old)
        per_tok = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) - 0.01 * ent
        total = total + (per_tok * mask).sum()
        count += float(mask.sum())
    return total / max(count, 1.0)


def loss_and_grads(model, batch: PackedBatch, samples, seed: int, **kw):
    logps, ents = packed_logprobs(model, batch, with_entropy=True, **kw)
    assert [lp.shape[0] for lp in logps] == [max(len(s) - 1, 0) for s in samples]
    loss = ppo_loss(logps, ents, samples, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else [None] * len(params)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return loss.detach(), [lp.detach() for lp in logps], grads


def assert_same(a, b, rel: float) -> None:
    (la, lpa, ga), (lb, lpb, gb) = a, b
    assert torch.allclose(la, lb, rtol=rel, atol=rel * 1e-3), (la, lb)
    for x, y in zip(lpa, lpb):
        assert torch.allclose(x, y, rtol=rel, atol=rel * 1e-2)
    # relative to each parameter's largest gradient entry, floored at 1% of the largest entry of
    # all: a gradient that is zero in exact arithmetic (a key that only its own query sees) is
    # float rounding noise of the size of the other gradients' terms, not a relative quantity.
    floor = 1e-2 * max(float(y.abs().max()) for y in gb if y.numel())
    for x, y in zip(ga, gb):
        scale = max(float(y.abs().max()) if y.numel() else 0.0, floor, 1e-12)
        assert float((x - y).abs().max()) <= rel * scale, (float((x - y).abs().max()), scale)


# --------------------------------------------------------------------------- layout (no model)


@settings(max_examples=200, deadline=None)
@given(samples=sample_sets(), budget=st.sampled_from([1, 4, 9, 16, 4096]), mode=st.sampled_from(["flat", "tree"]))
def test_layout_each_token_sees_exactly_its_ancestors(samples, budget, mode):
    b = pack(samples, mode=mode, token_budget=budget)
    assert b.mode == mode
    assert b.tokens_flat == sum(map(len, samples))
    if mode == "tree":
        distinct = {tuple(s[: i + 1]) for s in samples for i in range(len(s))}
        assert b.tokens_tree == len(distinct)
        assert b.tokens_packed >= b.tokens_tree
    else:
        assert b.tokens_packed == b.tokens_tree == b.tokens_flat
    longest = max(map(len, samples))
    assert all(n <= max(budget, longest) for n in b.row_lengths)
    mask = visibility_mask(b.vis_end)
    # every query sees exactly depth + 1 keys, all in its row and at depths 0..depth
    assert torch.equal(mask.sum(1), b.position_ids + 1)
    row_of = torch.repeat_interleave(torch.arange(b.rows), torch.tensor(b.row_lengths, dtype=torch.long))
    qs, ks = mask.nonzero(as_tuple=True)
    assert torch.equal(row_of[qs], row_of[ks])
    # each sample's tokens sit on one chain: token t at depth t, seeing tokens 0..t of the sample
    for s, pos in zip(samples, torch.split(b.token_pos, b.sample_lengths)):
        if not s:
            continue
        assert b.input_ids[pos].tolist() == s
        assert b.position_ids[pos].tolist() == list(range(len(s)))
        sub = mask[pos][:, pos]
        assert torch.equal(sub, torch.ones(len(s), len(s), dtype=torch.bool).tril())


def test_grpo_group_figures_and_split_rows():
    rng = random.Random(0)
    prompt = [rng.randrange(100) for _ in range(40)]
    group = [prompt + [100 + i] + [rng.randrange(100) for _ in range(4)] for i in range(8)]
    b = pack(group, mode="tree")
    assert (b.tokens_flat, b.tokens_tree, b.tokens_packed, b.rows) == (8 * 45, 40 + 8 * 5, 80, 1)
    small = pack(group, mode="tree", token_budget=52)  # prompt + 2 branches per row
    assert small.rows == 4 and small.tokens_packed == 4 * 40 + 8 * 5 and max(small.row_lengths) <= 52
    assert pack(group, mode="auto").mode == "tree"
    # 1 - 80/360 = 0.78 saving: auto keeps the tree up to that threshold, then goes flat
    assert pack(group, mode="auto", min_saving=0.75).mode == "tree"
    assert pack(group, mode="auto", min_saving=0.8).mode == "flat"
    distinct = [[rng.randrange(100) for _ in range(20)] for _ in range(4)]
    assert pack(distinct).mode == "flat"


def test_block_plan_skips_invisible_blocks():
    b = pack([[1] * 8 + [2] * 8, [3] * 16], mode="flat")
    plan = block_plan(b.vis_end, 4)
    seen = [(blk.k_range, None if blk.k_index is None else blk.k_index.tolist()) for blk in plan]
    # the second sample's query blocks never look at the first sample's keys
    assert all(kr is not None and kr[0] >= 16 for kr, _ in seen[4:])
    assert [kr for kr, _ in seen[:4]] == [(0, 4), (0, 8), (0, 12), (0, 16)]


def test_bad_arguments_and_degenerate_samples():
    with pytest.raises(ValueError):
        pack([[1, 2]], mode="zip")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pack([])
    with pytest.raises(ValueError):
        pack([[1, 2]], token_budget=0)
    m = model_for()
    for mode in ("flat", "tree"):
        out = packed_logprobs(m, pack([[], [3]], mode=mode))
        assert [o.shape[0] for o in out] == [0, 0]
        lps, ents = packed_logprobs(m, pack([[], [3], [3, 4]], mode=mode), with_entropy=True)
        assert [o.shape[0] for o in lps] == [0, 0, 1] and ents[2].shape == (1,)


# --------------------------------------------------------------------------- numerics


@settings(max_examples=15, deadline=None)
@given(samples=sample_sets(max_samples=4), arch=st.sampled_from(["llama", "qwen2"]), tie=st.booleans())
def test_flat_packing_matches_hf_forward(samples, arch, tie):
    model = model_for(torch.float64, tie, arch)
    b = pack(samples, mode="flat", token_budget=16)
    logps, ents = packed_logprobs(model, b, with_entropy=True)
    for s, lp, ent in zip(samples, logps, ents):
        if len(s) < 2:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([s])).logits[0, :-1].double()
        ref = logits.log_softmax(-1)
        assert torch.allclose(lp.detach(), ref[torch.arange(len(s) - 1), torch.tensor(s[1:])], rtol=1e-5, atol=1e-10)
        ref_ent = -(ref.exp() * ref).sum(-1)
        assert torch.allclose(ent.detach(), ref_ent, rtol=1e-5, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    samples=sample_sets(),
    budget=st.sampled_from([1, 6, 16, 4096]),
    block=st.sampled_from([1, 3, 8, 128]),
    backend=st.sampled_from(["blocks", "dense"]),
    seed=st.integers(0, 2**16),
)
@example(samples=[[], [0, 5, 0], [], [], [0, 5, 0], []], budget=1, block=1, backend="blocks", seed=303)  # _Float64RMSNorm
def test_tree_loss_and_every_gradient_equal_flat_float64(samples, budget, block, backend, seed):
    model = model_for(torch.float64)  # float64 throughout, norms included: equal up to float64 rounding
    flat = loss_and_grads(model, pack(samples, mode="flat"), samples, seed, attention="dense")
    tree = loss_and_grads(model, pack(samples, mode="tree", token_budget=budget), samples, seed, attention=backend, block_size=block)
    assert_same(tree, flat, 1e-9)


@settings(max_examples=12, deadline=None)
@given(samples=sample_sets(), budget=st.sampled_from([5, 4096]), arch=st.sampled_from(["llama", "qwen2"]), seed=st.integers(0, 99))
@example(samples=[[0], [0, 0, 0]], budget=5, arch="llama", seed=0)  # a gradient that is 0 up to rounding
def test_tree_loss_and_every_gradient_equal_flat_float32_tied(samples, budget, arch, seed):
    model = model_for(torch.float32, True, arch)
    flat = loss_and_grads(model, pack(samples, mode="flat", token_budget=budget), samples, seed, block_size=4)
    tree = loss_and_grads(model, pack(samples, mode="tree", token_budget=budget), samples, seed, block_size=4)
    assert_same(tree, flat, 1e-4)


def test_multiturn_and_grpo_duplicates_concrete():
    """B extends A (A's generated tokens are loss tokens inside B's prefix), C duplicates B
    (GRPO), D is a prefix of A: same loss and gradients as flat packing."""
    rng = random.Random(3)
    a = [rng.randrange(12) for _ in range(9)]
    b_ = a + [rng.randrange(12) for _ in range(7)]
    samples = [a, b_, list(b_), a[:4], [5, 5]]
    model = model_for(torch.float64)
    flat = loss_and_grads(model, pack(samples, mode="flat"), samples, 7)
    tree_batch = pack(samples, mode="tree", token_budget=10)
    assert tree_batch.rows > 1
    assert_same(loss_and_grads(model, tree_batch, samples, 7, block_size=2), flat, 1e-9)


def test_flex_block_mask_matches_on_forward():
    """flex_attention with the same mask_mod (eager, no grad: CPU flex has no backward)."""
    rng = random.Random(4)
    p = [rng.randrange(12) for _ in range(10)]
    samples = [p + [rng.randrange(12) for _ in range(5)] for _ in range(3)] + [p[:6] + [1, 2, 3]]
    model = model_for(torch.float64)
    b = pack(samples, mode="tree", token_budget=20)
    with torch.no_grad():
        ref = packed_logprobs(model, b, attention="blocks", block_size=4)
        got = packed_logprobs(model, b, attention="flex")
    for x, y in zip(got, ref):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-10)


def test_auto_backend_on_cpu_is_blocks():
    assert not flex_works("cpu")
    assert resolve_backend("auto", torch.device("cpu")) == "blocks"


def test_bench_workloads_have_the_stated_sharing():
    from arborl_bench import BENCHMARKS
    from arborl_bench.tree_packing_bench import grpo_workload

    assert BENCHMARKS["tree-packing"] == "arborl_bench.tree_packing_bench:run"
    rng = random.Random(0)
    for (p, r), shared in {(192, 18): 0.80, (512, 48): 0.80, (48, 72): 0.35, (128, 192): 0.35}.items():
        (group,) = grpo_workload(rng, 49152, 1, p, r).batches
        b = pack(group, mode="tree")
        assert abs((1 - b.tokens_tree / b.tokens_flat) - shared) < 1e-9
