"""More edges of the HTTP API's OpenAI compatibility, over the scripted backend of test_http_edges (no
model, no Ray): the shapes OpenAI's schema requires of an answer, which typed clients generated from
it (openapi-generator's Rust, Java...) refuse to parse when a required field is missing."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from deployments.config import AppConfig
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed
from tests.test_http_edges import ADMIN, AUTH, Scripted, _post

CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture
def client():
    cfg = AppConfig(wandb={"mode": "disabled"}, api_key="sk-test", admin_key="admin-test", served_model_name="org/m-1")
    return TestClient(make_app(Scripted(), cfg), raise_server_exceptions=False)


def _events(client, path, body):
    with client.stream("POST", path, headers=AUTH, json=body | {"stream": True}) as s:
        assert s.status_code == 200
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def test_a_model_entry_has_openais_required_fields_and_can_be_retrieved(client):
    """OpenAI's Model requires id, object, created and owned_by; created was missing. GET
    /v1/models/{model} (the openai client's models.retrieve) was a 404 for the served model."""
    r = client.get("/v1/models", headers=AUTH)
    card = r.json()["data"][0]
    assert {"id", "object", "created", "owned_by"} <= card.keys(), card
    assert card["id"] == "org/m-1" and isinstance(card["created"], int) and card["created"] > 1_600_000_000
    r = client.get("/v1/models/org/m-1", headers=AUTH)  # a hub-style name holds a slash
    assert r.status_code == 200 and r.json() == card, r.text
    r = client.get("/v1/models/other", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert client.get("/v1/models/org/m-1").status_code == 401  # retrieving is behind the key too
    assert client.get("/v1/models/", headers=AUTH).json()["data"] == [card]  # the list, as its redirect gave


@pytest.mark.parametrize("name", ["x/health", "admin/m", "health"])
def test_only_the_health_route_itself_is_open(name):
    """Auth read path segments: a last segment "health" was open and an "admin" segment anywhere took
    the admin key. With GET /v1/models/{id} that opened /v1/models/x/health to anyone; only the route
    /health itself is open, under a prefix too."""
    from fastapi import FastAPI

    cfg = AppConfig(wandb={"mode": "disabled"}, api_key="sk-test", admin_key="admin-test", served_model_name=name)
    app = make_app(Scripted(), cfg)
    outer = FastAPI()
    outer.mount("/disagg", app)
    for served, root in ((app, ""), (outer, "/disagg")):
        c = TestClient(served, raise_server_exceptions=False)
        assert c.get(f"{root}/v1/models/{name}").status_code == 401
        assert c.get(f"{root}/v1/models/{name}", headers=AUTH).json()["id"] == name
        assert c.get(f"{root}/health").status_code == 200 and c.get(f"{root}/health/").status_code == 200
        assert c.get(f"{root}/admin/experts", headers=AUTH).status_code == 401
        assert c.get(f"{root}/admin/experts", headers=ADMIN).status_code == 500  # past auth: Scripted's replica is gone


def test_an_unknown_model_is_openais_model_not_found(client):
    """OpenAI answers an unknown model with a 404 whose code is model_not_found (clients such as LiteLLM
    read the code); the code was null."""
    r = _post(client, "/v1/completions", {"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("path,headers,challenge", [
    ("/v1/completions", {}, "Bearer"),
    ("/v1/completions", {"Authorization": "Bearer wrong"}, 'Bearer error="invalid_token"'),
    ("/admin/experts", AUTH, 'Bearer error="invalid_token"'),  # the API key is not the admin key
])
def test_a_401_says_which_scheme_it_wants(client, path, headers, challenge):
    """RFC 7235 §3.1 and RFC 6750 §3: a 401 MUST carry WWW-Authenticate naming the scheme; a token that
    was sent and refused is invalid_token. The header was missing."""
    r = client.request("POST" if path.startswith("/v1") else "GET", path, headers=headers, json={"prompt": "x"})
    assert r.status_code == 401 and r.headers.get("www-authenticate") == challenge, r.headers
    assert r.json()["error"]["type"] == "authentication_error"


def test_disabled_admin_routes_answer_in_openais_error_shape():
    """Without an admin key the 404 was {"error": {"message", "type": "not_found"}}: no param or code,
    and a type no other answer of this server uses."""
    client = TestClient(make_app(Scripted(), AppConfig(wandb={"mode": "disabled"})))
    r = client.get("/admin/experts")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "admin routes are disabled", "type": "invalid_request_error",
                                  "param": None, "code": None}}


