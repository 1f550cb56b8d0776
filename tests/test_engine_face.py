"""One engine face: every engine kind shows the same protocol, consumers never import a concrete engine,
and the stop rules every engine applies are one function."""

from __future__ import annotations


import pytest

from arborl.cluster.pd import PDEngine, _Prefiller
from arborl.cluster.remote import ActorEngine
from arborl.config import EngineConfig
from arborl.engine import AsyncEngine, LLMEngine
from arborl.engine.backends.remote import ServerEngine
from arborl.engine.face import EngineFace, EngineLimits, RequestFace, StopRules
from arborl.models import tiny_llama
from arborl.types import FinishReason, GenerateRequest, InvalidRequestError, SamplingParams
from helpers.imports import concrete_uses

CONCRETE = {"AsyncEngine", "LLMEngine", "ServerEngine", "ServedEngine", "VLLMEngine", "SGLangEngine", "ActorEngine",
            "PDEngine"}
CONSUMERS = ["engine/pool.py", "engine/dispatcher.py", "engine/affinity.py", "cluster/pd.py", "gateway", "scheduling",
             "run/controller.py"]


def _members(proto: type) -> set[str]:
    names: set[str] = set()
    for p in proto.__mro__:
        if p in (object,) or not getattr(p, "_is_protocol", False):
            continue
        names |= {n for n in vars(p) if not n.startswith("_")} | set(getattr(p, "__annotations__", {}))
    return names


class _Server(ServerEngine):
    """The smallest server-backed engine: only the face is looked at, nothing is served."""

    kind = "shape"

    @property
    def url(self) -> str:
        return "http://127.0.0.1:9"

    def stream_segment(self, client, seg):  # pragma: no cover - never called
        raise NotImplementedError

    async def load_weights(self, client, prepared, version):  # pragma: no cover - never called
        raise NotImplementedError


def _engines() -> dict[str, object]:
    cfg = EngineConfig(max_seq_len=64, max_batch_size=4)
    built = AsyncEngine(LLMEngine(tiny_llama(layers=1, hidden=32, vocab=64, heads=2, kv_heads=1), cfg, eos_token_ids=[63]))
    decode = AsyncEngine(LLMEngine(tiny_llama(layers=1, hidden=32, vocab=64, heads=2, kv_heads=1),
                                   cfg.model_copy(update={"engine_id": "d"}), eos_token_ids=[63]))
    info = {"engine_id": "a-0", "pid": 1, "version": 0, "incarnation": "x", "vocab_size": 64, "eos_token_ids": [63],
            "config": cfg.model_dump(mode="json"), "spec_stats": {"drafted": 1.0}}
    return {
        "builtin": built,
        "server": _Server(cfg, eos_token_ids=[63], vocab_size=64, tokenizer=None, version=0, logprobs_kind="raw"),
        "actor": ActorEngine(None, info, None, max_restarts=0, rejoin_timeout_s=1.0),
        "pd": PDEngine(_Prefiller(built), decode),
    }


@pytest.fixture(scope="module")
def engines():
    engs = _engines()
    yield engs
    for name in ("builtin", "pd"):
        engs[name].shutdown()


@pytest.mark.parametrize("kind", ["builtin", "server", "actor", "pd"])
def test_every_engine_kind_shows_the_whole_face(engines, kind):
    eng = engines[kind]
    missing = sorted(n for n in _members(EngineFace) if not hasattr(eng, n))
    assert not missing, f"{type(eng).__name__} lacks {missing}"
    assert isinstance(eng, EngineFace) and isinstance(eng, RequestFace)
    lim = eng.limits
    assert isinstance(lim, EngineLimits) and lim.max_seq_len == 64 and lim.max_batch_size == 4
    assert lim.vocab_size == 64 and lim.eos_token_ids == frozenset({63})
    assert isinstance(eng.spec_stats(), dict)
    with pytest.raises(InvalidRequestError, match="outside"):
        lim.check(GenerateRequest([64]), can_decode=False)


def test_actor_engine_reports_the_spec_counters_it_was_given(engines):
    assert engines["actor"].spec_stats() == {"drafted": 1.0}


def test_no_engine_consumer_imports_a_concrete_engine_class():
    bad = concrete_uses(CONSUMERS, CONCRETE)
    assert not bad, bad


def _req(params: SamplingParams, prompt=(1, 2, 3), continued: int = 0) -> GenerateRequest:
    return GenerateRequest(list(prompt), params, continued=continued)


def test_stop_rules_are_the_ones_every_engine_applies():
    letters = StopRules(frozenset({9}), max_seq_len=8, decode=lambda ids: "".join(chr(97 + i) for i in ids))
    p = SamplingParams(max_tokens=4)
    assert letters.reason(_req(p), [9], 9) == FinishReason.STOP  # EOS
    assert letters.reason(_req(SamplingParams(max_tokens=4, ignore_eos=True)), [9], 9) is None
    assert letters.reason(_req(SamplingParams(max_tokens=4, stop_token_ids=[5])), [5], 5) == FinishReason.STOP
    assert letters.reason(_req(p), [4, 4, 4, 4], 4) == FinishReason.LENGTH  # max_tokens
    assert letters.reason(_req(SamplingParams(max_tokens=40)), [4, 4, 4, 4, 4], 4) == FinishReason.LENGTH  # 3 + 5 = 8
    # a stop string spanning a continuation's earlier piece (the prompt's last `continued` tokens) stops it ...
    s = SamplingParams(max_tokens=40, stop=["cd"])
    assert letters.reason(_req(s, prompt=(0, 2), continued=1), [3], 3) == FinishReason.STOP
    # ... but one made of the original prompt's tokens does not
    assert letters.reason(_req(s, prompt=(2, 3), continued=0), [4], 4) is None
    assert letters.stop_token_ids(SamplingParams(stop_token_ids=[5, 9])) == [9, 5]
    assert letters.stop_token_ids(SamplingParams(ignore_eos=True, stop_token_ids=[5])) == [5]
    with pytest.raises(ValueError, match="tokenizer"):
        StopRules(frozenset(), 8).reason(_req(s), [3], 3)
