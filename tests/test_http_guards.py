"""The HTTP API's own checks and answers, over scripted backends (no model, no Ray): what it refuses
before a backend is called, how it names the field, and how a stream ends when the engine fails.
Each test here failed on a plausible one-line break of deployments/api.py or osd_serve/protocol.py
that the other HTTP tests let through."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from deployments.config import AppConfig
from tests.test_http_edges import ADMIN, AUTH, Scripted, _post
from tests.test_http_edges2 import _events

CHAT = {"messages": [{"role": "user", "content": "x"}]}


def _client(backend, **cfg):
    cfg = AppConfig(**{"wandb": {"mode": "disabled"}, "api_key": "sk-test", "admin_key": "admin-test"} | cfg)
    return TestClient(make_app(backend, cfg), raise_server_exceptions=False)


def test_the_bearer_scheme_is_read_in_any_case():
    """RFC 7235: the auth scheme is case-insensitive ("BEARER" is "Bearer"); the key is not."""
    c = _client(Scripted())
    assert c.get("/v1/models", headers={"Authorization": "BEARER sk-test"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "bEaReR sk-test"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "BEARER SK-TEST"}).status_code == 401


def test_max_prompt_chars_is_a_limit_not_a_bound_and_chat_names_messages():
    """A prompt of exactly max_prompt_chars characters is served; one more is a 400 naming the field
    the client sent: prompt for a completion, messages for a chat (whose text is the joined contents)."""
    backend = Scripted()
    c = _client(backend, max_prompt_chars=10)
    assert _post(c, "/v1/completions", {"prompt": "x" * 10}).status_code == 200
    r = _post(c, "/v1/completions", {"prompt": "x" * 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert _post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10}]}).status_code == 200
    r = _post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 6}, {"role": "user", "content": "y" * 6}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert r.json()["error"]["message"].startswith("messages: 13 characters")
    # names count: a chat template renders them, so a long name was tokenized whole before any limit
    r = _post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 6, "name": "n" * 5}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages: 11 characters"), r.text
    assert len(backend.prompts) == 2  # the refused ones never reached the backend


def test_an_unknown_expert_is_refused_before_the_backend_is_called():
    """The router refuses an expert the backend does not serve with a 400 naming expert; it is not left
    to the backend (the colocated engine would refuse it too, a disaggregated worker may not)."""
    backend = Scripted()
    r = _post(_client(backend), "/v1/completions", {"prompt": "x", "expert": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "expert", r.text
    assert "known: ['default']" in r.json()["error"]["message"] and backend.prompts == []


class _TwoExperts(Scripted):
    def experts(self):
        return ["default", "sql"]


def test_keywords_classify_in_any_case():
    """The keyword classifier ignores case on both sides: a keyword written "SELECT" in the config
    routes "select ..." to its expert."""
    c = _client(_TwoExperts(), experts=[{"name": "default"}, {"name": "sql", "keywords": ["SELECT"]}])
    for prompt in ("select a from b", "SELECT a FROM b", "Select 1"):
        assert _post(c, "/v1/completions", {"prompt": prompt}).headers["x-osd-expert"] == "sql", prompt
    assert _post(c, "/v1/completions", {"prompt": "print(1)"}).headers["x-osd-expert"] == "default"


def test_a_requests_num_speculative_tokens_of_0_is_not_the_servers_default():
    """0 (plain decoding, no draft) is a value the client chose, not a missing one: it must not fall
    back to the server's num_speculative_tokens."""
    backend = Scripted()
    c = _client(backend, num_speculative_tokens=3)
    for sent, want in ((0, 0), (None, 3), (5, 5)):
        body = {"prompt": "x"} | ({} if sent is None else {"num_speculative_tokens": sent})
        assert _post(c, "/v1/completions", body).status_code == 200
        assert backend.params[-1].num_speculative_tokens == want, (sent, backend.params[-1])


class _FailsAfterText(Scripted):
    """The colocated service's failed step: some text, then a final delta with finish_reason error."""

    async def stream(self, expert, prompt, params):
        self.prompts.append(prompt)
        yield {"text": "ab", "token_ids": [1, 2], "finished": False, "finish_reason": None, "prompt_tokens": 3}
        yield {"text": "", "token_ids": [], "finished": True, "finish_reason": "error", "prompt_tokens": 3}


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)])
def test_a_stream_that_fails_ends_with_the_error_alone(path, body):
    """After the engine failed, the stream carries the API's error and [DONE]: no chunk with
    finish_reason "error" (no OpenAI value: a client would take it as an end of its own), and no
    usage chunk after the error (as if the completion had ended)."""
    chunks = _events(_client(_FailsAfterText()), path, body | {"stream_options": {"include_usage": True}})
    assert len(chunks) == 2, chunks
    assert chunks[0]["choices"][0]["finish_reason"] is None
    assert chunks[-1]["error"]["type"] == "server_error" and "retry it" in chunks[-1]["error"]["message"]


class _DiesAtOnce(Scripted):
    async def stream(self, expert, prompt, params):
        raise RuntimeError("The actor died unexpectedly before finishing this task.")
        yield  # an async generator


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_that_fails_before_any_output_is_the_engines_500(stream):
    """A backend call that raises before its first chunk (its replica died) answers with the engine's
    error (the request was ended: retry it), not the catch-all "the server failed"."""
    r = _post(_client(_DiesAtOnce()), "/v1/completions", {"prompt": "x", "stream": stream})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["message"].startswith("the engine failed while generating"), err


