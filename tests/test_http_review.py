"""From a review of the HTTP API against OpenAI's semantics: the bearer key's surrounding spaces, and a
client that leaves while sending its body. The server is test_http's (fixtures from there)."""

from __future__ import annotations

import asyncio

from tests.test_http import client, service  # noqa: F401  (fixtures)


def test_spaces_around_the_key_are_not_part_of_it(client):
    """RFC 6750 allows more than one space after "Bearer", and uvicorn's httptools parser (unlike h11)
    keeps a header value's trailing whitespace: the same client got 401 on one server and 200 on the other."""
    for value in ("Bearer sk-test ", "Bearer  sk-test", "Bearer sk-test\t", " Bearer sk-test"):
        assert client.get("/v1/models", headers={"Authorization": value}).status_code == 200, repr(value)
    for value in ("Bearer sk-tes t", "Bearersk-test", "Bearer", "Basic sk-test", "sk-test"):
        assert client.get("/v1/models", headers={"Authorization": value}).status_code == 401, repr(value)


def test_a_client_gone_while_sending_its_body_is_no_server_error(client):
    """request.stream() raises ClientDisconnect when the client leaves mid-body: the catch-all answered
    500 and the server logged a traceback, so any client could fill the log and the 500 count at will."""
    app = client.app
    sent, calls = [], iter([{"type": "http.request", "body": b'{"prompt": "x', "more_body": True},
                            {"type": "http.disconnect"}])

    async def receive():
        return next(calls)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", b"Bearer sk-test"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, sent
