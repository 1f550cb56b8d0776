"""The OpenAI-compatible gateway (gateway/): sessions, recording, routing, `arborl serve`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arborl.config.base import Section


class GatewayConfig(Section):
    """The OpenAI-compatible gateway: sessions, call recording, routing over engines, `arborl serve`."""

    host: str = Field("127.0.0.1", description="address `arborl serve` binds (0.0.0.0 exposes it to the network)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port of `arborl serve` (0 = any free port)")
    admin_key: str | None = Field(
        None,
        description="key that may create sessions (POST /v1/sessions); the ARBORL_ADMIN_KEY environment "
        "variable overrides it; neither set: a random key is generated and printed at start",
    )
    num_engines: int = Field(1, ge=1, description="engine replicas behind one gateway, each with its own copy of the weights")
    model_name: str | None = Field(
        None, description="model id listed by /v1/models and accepted in requests (None = the loaded model's name)"
    )
    stitching: bool = Field(
        True,
        description="default of new sessions: a chat request extending an earlier call reuses that call's exact "
        "prompt + completion token ids and renders only the new messages (sessions may switch it off)",
    )
    record_messages: bool = Field(
        True,
        description="keep each chat call's request (messages, tools) with the call in the data pool, so `arborl audit` "
        "can re-render it; costs the conversation's text per call (off: the audit counts such calls as not recorded)",
    )
    max_drift_rate: float | None = Field(
        None, ge=0, le=1,
        description="stop the run (with a checkpoint and an explanation) when more than this share of its calls so "
        "far drifted: re-rendering the conversation gave other token ids than the engine's, or the prompt did not "
        "extend the episode's earlier tokens (the step metric drift_calls; `arborl audit` shows where). None = never "
        "stop, only count",
    )
    tool_prompt: Literal["auto", "native", "prompt"] = Field(
        "auto",
        description="how `tools` reach the model: native = the chat template's own tool support; prompt = the "
        "gateway writes the tool schemas and the <tool_call>{json}</tool_call> convention into the system "
        "message; auto = native when the template reads `tools`, else prompt",
    )
    default_max_tokens: int = Field(
        1024, ge=1, description="completion tokens of a chat request that gives no max_tokens (completions: 16, as OpenAI)"
    )
    max_n: int = Field(16, ge=1, description="most choices (`n`) one request may ask for")
    affinity_max_load: int = Field(
        8,
        ge=1,
        description="requests in flight on a session's engine at or above which the session's next call moves to "
        "the least-loaded engine (session affinity keeps the prefix cache warm until then)",
    )
    unsupported_params: Literal["reject", "ignore"] = Field(
        "reject",
        description="OpenAI parameters the engine cannot honour (penalties, logit_bias, top_logprobs > 0, echo, "
        "forced tool_choice, ...): reject = 400 naming them, ignore = serve without them",
    )
