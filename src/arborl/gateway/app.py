"""The HTTP layer: FastAPI routes over ``Gateway`` (OpenAI-compatible, plus sessions).

Routes (``Authorization: Bearer <key>``):

* ``POST /v1/chat/completions``, ``POST /v1/completions`` -- session key; ``stream: true`` gives SSE.
* ``GET /v1/models``, ``GET /v1/models/{id}`` -- any valid key (admin or session).
* ``POST /v1/sessions`` -- admin key; body ``{task_id, group_id, stitching, agent_kind, metadata}``
  (all optional); returns ``session_id``, ``api_key`` (the agent's), ``harness_key``, ``base_url``.
* ``GET /v1/sessions/{id}``, ``POST /v1/sessions/{id}/finish`` (``{status?}``),
  ``GET /v1/sessions/{id}/trajectory`` -- that session's key only.
* ``POST /v1/sessions/{id}/reward`` (``{value, name?, call_id?}``) -- the session's harness key or the admin
  key (the task's scorer); its agent key only where the session trusts its agent (``rollout.trust_agent_rewards``),
  else 403.
* ``GET /health`` -- no key.
* ``GET /openapi.json`` (the OpenAPI schema, request bodies included), ``GET /docs`` (Swagger UI; it
  loads its scripts from a CDN) -- no key.

Errors are OpenAI's JSON body with a message that says what to fix. A client that disconnects
while its request runs (streaming or not) aborts the engine requests; the partial calls are
recorded with finish_reason ``abort``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from arborl.gateway.core import Gateway, RequestRun
from arborl.gateway.errors import BadRequestError, GatewayError, NotFoundError
from arborl.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FinishPost,
    InteractionPost,
    RewardPost,
    SessionCreate,
    parse,
    parse_json,
)

log = logging.getLogger(__name__)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return request.headers.get("x-api-key") or None


async def _body(request: Request) -> Any:
    return parse_json(await request.body())


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _body_doc(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` documenting a route's JSON body by its protocol model (the route parses the
    body itself, with the gateway's own error messages)."""
    schema = model.model_json_schema()
    schema = _inline_refs(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


# documents the Authorization header in the OpenAPI schema (the "Authorize" button of /docs); the
# routes check the key themselves, so a missing or wrong key keeps its OpenAI-shaped 401
_bearer = [Depends(HTTPBearer(auto_error=False, description="an admin key or a session key"))]


class _RunResponse(Response):
    """ASGI response serving a RequestRun as JSON or SSE; a client disconnect aborts the run."""

    def __init__(self, run: RequestRun) -> None:
        super().__init__(content=b"")
        self.run = run

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    self.run.abort()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            if self.run.stream:
                await self._sse(send)
            else:
                await self._json(send)
        except OSError:  # the client is gone; the run was aborted and still records
            self.run.abort()
        finally:
            watcher.cancel()

    async def _json(self, send: Any) -> None:
        try:
            body, status = await self.run.response(), 200
        except GatewayError as e:
            body, status = e.body(), e.status
        data = _dumps(body)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def _sse(self, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        chunks = self.run.chunks()
        try:
            try:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": b"data: " + _dumps(chunk) + b"\n\n", "more_body": True})
            except GatewayError as e:  # after the 200: OpenAI's in-stream error event
                await send({"type": "http.response.body", "body": b"data: " + _dumps(e.body()) + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            await chunks.aclose()


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await gateway.drain()  # record what is still in flight before the loop ends

    app = FastAPI(title="arborl gateway", description="OpenAI-compatible chat / completions and sessions that record "
                  "every call for training (docs/gateway.md)", lifespan=lifespan)
    app.state.gateway = gateway
    gw = gateway

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            err: GatewayError = NotFoundError(f"no route {request.method} {request.url.path}: see /v1/chat/completions, /v1/completions, /v1/models, /v1/sessions, or /docs")
        else:
            err = BadRequestError(f"{request.method} {request.url.path}: {e.detail}")
            err.status = e.status_code
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        err = GatewayError(f"internal error: {e!r}")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return gw.health()

    def _any_key(request: Request) -> None:
        key = _key(request)
        if not gw.sessions.is_admin(key):
            gw.sessions.by_key(key)

    @app.get("/v1/models", dependencies=_bearer)
    async def models(request: Request) -> dict:
        _any_key(request)
        return gw.models()

    @app.get("/v1/models/{model_id:path}", dependencies=_bearer)
    async def model(model_id: str, request: Request) -> dict:
        _any_key(request)
        gw.check_model(model_id)
        return gw.model_card()

    @app.post("/v1/chat/completions", dependencies=_bearer, openapi_extra=_body_doc(ChatCompletionRequest))
    async def chat(request: Request):
        session = gw.sessions.by_key(_key(request))
        return _RunResponse(gw.start_chat(session, await _body(request)))

    @app.post("/v1/completions", dependencies=_bearer, openapi_extra=_body_doc(CompletionRequest))
    async def completions(request: Request):
        session = gw.sessions.by_key(_key(request))
        return _RunResponse(gw.start_completion(session, await _body(request)))

    @app.post("/v1/sessions", dependencies=_bearer, openapi_extra=_body_doc(SessionCreate, required=False))
    async def create_session(request: Request) -> dict:
        gw.sessions.check_admin(_key(request))
        raw = await request.body()
        spec = parse(SessionCreate, parse_json(raw) if raw.strip() else {})
        info = await gw.create_session(
            task_id=spec.task_id, group_id=spec.group_id, agent_kind=spec.agent_kind,
            stitching=spec.stitching, metadata=spec.metadata,
        )
        return {
            "session_id": info.session_id,
            "episode_id": info.session_id,
            "api_key": info.api_key,
            "harness_key": info.harness_key,
            "base_url": str(request.base_url).rstrip("/") + "/v1",
            "stitching": info.session.stitching,
        }

    @app.get("/v1/sessions/{session_id}", dependencies=_bearer)
    async def session_info(session_id: str, request: Request) -> dict:
        s = gw.sessions.for_path(_key(request), session_id)
        ep = s.episode
        return {"session_id": s.session_id, "task_id": ep.task_id, "group_id": ep.group_id,
                "status": ep.status.value, "calls": s.calls, "stitching": s.stitching}

    @app.post("/v1/sessions/{session_id}/reward", dependencies=_bearer, openapi_extra=_body_doc(RewardPost))
    async def reward(session_id: str, request: Request) -> dict:
        s = gw.sessions.for_reward(_key(request), session_id)
        spec = parse(RewardPost, await _body(request))
        return await gw.add_reward(s, spec.value, name=spec.name, call_id=spec.call_id)

    @app.post("/v1/sessions/{session_id}/interaction", dependencies=_bearer,
              openapi_extra=_body_doc(InteractionPost))
    async def interaction(session_id: str, request: Request) -> dict:
        s = gw.sessions.for_path(_key(request), session_id)
        spec = parse(InteractionPost, await _body(request))
        await gw.add_interaction(s, spec.model_dump())
        return {"session_id": s.session_id, "interactions": len(s.episode.interactions)}

    @app.post("/v1/sessions/{session_id}/finish", dependencies=_bearer,
              openapi_extra=_body_doc(FinishPost, required=False))
    async def finish(session_id: str, request: Request) -> dict:
        s = gw.sessions.for_path(_key(request), session_id)
        raw = await request.body()
        spec = parse(FinishPost, parse_json(raw) if raw.strip() else {})
        return await gw.finish(s, spec.status)

    @app.get("/v1/sessions/{session_id}/trajectory", dependencies=_bearer)
    async def trajectory(session_id: str, request: Request) -> dict:
        s = gw.sessions.for_path(_key(request), session_id)
        return await gw.trajectory(s)

    return app
