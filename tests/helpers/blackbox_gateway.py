"""Shared test fixtures of the gateway and agent tests: a scripted policy and a live gateway.

The scripted policy is a real tiny Llama with SmolLM2's tokenizer and chat template, trained for a
second (a few dozen Adam steps on two sequences) to play one tool-use episode under greedy decoding:

    user: What is 2 plus 3?          (with the `add` tool offered)
    assistant: <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>
    tool: 5
    assistant: The answer is 5.<|im_end|>

Its training sequence is built with the gateway's own renderer and stitching rule, so a gateway
that stitches correctly reproduces the episode token for token. Nothing is mocked: the engine,
the gateway, uvicorn and the openai client are the real ones.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from array import array
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import torch

from arborl.config import EngineConfig, GatewayConfig, ModelConfig
from arborl.datapool import DataPool
from arborl.engine import AsyncEngine, LLMEngine
from arborl.gateway import Gateway
from arborl.gateway.render import ChatRenderer, normalize_messages
from arborl.gateway.server import GatewayServer
from arborl.gateway.stitching import CallRecord, Stitched, stitch_chat
from arborl.models import LoadedModel, load_model
from arborl.engine.dispatcher import Dispatcher
from arborl.engine.pool import EnginePool
from arborl.scheduling.dispatch import SeerDispatch

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = "What is 2 plus 3?"
TOOL_CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "The answer is 5."
ADMIN_KEY = "test-admin-key"


def script_messages() -> tuple[list[dict], dict, list[dict]]:
    """(first request's messages, the assistant reply the script produces, the tool message)."""
    first = [{"role": "user", "content": QUESTION}]
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
    }
    tool = {"role": "tool", "tool_call_id": "call_x", "content": "5"}
    return first, reply, tool


def scripted_sequence(tokenizer, eos: int) -> tuple[list[int], list[int]]:
    """The episode's token ids as the gateway serves it, and the loss mask (1 on the script's tokens)."""
    r = ChatRenderer(tokenizer)
    first, reply, tool = script_messages()
    msgs1 = normalize_messages(first)
    p1 = r.encode(r.render(msgs1, [ADD_TOOL], add_generation_prompt=True))
    c1 = r.encode(TOOL_CALL_TEXT) + [eos]
    msgs2 = normalize_messages(first + [reply, tool])
    rec = CallRecord("c1", array("i", p1 + c1), len(p1), True)
    st = stitch_chat(r, rec, 1, msgs2, [ADD_TOOL], r.render(msgs2, [ADD_TOOL], add_generation_prompt=True))
    assert isinstance(st, Stitched), st
    c2 = r.encode(ANSWER) + [eos]
    seq = st.prompt_ids + c2
    mask = [0] * len(p1) + [1] * len(c1) + [0] * (len(st.prompt_ids) - len(p1) - len(c1)) + [1] * len(c2)
    return seq, mask


@functools.lru_cache(maxsize=1)
def scripted_model() -> LoadedModel:
    torch.set_num_threads(1)
    loaded = load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2", seed=0))
    eos = loaded.eos_token_ids[0]
    seq, mask = scripted_sequence(loaded.tokenizer, eos)
    model = loaded.model
    ids = torch.tensor([seq])
    m = torch.tensor(mask[1:], dtype=torch.bool)
    target = ids[0, 1:][m]
    params = [p for n, p in model.named_parameters() if "embed" not in n]
    opt = torch.optim.Adam(params, lr=1e-2)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(200):
            h = model.model(ids).last_hidden_state[0, :-1][m]
            loss = torch.nn.functional.cross_entropy(model.lm_head(h), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.005:
                break
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        pred = model(ids).logits[0, :-1].argmax(-1)
    assert bool((pred[m] == target).all()), "the scripted policy did not learn its script"
    return loaded


class FaultSwitch:
    """Fault injection on the real model: while ``armed``, the embedding forward raises, so the
    engine step fails (the engine, gateway and server stay real)."""

    def __init__(self, model) -> None:
        self.armed = False
        self.fired = 0
        model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.armed:
            self.armed = False
            self.fired += 1
            raise RuntimeError("injected device fault")


@dataclass
class Harness:
    gateway: Gateway
    server: GatewayServer
    pool: DataPool
    engines: list[AsyncEngine]
    loaded: LoadedModel
    faults: FaultSwitch | None
    tmp: tempfile.TemporaryDirectory
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60))

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def model(self) -> str:
        return self.gateway.model_name

    def new_session(self, **body) -> tuple[str, str]:
        r = self.http.post(self.base_url + "/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, r.text
        return r.json()["session_id"], r.json()["api_key"]

    def new_session_keys(self, **body) -> dict:
        """``POST /v1/sessions``'s whole answer: session_id, api_key (the agent's), harness_key, ..."""
        r = self.http.post(self.base_url + "/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, r.text
        return r.json()

    def get(self, path: str, key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return self.http.get(self.base_url + path, headers=headers)

    def post(self, path: str, key: str | None, json=None, content: bytes | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if content is not None:
            headers["content-type"] = "application/json"
            return self.http.post(self.base_url + path, headers=headers, content=content)
        return self.http.post(self.base_url + path, headers=headers, json=json)

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        for e in self.engines:
            e.shutdown()
        self.pool.close()
        self.tmp.cleanup()


_model_lock = threading.Lock()


def start_harness(*, num_engines: int = 1, faults: bool = False, max_seq_len: int = 2048, seer_chunk: int | None = None,
                  **gw_cfg) -> Harness:
    """A live gateway on the scripted policy; ``seer_chunk``: requests go through a Seer dispatcher
    serving them in pieces of that many tokens."""
    with _model_lock:
        loaded = scripted_model()
    tmp = tempfile.TemporaryDirectory(prefix="arborl-gw-")
    pool = DataPool(Path(tmp.name) / "datapool.sqlite")
    engines = []
    for i in range(num_engines):
        cfg = EngineConfig(max_seq_len=max_seq_len, max_batch_size=16, num_threads=1, engine_id=f"engine-{i}")
        engines.append(AsyncEngine(LLMEngine(loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer, seed=i)))
    switch = FaultSwitch(loaded.model) if faults else None
    dispatcher = Dispatcher(engines, SeerDispatch(chunk_tokens=seer_chunk)) if seer_chunk is not None else None
    gcfg = GatewayConfig(**gw_cfg)
    gw = Gateway(EnginePool(engines, affinity_max_load=gcfg.affinity_max_load, dispatcher=dispatcher), datapool=pool,
                 tokenizer=loaded.tokenizer, model_name="scripted-tiny", config=gcfg, admin_key=ADMIN_KEY)
    server = GatewayServer(gw).start()
    return Harness(gw, server, pool, engines, loaded, switch, tmp)