class _HeldBack(Scripted):
    """A first delta with no text yet (held back: an incomplete character, a stop string's prefix)."""

    async def stream(self, expert, prompt, params):
        yield {"text": "", "token_ids": [1], "finished": False, "finish_reason": None, "prompt_tokens": 3}
        yield {"text": "ab", "token_ids": [2], "finished": True, "finish_reason": "stop", "prompt_tokens": 3}


def test_a_chat_stream_opens_with_the_assistant_role_before_any_text():
    """OpenAI's first chat chunk carries delta.role "assistant" (clients build the message from it),
    and it is sent for the first delta even when that delta has no text yet."""
    chunks = _events(_client(_HeldBack()), "/v1/chat/completions", CHAT)
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "ab"}], chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


class _Warns(Scripted):
    async def ready(self):
        return "the Serve controller has not answered for 42 s"


def test_health_passes_on_the_backends_warning():
    """A backend that can serve but has something to report (a controller that stopped answering) is a
    200 with the warning, for monitoring; the warning is not dropped."""
    r = _client(_Warns()).get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "warning": "the Serve controller has not answered for 42 s"}


class _Admin(Scripted):
    def __init__(self):
        super().__init__()
        self.calls = []

    async def admin_rollback(self, expert, to):
        self.calls.append(("rollback", expert, to))
        raise ValueError(f"expert {expert!r} has no distiller in this replica")

    async def admin_update(self, expert):
        self.calls.append(("update", expert))
        raise ValueError(f"expert {expert!r} has no distiller in this replica")


@pytest.mark.parametrize("action", ["rollback", "update"])
def test_an_admin_action_on_an_unknown_expert_is_a_404_naming_it(action):
    """An expert this server does not have is a 404 naming expert for both admin actions, before the
    backend is asked (which would answer a 409 about its distiller)."""
    backend = _Admin()
    r = _client(backend).post(f"/admin/experts/nope/{action}", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["param"] == "expert", r.text
    assert backend.calls == []


def test_a_chat_without_messages_is_a_400_naming_messages():
    """An empty conversation is refused by the API, not handed to a backend as an empty prompt."""
    backend = Scripted()
    r = _post(_client(backend), "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert backend.prompts == []


def test_only_an_assistant_message_may_have_null_content():
    """null content is an assistant turn that only called tools; a system or developer message with
    none is a 400 naming its content, as a user's is."""
    c = _client(Scripted())
    for role in ("system", "developer", "user"):
        r = _post(c, "/v1/chat/completions", {"messages": [{"role": role, "content": None}, {"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", (role, r.text)
    ok = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]}
    assert _post(c, "/v1/chat/completions", ok).status_code == 200


def test_a_chat_template_that_refuses_the_messages_is_a_value_error_naming_messages():
    """Templates enforce their own rules (Llama-2's and Mistral's: roles must alternate) by raising a
    jinja error: it becomes the 400 naming messages, not a 500."""
    from osd_serve.protocol import render_chat
    from tests.conftest import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}x"
    with pytest.raises(ValueError, match="^messages: the model's chat template refused them: .*roles must alternate"):
        render_chat([{"role": "assistant", "content": "hi"}], tok)
    assert tok.decode(render_chat([{"role": "user", "content": "hi"}], tok)) == "x"


@pytest.mark.parametrize("body,param,says", [
    ({"prompt": [5, -1]}, "prompt.1", "greater than or equal to 0"),
    ({"prompt": [5, "x"]}, "prompt.1", "valid integer"),  # a list of ids with a bad one, located
    ({"prompt": ["x", "y"]}, "prompt", "a batch of 2 prompts is not supported"),
    # a list of several led by a text or an id list is a batch, whatever else is in it: a mixed one named
    # prompt.0, a valid element ("Input should be a valid integer")
    ({"prompt": ["x", 5]}, "prompt", "a batch of 2 prompts is not supported"),
    ({"prompt": ["x", [1]]}, "prompt", "a batch of 2 prompts is not supported"),
    ({"prompt": [[1], "x", [2]]}, "prompt", "a batch of 3 prompts is not supported"),
    ({"prompt": [[1, -1]]}, "prompt.0.1", "greater than or equal to 0"),  # a one-prompt batch: inside its element
    ({"prompt": [["a"]]}, "prompt.0.0", "valid integer"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0", "only text content parts are supported, not type 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}]},
     "messages.0.content.0.cache_control", "Extra inputs are not permitted"),
    ({"prompt": 5}, "prompt", "must be one of str, list[int >= 0]"),  # of no member's type: the members listed
])
def test_a_bad_value_inside_a_union_field_is_named_where_it_is(body, param, says):
    """The first member's complaint was quoted whatever was sent: a list prompt with a negative id, or an
    image part, read "prompt: must be one of str, ... (Input should be a valid string)"."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(_client(Scripted()), path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert says in r.json()["error"]["message"], r.text


def test_an_unknown_model_or_expert_is_not_echoed_whole():
    """A 500,000-character model name came back in a 500 KB 404 (config errors cut echoes at 200)."""
    c = _client(Scripted())
    for field, status in (("model", 404), ("expert", 400)):
        r = _post(c, "/v1/completions", {"prompt": "x", field: "m" * 500_000})
        assert r.status_code == status and r.json()["error"]["param"] == field, r.text
        assert len(r.content) < 1000 and "(500002 characters)" in r.json()["error"]["message"]