def test_a_chat_completion_has_the_fields_openai_requires():
    """OpenAI's chat choice requires logprobs and its message requires refusal (both nullable); a client
    typed from the schema (openapi-generator's Rust: "missing field `refusal`") refused the answer."""
    cfg = AppConfig(wandb={"mode": "disabled"})
    body = _post(TestClient(make_app(Scripted(), cfg)), "/v1/chat/completions", CHAT).json()
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["finish_reason"] == "length", choice
    assert choice["message"] == {"role": "assistant", "content": "abc", "refusal": None}


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)])
def test_with_include_usage_every_chunk_carries_usage(client, path, body):
    """OpenAI: with include_usage "all other chunks will also include a usage field, but with a null
    value"; they had none. Without it no chunk has the field."""
    chunks = _events(client, path, body | {"stream_options": {"include_usage": True}})
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1) and len(chunks) == 3, chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    assert all("usage" not in c for c in _events(client, path, body))
    if path.endswith("chat/completions"):  # a chunk's choice carries logprobs as the completion's does
        assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])


def test_a_messages_name_reaches_the_chat_template():
    """name was accepted and dropped; vLLM hands it to the template, which renders it where it knows it."""
    from osd_serve.protocol import ChatRequest, render_chat
    from tests.conftest import char_tokenizer

    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert req.message_dicts() == [{"role": "user", "content": "hi", "name": "ann"}]
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.get('name', '?') }}:{{ m.content }}\n{% endfor %}"
    assert tok.decode(render_chat(req.message_dicts(), tok)) == "ann:hi\n"
    # Without a template, plain turns carry it too (they dropped it)
    tok.chat_template = None
    assert render_chat(req.message_dicts() + [{"role": "user", "content": "yo"}], tok) == "user (ann): hi\nuser: yo\nassistant:"


def test_a_long_bad_value_is_not_echoed_whole():
    """17 stop strings of 30 KB each came back whole in the 400 (580 KB)."""
    from osd_serve.config import SamplingParams

    with pytest.raises(ValueError, match="stop") as e:
        SamplingParams(stop=["x" * 30_000] * 17)
    assert len(str(e.value)) < 400 and "characters)" in str(e.value)


def test_num_speculative_tokens_auto_reaches_the_engine_and_other_strings_are_400():
    backend = Scripted()
    cfg = AppConfig(wandb={"mode": "disabled"}, api_key="sk-test", num_speculative_tokens="auto")
    c = TestClient(make_app(backend, cfg), raise_server_exceptions=False)
    assert c.post("/v1/completions", headers=AUTH, json={"prompt": "x"}).status_code == 200
    assert c.post("/v1/completions", headers=AUTH, json={"prompt": "x", "num_speculative_tokens": 2}).status_code == 200
    assert [p.num_speculative_tokens for p in backend.params] == ["auto", 2]  # the server's default, then the request's
    for bad in ("fast", "4", 17, -1, True):
        r = c.post("/v1/completions", headers=AUTH, json={"prompt": "x", "num_speculative_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_speculative_tokens", (bad, r.text)
    r = c.post("/v1/completions", headers=AUTH, json={"prompt": "x", "num_speculative_tokens": 17})
    assert "less than or equal to 16" in r.json()["error"]["message"]  # the bound, not only "int >= 0"


def test_auto_is_refused_where_no_engine_times_the_whole_step():
    """Disaggregated, the draft and the target run in separate deployments: refused in the config, and
    per request with a 400 naming the field (before the backend sets anything up)."""
    import asyncio

    pytest.importorskip("ray")
    from deployments.disagg import DisaggBackend
    from osd_serve.config import SamplingParams

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AppConfig(topology="disaggregated", distill={"backend": "ray_train"}, num_speculative_tokens="auto")
    backend = DisaggBackend(AppConfig(wandb={"mode": "disabled"}, topology="disaggregated", distill={"enabled": False}))

    async def first():
        return await backend.stream("default", "x", SamplingParams(num_speculative_tokens="auto")).__anext__()

    with pytest.raises(ValueError, match="^num_speculative_tokens"):
        asyncio.run(first())


def test_a_replica_that_fails_to_start_stops_what_it_started(tok, tmp_path, monkeypatch):
    """A failure after the W&B run and the engine thread started (here the distiller's: a version store
    of another draft's shapes, a full disk) left the run open, its timer and the engine's loop running,
    and the versions slot held in a process Ray keeps for the next try."""
    import osd_serve.service as service

    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "mode": "full"}, wandb={"mode": "disabled"})
    make = lambda: SpecService(cfg, models=(target, perturbed(target, 0.05), tok), replica_tag="r", private_versions=True)  # noqa: E731
    made = []
    for name in ("Telemetry", "AsyncSpecServer"):
        real = getattr(service, name)
        monkeypatch.setattr(service, name, lambda *a, _real=real, **k: made.append(_real(*a, **k)) or made[-1])

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(service, "OnlineDistiller", broken)
    with pytest.raises(OSError):
        make()
    telemetry, server = made
    assert telemetry._stop.is_set() and not server._thread.is_alive()
    monkeypatch.undo()
    svc = make()
    try:  # the slot was let go: the next replica takes slot-0, not slot-1
        assert svc.distillers["default"].store.root == tmp_path / "replicas" / "slot-0" / "default"
    finally:
        svc.close()
