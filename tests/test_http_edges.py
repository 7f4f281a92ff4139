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
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "frequency_penalty", "presence_penalty"])
    r = _post(client, path, body | nulls)
    assert r.status_code == 200, r.text
    assert "choices" in r.json()  # stream null: not a stream
    p = backend.params[-1]
    assert (p.temperature, p.top_p) == (1.0, 1.0)
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


@pytest.mark.parametrize("prompt,want", [(["x"], "x"), ([[5, 6]], [5, 6])])
def test_a_one_prompt_batch_is_that_prompt(client, backend, prompt, want):
    """OpenAI's prompt may be a list of prompts; LangChain's OpenAI LLM sends one in a list. One of
    one was a 400; more than one stays a 400 naming prompt."""
    r = _post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert backend.prompts[-1] == want
    r = _post(client, "/v1/completions", {"prompt": [prompt[0], prompt[0]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_completions_logprobs_of_0_is_refused(client):
    """A completion's logprobs is a count, and 0 still asks for the chosen tokens' logprobs (OpenAI,
    vLLM): accepted and ignored, the client got logprobs null. Null (and chat's false) ask nothing."""
    r = _post(client, "/v1/completions", {"prompt": "x", "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert _post(client, "/v1/completions", {"prompt": "x", "logprobs": None}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": False}
    assert _post(client, "/v1/chat/completions", chat).status_code == 200


@pytest.mark.parametrize("logprobs", [5, True])
def test_a_completions_logprobs_refusal_does_not_advise_0(client, logprobs):
    """The shared check answered a completion's logprobs 5 with "send null, false or 0", and 0 is refused."""
    r = _post(client, "/v1/completions", {"prompt": "x", "logprobs": logprobs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert "or 0" not in r.json()["error"]["message"], r.text
