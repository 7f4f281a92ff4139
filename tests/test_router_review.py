"""The Router over SpecServer (deployments/app.py's _HandleBackend behind deployments/api.py), driven
with a fake DeploymentHandle: what a client sees when the replica's stream is cut, raises or is full."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("ray.serve")

import deployments.app as app  # noqa: E402
from deployments.api import classify, make_app  # noqa: E402
from deployments.config import AppConfig  # noqa: E402


def _delta(text: str) -> dict:
    return {"text": text, "token_ids": [1], "finished": False, "finish_reason": None, "prompt_tokens": 3}


class _Gen:
    """DeploymentResponseGenerator's part the backend uses: async iteration and cancel()."""

    def __init__(self, source):
        self.source, self.cancelled = source, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.source.__anext__()

    def cancel(self):
        self.cancelled = True


class _Handle:
    def __init__(self, script):
        self.script, self.gens = script, []

    def options(self, **kw):
        def remote(payload):
            self.gens.append(_Gen(self.script(payload)))
            return self.gens[-1]
        return SimpleNamespace(generate=SimpleNamespace(remote=remote))


def _app(monkeypatch, script):
    cfg = AppConfig(experts=[{"name": "default"}, {"name": "sql", "keywords": ["select"]}], distill={"enabled": False})
    handle = _Handle(script)
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: SimpleNamespace(app_name="osd"))
    monkeypatch.setattr(app.serve, "get_deployment_handle", lambda name, app_name: handle)
    return make_app(app._HandleBackend([e.name for e in cfg.experts]), cfg), handle


def _post(fastapi_app, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fastapi_app), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body)
    return asyncio.run(run())


async def _endless(payload):
    i = 0
    while True:
        await asyncio.sleep(0.01)
        yield _delta(f"t{i}")
        i += 1


@pytest.mark.parametrize("how", ["disconnect", "cancelled"])
def test_a_client_gone_mid_stream_cancels_the_engines_stream(monkeypatch, how):
    """The router's loop over the handle's stream just ended when the client left: Ray Serve's response
    generator does not cancel itself, so the SpecServer call (and the engine's request) decoded on to
    max_tokens, or to the end of the context for a chat without one."""
    fastapi_app, handle = _app(monkeypatch, _endless)
    body = json.dumps({"prompt": "hi", "stream": True, "max_tokens": 1000}).encode()
    sent, two, state = [], asyncio.Event(), {"body": False}

    async def receive():
        if not state["body"]:
            state["body"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        if how == "cancelled":  # the proxy cancels the request instead: the app never sees a disconnect
            await asyncio.Event().wait()
        await two.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= 2:
            two.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("1.2.3.4", 1),
             "server": ("x", 80)}

    async def run():
        task = asyncio.ensure_future(fastapi_app(scope, receive, send))
        await asyncio.wait_for(two.wait(), 10)
        if how == "cancelled":
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(run(), 20))
    assert handle.gens and handle.gens[0].cancelled


def test_a_replicas_own_exception_is_a_500_not_its_traceback_as_a_400(monkeypatch):
    """A ValueError raised in the SpecServer replica (not sent as {"error"} data) reaches the router as
    RayTaskError(ValueError), itself a ValueError: the client got a 400 whose message was the remote
    traceback, pids, addresses and paths included."""
    from ray.exceptions import RayTaskError

    def remote_error():
        try:
            raise ValueError("expert: unknown expert 'sql'")
        except ValueError as e:
            return RayTaskError("SpecServer.generate", "Traceback ... (pid=4242, ip=10.0.0.7, path=/srv/m)", e).as_instanceof_cause()

    async def fails(payload):
        raise remote_error()
        yield

    r = _post(_app(monkeypatch, fails)[0], {"prompt": "select 1"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "pid=" not in r.text and "10.0.0.7" not in r.text, r.text


def test_an_unknown_expert_in_the_replica_is_sent_as_data_and_answered_503(monkeypatch):
    """SpecServer.generate looked its expert up outside the try that sends bad input back as data, so a
    Router that knows an expert an older SpecServer replica lacks (a rolling redeploy) got an exception.
    Then it came as plain error data, a 400 "unknown expert" for an expert the server's config has: the
    request is valid and a retry reaches a replica holding it, so it is sent as its own key, and a 503."""
    server = object.__new__(app.SpecServer.func_or_class)
    server.service = SimpleNamespace(experts=lambda: ["default"], close=lambda: None)
    monkeypatch.setattr(app.serve, "get_multiplexed_model_id", lambda: "sql")

    async def get_expert(expert):  # @serve.multiplexed's wrapper needs a replica: its body, as it raises
        return await app.SpecServer.func_or_class.get_expert.__wrapped__(server, expert)

    server.get_expert = get_expert

    async def run():
        return [d async for d in server.generate({"expert": "sql", "prompt": "x", "params": {}})]

    sent = asyncio.run(run())
    assert sent == [{"error": "expert: unknown expert 'sql'; known: ['default']", "unknown_expert": ["sql", ["default"]]}]

    async def replica(payload):  # what the router receives from that replica
        for d in sent:
            yield d

    r = _post(_app(monkeypatch, replica)[0], {"prompt": "select 1"})
    err = r.json()["error"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert (err["param"], err["code"]) == ("expert", "expert_not_loaded"), r.text
    assert "'sql' is not loaded on the replica" in err["message"] and "['default']" in err["message"], r.text
    plain = _post(_app(monkeypatch, lambda payload: replica(payload))[0], {"prompt": "select 1", "expert": "nope"})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "expert"  # unknown to the router: a 400


def test_a_full_request_queue_is_a_503(monkeypatch):
    """Serve's max_queued_requests refuses with BackPressureError: it answered 500 "the engine failed
    while generating this request" and logged a traceback per refused request."""
    from ray.serve.exceptions import BackPressureError

    async def full(payload):
        raise BackPressureError(num_queued_requests=4, max_queued_requests=4)
        yield

    r = _post(_app(monkeypatch, full)[0], {"prompt": "x"})
    assert r.status_code == 503 and "capacity" in r.json()["error"]["message"], r.text


def test_the_classifier_ignores_case_as_unicode_does():
    """lower() is not caseless matching: "STRASSE" missed the keyword "straße"."""
    cfg = AppConfig(experts=[{"name": "default"}, {"name": "de", "keywords": ["straße"]}], distill={"enabled": False})
    assert classify("Wo ist die STRASSE?", cfg) == "de" and classify("Wo ist die Straße?", cfg) == "de"
    assert classify("no keyword here", cfg) == "default"
