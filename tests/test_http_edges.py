"""Edges of the HTTP API's OpenAI compatibility, over a scripted backend (no model, no Ray): what a
client of OpenAI's API may send and what it may rely on in the answer."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from deployments.config import AppConfig

AUTH = {"Authorization": "Bearer sk-test"}
ADMIN = {"Authorization": "Bearer admin-test"}


class Scripted:
    """A backend that answers every request with the same two deltas and keeps the params it got."""

    def __init__(self):
        self.params, self.prompts = [], []

    def experts(self):
        return ["default"]

    async def ready(self):
        return None

    async def stream(self, expert, prompt, params):
        self.params.append(params)
        self.prompts.append(prompt)
        yield {"text": "ab", "token_ids": [1, 2], "finished": False, "finish_reason": None, "prompt_tokens": 3}
        yield {"text": "c", "token_ids": [3], "finished": True, "finish_reason": "length", "prompt_tokens": 3}

    async def admin_experts(self):
        raise RuntimeError("the engine replica is gone")


@pytest.fixture
def backend():
    return Scripted()


@pytest.fixture
def client(backend):
    cfg = AppConfig(wandb={"mode": "disabled"}, api_key="sk-test", admin_key="admin-test")
    return TestClient(make_app(backend, cfg), raise_server_exceptions=False)


def _post(client, path, body):
    return client.post(path, headers=AUTH | {"content-type": "application/json"}, content=json.dumps(body))


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "echo": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_null_is_the_openai_default(client, backend, path, body):
    """OpenAI's API declares these nullable with a default, and the openai client sends null for an
    argument given as None (temperature=None): each was a 400 ("Input should be a valid number")."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "frequency_penalty", "presence_penalty",
                           "top_k", "ignore_eos"])  # the last two: the extensions, as vLLM's clients send them
    r = _post(client, path, body | nulls)
    assert r.status_code == 200, r.text
    assert "choices" in r.json()  # stream null: not a stream
    p = backend.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.ignore_eos) == (1.0, 1.0, 0, False)
    # a value that asks for something is still refused, and so is a wrong type
    for bad, param in (({"frequency_penalty": 0.5}, "frequency_penalty"), ({"temperature": "1"}, "temperature")):
        r = _post(client, path, body | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_every_chunk_of_a_stream_has_the_same_created(client, path, body, monkeypatch):
    """OpenAI: "Each chunk has the same timestamp". Each chunk was stamped when it was sent, so a stream
    that crossed a second boundary changed its created midway."""
    clock = iter(range(1_700_000_000, 1_800_000_000, 7))
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))  # every call a later second
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", path, headers=AUTH, json=body) as s:
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 3 and chunks[-1]["usage"]["completion_tokens"] == 3
    assert len({c["created"] for c in chunks}) == 1, [c["created"] for c in chunks]
    assert len({c["id"] for c in chunks}) == 1


def test_an_unexpected_failure_is_a_500_in_openai_shape(client):
    """GET /admin/experts while the engine replica is down raised out of the route: Starlette answered
    a plain-text "Internal Server Error", which no OpenAI client reads as an error body."""
    r = client.get("/admin/experts", headers=ADMIN)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["message"] == "the server failed: RuntimeError"
    assert "replica is gone" not in r.text  # the type, not the message: a Ray error's str() is a remote traceback


@pytest.mark.parametrize("method,path", [("get", "/admin/experts"), ("get", "/admin/metrics"),
                                         ("post", "/admin/experts/default/rollback"),
                                         ("post", "/admin/experts/default/update")])
def test_an_admin_call_refused_by_a_full_queue_is_a_503_to_retry(backend, method, path):
    """The engine replica's queue full (Serve's max_queued_requests): the reads were Serve's plain-text 503
    without Retry-After, the actions a 500 "the action failed" with a logged traceback; /v1's answer is a
    503 in OpenAI's shape with Retry-After."""
    from ray.serve.exceptions import BackPressureError

    async def full(*args):
        raise BackPressureError(num_queued_requests=1, max_queued_requests=1)

    for op in ("admin_experts", "admin_metrics", "admin_rollback", "admin_update"):
        setattr(backend, op, full)
    cfg = AppConfig(wandb={"mode": "disabled"}, api_key="sk-test", admin_key="admin-test")
    r = getattr(TestClient(make_app(backend, cfg)), method)(path, headers=ADMIN)  # raises what no handler answered
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["type"] == "server_error" and "capacity" in r.json()["error"]["message"]


