"""Weights out of the shards: the layer-by-layer stream and the whole gather on rank 0 give the same
tensors, and an engine loaded from either (through the weight publisher) gives the same logits."""

from __future__ import annotations

import torch

from arborl.cluster.weights import SafetensorsSync, WeightPublisher, load_payload
from arborl.config import EngineConfig, TrainConfig
from arborl.engine import LLMEngine
from arborl.train.parallel import full_params
from arborl.train.ranks import RankGroup
from arborl.types import GenerateRequest, SamplingParams
from helpers.parallel import VOCAB, alive, make_samples, tiny


def _logprobs(state: dict[str, torch.Tensor] | None, publisher: WeightPublisher, version: int) -> list[float]:
    engine = LLMEngine(tiny(seed=9), EngineConfig(max_seq_len=128), eos_token_ids=[VOCAB - 1])
    if state is not None:
        engine.update_weights(load_payload(publisher.payload(state, version)), version)
    req = GenerateRequest([5, 17, 33, 9, 60, 2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    res = engine.generate([req])[0]
    assert res.versions == [version] * 8
    return res.logprobs


def test_streamed_sync_gives_the_engine_the_gathered_weights(tmp_path):
    cfg = TrainConfig(lr=1e-2, packing="tree", parallel={"ranks": 2, "strategy": "fsdp2"})
    with RankGroup(tiny(), cfg) as group:
        pids = group.pids
        group.train_step(make_samples(2, groups=4))
        chunks: list[dict[str, torch.Tensor]] = []
        peak = group.stream_state(chunks.append)
        gathered = group.gather_state()
        trained = group.run(full_params)[0]
        assert group.cfg.parallel.weight_sync == "stream" and group.engine_state().keys() == gathered.keys()
    streamed = {k: v for c in chunks for k, v in c.items()}
    assert streamed.keys() == gathered.keys()
    for k in gathered:
        assert torch.equal(streamed[k], gathered[k]) and torch.equal(gathered[k], trained[k]), k
    total = sum(t.numel() * t.element_size() for t in gathered.values())
    assert len(chunks) == 2 + 3 and peak < 0.5 * total  # 2 layers + embeddings, norm, head: one at a time

    publisher = WeightPublisher(SafetensorsSync(tmp_path))
    via_stream = _logprobs(streamed, publisher, 1)
    via_gather = _logprobs(gathered, publisher, 2)
    assert via_stream == via_gather
    assert via_stream != _logprobs(None, publisher, 0)  # the engine did change policy
    publisher.close()
    assert not alive(pids)
