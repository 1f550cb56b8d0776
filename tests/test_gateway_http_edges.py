"""The gateway's HTTP edges on a live server (uvicorn, real engine): bodies nested too deeply get a
clear 400 on every route that reads a body (not a 500, not a dropped connection), and the OpenAPI
schema and its docs page are served."""

from __future__ import annotations

import json

import pytest

from arborl.gateway.errors import BadRequestError
from arborl.gateway.protocol import MAX_JSON_DEPTH, parse_json
from helpers.blackbox_gateway import ADMIN_KEY, QUESTION, start_harness


@pytest.fixture(scope="module")
def harness():
    h = start_harness()
    yield h
    h.close()


def _nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("kind", ["list", "object"])
def test_deeply_nested_bodies_get_a_400_on_every_body_route(harness, kind):
    sid, key = harness.new_session()
    routes = [("/chat/completions", key), ("/completions", key), ("/sessions", ADMIN_KEY),
              (f"/sessions/{sid}/reward", ADMIN_KEY), (f"/sessions/{sid}/finish", key)]
    for path, k in routes:
        for body in (_nested(5000, kind), b'{"messages": [{"role": "user", "content": ' + _nested(200, kind) + b"}]}"):
            r = harness.post(path, k, content=body)
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert f"nests arrays / objects more than {MAX_JSON_DEPTH} levels deep" in err["message"]
    # the server and the session still work
    r = harness.post("/chat/completions", key, json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_depth_limit_is_exact():
    ok = _nested(MAX_JSON_DEPTH, "list")
    assert parse_json(ok) is not None
    with pytest.raises(BadRequestError, match="more than 64 levels"):
        parse_json(_nested(MAX_JSON_DEPTH + 1, "list"))
    with pytest.raises(BadRequestError, match="more than 64 levels"):
        parse_json(_nested(100_000, "object"))  # past the decoder's own recursion limit
    # many brackets that do not nest (a long conversation) are fine
    wide = json.dumps({"messages": [{"role": "user", "content": "x"}] * 500}).encode()
    assert len(parse_json(wide)["messages"]) == 500


def test_openapi_schema_and_docs_are_served_without_a_key(harness):
    r = harness.http.get(harness.server.url + "/openapi.json")
    assert r.status_code == 200
    spec = r.json()
    paths = spec["paths"]
    for path, method in [("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
                         ("/v1/sessions", "post"), ("/v1/sessions/{session_id}/reward", "post"),
                         ("/v1/sessions/{session_id}/finish", "post"), ("/v1/sessions/{session_id}/trajectory", "get"),
                         ("/health", "get")]:
        assert method in paths[path], path
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"messages", "temperature", "max_tokens", "tools", "return_token_ids"} <= set(chat["properties"])
    assert "$ref" not in json.dumps(chat)  # nested models are inlined
    reward = paths["/v1/sessions/{session_id}/reward"]["post"]["requestBody"]
    assert reward["required"] is True and reward["content"]["application/json"]["schema"]["required"] == ["value"]
    assert paths["/v1/sessions"]["post"]["requestBody"]["required"] is False
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    docs = harness.http.get(harness.server.url + "/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text and "/openapi.json" in docs.text
    # documenting the bearer scheme changed no route's own key check
    r = harness.get("/models", None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = harness.post("/sessions", "not-the-admin-key", json={})
    assert r.status_code == 401