@pytest.mark.parametrize("prompt,want", [(["x"], "x"), ([[5, 6]], [5, 6])])
def test_a_one_prompt_batch_is_that_prompt(client, backend, prompt, want):
    """OpenAI's prompt may be a list of prompts; LangChain's OpenAI LLM sends one in a list. One of
    one was a 400; more than one stays a 400 naming prompt."""
    r = _post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert backend.prompts[-1] == want
    r = _post(client, "/v1/completions", {"prompt": [prompt[0], prompt[0]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("path,body,want", [
    ("/v1/completions", {"logprobs": 0}, 0),  # a count: 0 still asks for the chosen tokens' own logprobs
    ("/v1/completions", {"logprobs": 20}, 20),
    ("/v1/completions", {"logprobs": None}, None),
    ("/v1/chat/completions", {"logprobs": True}, 0),  # chat: a switch, and top_logprobs the count
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 5}, 5),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, None),  # what SDK wrappers send by default
    # what clients sent for "none" before logprobs were returned (all 200 then): still none
    ("/v1/completions", {"logprobs": False, "top_logprobs": None}, None),
    ("/v1/completions", {"top_logprobs": 0}, None),
    ("/v1/chat/completions", {"logprobs": 0}, None),
])
def test_logprobs_reach_the_engine_as_a_count(client, backend, path, body, want):
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    r = _post(client, path, base | body)
    assert r.status_code == 200, r.text
    assert backend.params[-1].logprobs == want


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"logprobs": True}, "logprobs"),  # strict: a switch is not a count
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # alternatives of logprobs never asked for
    ("/v1/completions", {"logprobs": 2, "top_logprobs": 2}, "top_logprobs"),  # chat's field: a completion counts in logprobs
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
])
def test_bad_logprobs_are_a_400_naming_the_field(client, path, body, param):
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    r = _post(client, path, base | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path,body,key", [
    ("/v1/completions", {"prompt": "x", "logit_bias": {"prompt": "a"}}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": "a"}}, "abc"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "metadata": {"seed": 1}}, "seed"),
])
def test_a_bad_value_in_a_dict_of_the_clients_keys_names_the_field_and_the_key(client, path, body, key):
    """The param kept a key below logit_bias or metadata only when it happened to be a field's name
    (logit_bias.prompt, but logit_bias for the key abc): one field, two params."""
    r = _post(client, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == next(iter(body.keys() - {"prompt", "messages"})), r.text
    assert f"at key '{key}'" in err["message"], r.text


def _scope(path: str) -> dict:
    """A POST as uvicorn's HTTP scope has it: no asgi spec_version, so Starlette watches receive() for
    a disconnect."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json")], "client": ("c", 1), "server": ("s", 80)}


class Endless(Scripted):
    """A stream that never ends and never waits, so a disconnect lands while a chunk is handed to send."""

    closed = 0

    async def stream(self, expert, prompt, params):
        try:
            while True:
                yield {"text": "a", "token_ids": [1], "finished": False, "finish_reason": None, "prompt_tokens": 3}
        finally:  # where the disaggregated backend releases the sequence on DraftPool and Verifier
            self.closed += 1


def test_a_client_that_goes_away_mid_stream_ends_the_backends_stream():
    """Starlette cancels a stream whose client disconnected with the body suspended at a yield and
    leaves it to the garbage collector, which finds it only in a full collection (a reference cycle):
    the disaggregated sequence stayed live on the Verifier, its caches held, until then."""
    import asyncio
    import gc

    backend = Endless()
    app = make_app(backend, AppConfig(wandb={"mode": "disabled"}))
    body = json.dumps({"prompt": "x", "stream": True}).encode()

    async def run():
        chunks, gone, asked = [], asyncio.Event(), []

        async def receive():
            asked.append(1)
            if len(asked) == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            chunks.append(message)
            if len(chunks) == 3:  # the headers and two chunks, then the client goes away
                gone.set()

        await app(_scope("/v1/completions"), receive, send)
        for _ in range(10):  # time for an asyncio finalizer, if the stream were merely unreferenced
            await asyncio.sleep(0.01)
        return backend.closed

    gc.disable()  # a collection at the wrong moment would hide the leak
    try:
        assert asyncio.run(run()) == 1
    finally:
        gc.enable()


def test_a_body_over_the_cap_is_refused_as_it_arrives():
    """The 413 for a body over 8 bytes a prompt character came after request.body() had read all of
    it: a client could make the router hold gigabytes first."""
    import asyncio

    app = make_app(Scripted(), AppConfig(wandb={"mode": "disabled"}, max_prompt_chars=1000))  # cap: 73,536 bytes
    chunk, n = b" " * 16384, 1000  # 16 MB of JSON whitespace, in pieces

    async def run():
        read, sent = [], []

        async def receive():
            read.append(1)
            return {"type": "http.request", "body": chunk, "more_body": len(read) < n}

        async def send(message):
            sent.append(message)

        await app(_scope("/v1/completions"), receive, send)
        return len(read), sent[0]["status"]

    n_read, status = asyncio.run(run())
    assert status == 413 and n_read <= 6, n_read  # the chunks up to the cap, and none after
