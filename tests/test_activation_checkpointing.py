"""train.activation_checkpointing: each decoder layer keeps only its input for the backward and runs
again there; the gradients are exactly those without it, and the saved activations shrink.
train.release_heap_per_layer: the C heap is trimmed after each layer's forward and backward,
with the same values and gradients."""

from __future__ import annotations

import pytest
import torch
from test_trainer import make_samples, model, params_of

from arborl.config import TrainConfig
from arborl.models import forward
from arborl.models import tiny_llama
from arborl.train.packing import pack, packed_logprobs
from arborl.train.trainer import Trainer

VOCAB = 128


def _grads(m, batch, backend: str, checkpoint: bool, trim_heap: bool = False):
    m.zero_grad(set_to_none=True)
    logps, ents = packed_logprobs(m, batch, with_entropy=True, attention=backend, checkpoint=checkpoint,
                                  trim_heap=trim_heap)
    loss = sum((lp * (i + 1)).sum() - 0.01 * e.sum() for i, (lp, e) in enumerate(zip(logps, ents)))
    loss.backward()
    return [lp.detach() for lp in logps], [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("mode", ["flat", "tree"])
@pytest.mark.parametrize("backend", ["blocks", "dense"])
def test_checkpointed_gradients_equal_the_plain_ones_exactly(mode, backend):
    m = tiny_llama(layers=3, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=4)
    batch = pack([s.token_ids for s in make_samples(5)], mode=mode)
    lp0, g0 = _grads(m, batch, backend, checkpoint=False)
    lp1, g1 = _grads(m, batch, backend, checkpoint=True)
    assert all(torch.equal(a, b) for a, b in zip(lp0, lp1))
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))  # bitwise: the same ops on the same inputs
    assert any(float(g.abs().max()) > 0 for g in g0)


@pytest.fixture
def layer_runs(monkeypatch) -> list[int]:
    """Every decoder-layer run of the shared forward, as its layer's index."""
    runs: list[int] = []
    real = forward.decoder_layer

    def counted(layer, *args, **kw):
        runs.append(layer.self_attn.layer_idx)
        return real(layer, *args, **kw)

    monkeypatch.setattr(forward, "decoder_layer", counted)
    return runs


def _saved_bytes(m, batch, checkpoint: bool) -> int:
    """Bytes of the (non-parameter) tensors autograd saved for the backward during the forward."""
    params = {p.data_ptr() for p in m.parameters()}
    saved = 0

    def pack_hook(t):
        nonlocal saved
        if t.data_ptr() not in params:
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logps = packed_logprobs(m, batch, checkpoint=checkpoint)
    sum(lp.sum() for lp in logps).backward()
    return saved


def test_checkpointing_recomputes_each_layer_in_the_backward_instead_of_saving_it(layer_runs):
    m = tiny_llama(layers=4, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=4)
    batch = pack([s.token_ids for s in make_samples(6, groups=3, size=4)], mode="tree")
    plain = _saved_bytes(m, batch, checkpoint=False)
    assert layer_runs == [0, 1, 2, 3]
    layer_runs.clear()
    ckpt = _saved_bytes(m, batch, checkpoint=True)
    assert layer_runs == [0, 1, 2, 3, 3, 2, 1, 0]  # each layer runs again in the backward, last first
    # outside the layers (embedding, final norm, LM head, log-softmax) both save the same; inside,
    # checkpointing keeps a layer's input where the plain forward keeps a dozen tensors per layer
    assert ckpt < plain / 2, (ckpt, plain)


def test_the_knob_trains_the_same_step_with_recomputation(layer_runs):
    samples = make_samples(2)
    ref, m = model(), model()
    # memory_limit_gb=0: without the memory check's one probe forward (train/memory.py), only the step's runs
    a = Trainer(ref, TrainConfig(lr=1e-2, memory_limit_gb=0)).train_step(samples)
    assert layer_runs == [0, 1]
    layer_runs.clear()
    b = Trainer(m, TrainConfig(lr=1e-2, activation_checkpointing=True, memory_limit_gb=0)).train_step(samples)
    assert layer_runs == [0, 1, 1, 0]  # one micro-batch: its forward and the backward's recomputation
    assert torch.equal(params_of(m), params_of(ref)) and a["train/grad_norm"] == b["train/grad_norm"]
    assert not torch.equal(params_of(m), params_of(model()))  # it trained


def test_the_layers_knob_checkpoints_the_first_n_layers_only(layer_runs):
    m = tiny_llama(layers=4, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=4)
    batch = pack([s.token_ids for s in make_samples(6, groups=3, size=4)], mode="tree")
    lp_all, g_all = _grads(m, batch, "blocks", checkpoint=True)
    layer_runs.clear()
    lp_two, g_two = _grads(m, batch, "blocks", checkpoint=2)
    assert layer_runs == [0, 1, 2, 3, 1, 0]  # only the first two run again in the backward
    assert all(torch.equal(a, b) for a, b in zip(lp_all, lp_two))
    assert all(torch.equal(a, b) for a, b in zip(g_all, g_two))
    saved = {n: _saved_bytes(m, batch, checkpoint=n) for n in (False, 2, True)}
    assert saved[True] < saved[2] < saved[False]  # half the layers: between none and all
    layer_runs.clear()
    samples = make_samples(2)
    for n, runs in ((None, [0, 1, 1, 0]), (1, [0, 1, 0]), (0, [0, 1])):
        Trainer(model(), TrainConfig(lr=1e-2, activation_checkpointing=True, activation_checkpointing_layers=n,
                                     memory_limit_gb=0)).train_step(samples)
        assert layer_runs == runs, n
        layer_runs.clear()
    Trainer(model(), TrainConfig(lr=1e-2, activation_checkpointing_layers=1, memory_limit_gb=0)).train_step(samples)
    assert layer_runs == [0, 1]  # no effect without activation_checkpointing


@pytest.fixture
def heap_trims(monkeypatch) -> list[int]:
    """Every malloc_trim the shared forward asks for."""
    calls: list[int] = []
    monkeypatch.setattr(forward, "release_free_memory", lambda: calls.append(1) or True)
    return calls


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_heap_is_trimmed_after_each_layer_pass_with_the_same_values_and_gradients(heap_trims, checkpoint):
    layers = 3
    m = tiny_llama(layers=layers, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=4)
    batch = pack([s.token_ids for s in make_samples(5)], mode="tree")
    lp0, g0 = _grads(m, batch, "blocks", checkpoint)
    assert heap_trims == []
    lp1, g1 = _grads(m, batch, "blocks", checkpoint, trim_heap=True)
    # after each layer's forward and after its backward (which follows its recompute under checkpointing:
    # torch stops a recompute early, once it has what the backward needs, so the trim comes after)
    assert len(heap_trims) == layers * 2
    assert all(torch.equal(a, b) for a, b in zip(lp0, lp1))
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_the_trainer_trims_the_heap_per_layer_on_cpu_unless_the_knob_is_off(heap_trims):
    samples = make_samples(2)
    ref, m = model(), model()
    Trainer(ref, TrainConfig(lr=1e-2, memory_limit_gb=0, activation_checkpointing=True)).train_step(samples)
    assert len(heap_trims) == 2 * 2  # two layers: forward, backward
    heap_trims.clear()
    Trainer(m, TrainConfig(lr=1e-2, memory_limit_gb=0, activation_checkpointing=True,
                           release_heap_per_layer=False)).train_step(samples)
    assert heap_trims == []
    assert torch.equal(params_of(m), params_of(ref))
