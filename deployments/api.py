"""The HTTP surface (FastAPI), over any backend with the small interface below, so the same routes
run behind Ray Serve (the Router in deployments/app.py) and in-process in tests.

Backend:
    async stream(expert, prompt, params) -> async iterator of dicts
        {"text", "token_ids", "finished", "finish_reason", "prompt_tokens", "logprobs" (optional: logprobs.render's
        entries of token_ids, when asked for)}; raises ValueError on bad input
    experts() -> list[str]
    async ready() -> str | None; raises (or never returns) while the engine behind it cannot serve, else
        returns None or a warning: /health
    async admin_experts(), admin_metrics(), admin_rollback(expert, to), admin_update(expert) -> dict
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from osd_serve.protocol import (ChatRequest, CompletionRequest, RequestError, UnknownExpert, chunk_body,
                                completion_body, engine_error, parse_request, sse, usage_chunk)

from osd_serve.config import short_repr

from .config import AppConfig

try:
    from ray.serve.exceptions import BackPressureError
except ImportError:  # the API runs in-process without Ray too
    class BackPressureError(Exception):
        pass

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # /health waits this long for the backend's readiness check


def engine_failed(e: BaseException | None = None) -> RequestError:
    """A step of the engine serving the request raised (logged there), or the call to it failed (e:
    its replica died, logged here); its requests end, the server goes on."""
    if e is not None:
        logger.error("a request failed in the backend: %r", e, exc_info=e)
    return RequestError("the engine failed while generating this request; it was ended, retry it", None, 500)


def backend_failed(e: BaseException) -> RequestError:
    """A failed call to the backend, before or after the first token: a full queue (Serve's
    max_queued_requests, on any step of a disaggregated request) is a 503 and nothing to log; else engine_failed."""
    if isinstance(e, BackPressureError):
        return RequestError("the server is at capacity (its request queue is full); retry shortly", None, 503)
    if isinstance(e, UnknownExpert) and not isinstance(getattr(e, "cause", None), BaseException):
        return e.not_loaded()  # a later step reached a replica from before a redeploy (disaggregated: each propose is routed anew)
    return engine_failed(e)


def admin_error(e: Exception, param: str | None) -> RequestError:
    """An admin action the backend refused: a version that is not kept (KeyError) is a 404, a state
    that does not allow it (no older version, distillation off) a 409, and an action that failed (an
    update out of memory: recorded in /admin/experts' last_error too) a 500. Behind Ray Serve the error comes
    as a RayTaskError, itself a subclass of the cause's type, whose str() is the remote traceback (pids,
    addresses, paths): the answer gives the cause's own message."""
    cause = getattr(e, "cause", None)
    e = cause if isinstance(cause, Exception) else e
    if isinstance(e, BackPressureError):  # the engine replica's queue is full: Serve's plain-text 503 otherwise
        return backend_failed(e)
    if not isinstance(e, (KeyError, ValueError)):  # the action itself failed (an update out of memory)
        logger.error("an admin action failed: %r", e, exc_info=e)
        return RequestError(f"the action failed: {type(e).__name__}: {e}", None, 500)
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return RequestError(str(msg), param if isinstance(e, KeyError) else None, 404 if isinstance(e, KeyError) else 409)


def classify(prompt: str, cfg: AppConfig) -> str:
    """The configured keyword classifier: the first expert with a keyword in the prompt."""
    # casefold, not lower: "STRASSE" is "straße" ignoring case, as the README promises
    low = prompt.casefold() if isinstance(prompt, str) else ""
    for e in cfg.experts:
        if any(k.casefold() in low for k in e.keywords):
            return e.name
    return cfg.default_expert


def unknown_model(name: str, served: str) -> RequestError:
    # OpenAI's own answer to a model it does not have: a 404 with code model_not_found, which clients read
    return RequestError(f"model: unknown model {short_repr(name)}; this server serves {served!r}", "model", 404, "model_not_found")


def _unauthorized(request: Request, message: str) -> JSONResponse:
    """RFC 7235 §3.1: a 401 MUST carry WWW-Authenticate. RFC 6750 §3: a bearer token that was sent and
    refused is invalid_token; a request with none gets the bare scheme."""
    challenge = 'Bearer error="invalid_token"' if "authorization" in request.headers else "Bearer"
    # code: OpenAI's for a wrong or missing key, which its clients read (the SDK's AuthenticationError.code)
    return JSONResponse(RequestError(message, None, 401, "invalid_api_key").body(), 401, headers={"WWW-Authenticate": challenge})


def _route_path(scope) -> str:
    """The path the app's routes match: without the prefix it is mounted under (route_prefix, a Mount),
    as Starlette's router takes it (starlette._utils.get_route_path), whether or not the server left
    that prefix in "path"."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def _authorized(request: Request, key: str | None) -> bool:
    if key is None:
        return True
    # The scheme is case-insensitive (RFC 7235), the key is not. Spaces around the key are not part of
    # it: RFC 6750 allows more than one after "Bearer", and uvicorn's httptools parser (unlike h11)
    # leaves a header value's trailing whitespace in, so the same client got 401 on one and 200 on the other.
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def make_app(backend, cfg: AppConfig) -> FastAPI:
    app = FastAPI(title="osd-serve", version="0.1.0")

    @app.exception_handler(RequestError)
    async def _bad_request(_, e: RequestError):
        # a full queue: tell clients (the openai SDK's retries) when to come back, not its own 0.5 s backoff
        return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": "1"} if e.status == 503 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # unknown route, wrong method: OpenAI's shape too
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(RequestError(msg, None, e.status_code).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_route_args(_, e: RequestValidationError):  # e.g. ?to=abc: OpenAI's shape, not FastAPI's 422
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p not in ("query", "path", "body", "header")) or None
        err = RequestError(f"{param}: {first['msg']}" if param else first["msg"], param)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def _server_error(_, e: Exception):
        # Anything else that raised (GET /admin/experts while the engine replica is down) was Starlette's
        # plain-text "Internal Server Error", not OpenAI's shape. Starlette still re-raises it: the
        # server logs the traceback. The type only: a Ray error's str() is the remote traceback.
        cause = getattr(e, "cause", None)
        kind = type(cause if isinstance(cause, Exception) else e).__name__
        return JSONResponse(RequestError(f"the server failed: {kind}", None, 500).body(), 500)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # Deny by default; only /health is open. Matched on the route's own path, not on the segments of
        # the full one: a model id may hold any segment (GET /v1/models/x/health, /v1/models/admin/m).
        path = _route_path(request.scope).rstrip("/")
        admin = path == "/admin" or path.startswith("/admin/")
        if not admin and path != "/health" and not _authorized(request, cfg.api_key):
            return _unauthorized(request, "missing or wrong API key (Authorization: Bearer ...)")
        if admin:
            if cfg.admin_key is None:  # admin routes exist only when an admin key is configured
                return JSONResponse(RequestError("admin routes are disabled", None, 404).body(), 404)
            if not _authorized(request, cfg.admin_key):
                return _unauthorized(request, "missing or wrong admin key")
        return await call_next(request)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        # Readiness, for a load balancer: 200 once the engine behind this router can serve. It answered
        # 200 as soon as the router was up, also while the engine replica was loading or failing to
        # start, and the load balancer then sent traffic that got 503s.
        try:
            warning = await asyncio.wait_for(backend.ready(), HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  whatever failed (no replica, a dead one), this router cannot serve
            if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                why = f"the readiness check did not finish within {HEALTH_TIMEOUT_S:g} s"
            elif type(e) is RuntimeError:  # the readiness checks' own reasons
                why = f"RuntimeError: {e}"
            else:  # needs no key: a RayTaskError's or a bug's text (tracebacks, paths, addresses) stays in the log
                why = type(e).__name__
                logger.warning("/health: the readiness check failed: %s: %s", type(e).__name__, e)
            return JSONResponse({"status": "unavailable", "error": why}, 503)
        return {"status": "ok"} | ({"warning": warning} if warning else {})

    # OpenAI's Model requires created; the application's build time, the same on every router replica
    # (the app is built once and pickled to them).
    created_at = int(time.time())

    def model_card() -> dict:
        return {"id": cfg.served_model_name, "object": "model", "created": created_at, "owned_by": "osd-serve",
                "experts": backend.experts()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")  # :path, as a hub-style served_model_name holds a slash
    async def retrieve_model(name: str):
        if not name:  # /v1/models/ lands here now rather than on the redirect to the list it got
            return await models()
        if name != cfg.served_model_name:
            raise unknown_model(name, cfg.served_model_name)
        return model_card()

    async def _serve(request: Request, chat: bool):
        # Before parsing: a text prompt is capped by max_prompt_chars after parsing, but a list of token
        # ids or many messages would be parsed first (8 bytes a character covers "\uXXXX" escapes).
        limit = 8 * cfg.prompt_char_limit + (1 << 16)
        raw = bytearray()
        try:
            async for chunk in request.stream():  # as it comes: request.body() held a body of any size whole first
                raw += chunk
                if len(raw) > limit:
                    raise RequestError(f"body: more than {limit} bytes (8 per character of max_prompt_chars)", None, 413)
        except ClientDisconnect:  # gone while sending: nobody reads an answer; not a 500 and a logged traceback
            return Response(status_code=499)
        req = parse_request(bytes(raw), ChatRequest if chat else CompletionRequest)
        if req.model not in (None, cfg.served_model_name):
            raise unknown_model(req.model, cfg.served_model_name)
        # Chat is rendered where the tokenizer lives (the engine replica); the router classifies text.
        prompt = req.message_dicts() if chat else req.prompt
        text = "\n".join(m["content"] for m in prompt) if chat else prompt
        chars = len(text) if isinstance(text, str) else 0  # token ids: capped by the body limit above
        if chat:  # names count too: a chat template renders them, and tokenizing is what the limit bounds
            chars += sum(len(m.get("name") or "") for m in prompt)
        if chars > cfg.prompt_char_limit:
            field = "messages" if chat else "prompt"
            raise RequestError(f"{field}: {chars} characters, more than max_prompt_chars ({cfg.prompt_char_limit})", field)
        expert = req.expert or classify(text, cfg)
        if expert not in backend.experts():
            raise RequestError(f"expert: unknown expert {short_repr(expert)}; known: {backend.experts()}", "expert")
        # chat may name the limit max_completion_tokens (OpenAI's newer name, ChatRequest._limit); errors then use that name
        alias = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else None
        try:
            # Unset, chat runs to the rest of the context (None, resolved per prompt where it is tokenized)
            # as OpenAI's and vLLM's chat do; completions keep the legacy API's 16.
            params = req.sampling_params(cfg.num_speculative_tokens, None if chat else min(16, cfg.max_model_len // 2))
            params.validate()
            it = backend.stream(expert, prompt, params).__aiter__()
            first = await it.__anext__()  # bad input (too long a prompt...) raises here, before any 200
        except ValueError as e:
            # Not bad input: a RayTaskError (raised in the replica), or a replica lacking the expert checked
            # above (on another config, a redeploy): backend_failed's 500 or 503, as at any later step
            if isinstance(e, UnknownExpert) or isinstance(getattr(e, "cause", None), BaseException):
                raise backend_failed(e) from None
            err = engine_error(e)
            if chat and err.param == "prompt":  # the prompt rendered from the messages: chat's field is messages
                err = RequestError(f"messages: the rendered {err}", "messages", code=err.code)
            if alias:
                err = RequestError(str(err).replace("max_tokens", alias), alias if err.param == "max_tokens" else err.param,
                                   code=err.code)
            raise err from None
        except Exception as e:  # noqa: BLE001  the backend call failed (its replica died): OpenAI's 500, not a bare one
            raise backend_failed(e) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        model, created = cfg.served_model_name, int(time.time())  # one timestamp for all of a stream's chunks

        n_prompt = first.get("prompt_tokens", 0)

        def usage(n_tok: int) -> dict:
            return {"prompt_tokens": n_prompt, "completion_tokens": n_tok, "total_tokens": n_prompt + n_tok}

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        if req.stream:
            async def events():
                n, n_tok, failed, at = 0, 0, None, 0  # at: the token texts' length so far (a completion's text_offset)
                try:
                    async for d in _chain(first, it):
                        n_tok += len(d["token_ids"])
                        if d["finish_reason"] == "error":  # headers are sent: the error goes in the stream
                            failed = engine_failed()
                            break
                        lps = d.get("logprobs")  # tokens whose text is held back (a stop string's prefix) come with theirs
                        if d["text"] or d["finished"] or n == 0 or lps:
                            yield sse(chunk_body(rid, model, d["text"], d["finish_reason"] if d["finished"] else None, chat, created,
                                                 n == 0, include_usage, lps, at))
                            n += 1
                            at += sum(len(e["token"]) for e in lps or ())
                except Exception as e:  # noqa: BLE001  a replica died mid-stream: the stream was cut with no end
                    failed = backend_failed(e)
                if failed is not None:
                    yield sse(failed.body())
                elif include_usage:
                    yield sse(usage_chunk(rid, model, usage(n_tok), chat, created))
                yield sse("[DONE]")

            return _ClosingStream(events(), it, media_type="text/event-stream", headers={"x-osd-expert": expert})

        text, n_tok, finish, lps = "", 0, None, [] if params.logprobs is not None else None
        try:
            async for d in _chain(first, it):
                text += d["text"]
                n_tok += len(d["token_ids"])
                finish = d["finish_reason"]
                if lps is not None:
                    lps.extend(d.get("logprobs") or ())
        except Exception as e:  # noqa: BLE001  as above, for a whole completion
            raise backend_failed(e) from None
        if finish == "error":
            raise engine_failed()
        return JSONResponse(completion_body(rid, model, text, finish, usage(n_tok), chat, created, lps),
                            headers={"x-osd-expert": expert})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    @app.get("/admin/experts")
    async def admin_experts():
        try:
            return await backend.admin_experts()
        except BackPressureError as e:  # a full queue: /v1's 503 with Retry-After, not Serve's plain text
            raise backend_failed(e) from None

    @app.get("/admin/metrics")
    async def admin_metrics():
        """The telemetry rows also sent to W&B (acceptance per expert and position, latency, versions)."""
        try:
            return await backend.admin_metrics()
        except BackPressureError as e:
            raise backend_failed(e) from None

    @app.post("/admin/experts/{expert}/rollback")
    async def admin_rollback(expert: str, to: int | None = None):
        _known(expert)
        try:
            return await backend.admin_rollback(expert, to)
        except Exception as e:  # noqa: BLE001  every failure answers in OpenAI's shape (admin_error)
            raise admin_error(e, "to") from None

    @app.post("/admin/experts/{expert}/update")
    async def admin_update(expert: str):
        _known(expert)
        try:
            return await backend.admin_update(expert)
        except Exception as e:  # noqa: BLE001
            raise admin_error(e, None) from None

    def _known(expert: str) -> None:
        if expert not in backend.experts():
            raise RequestError(f"expert: unknown expert {short_repr(expert)}; known: {backend.experts()}", "expert", 404)

    return app


class _ClosingStream(StreamingResponse):
    """Closes its body and the backend's stream under it however the response ends. A client that goes
    away cancels the response while the body is suspended at a yield (handing a chunk to send), and
    Starlette leaves that generator to the garbage collector; it sits in a reference cycle, so the
    backend's finally (the disaggregated release of the sequence on DraftPool and Verifier) waited
    for a full collection. The body never closes the stream itself (it stops at an error delta)."""

    def __init__(self, body, source, **kwargs):
        super().__init__(body, **kwargs)
        self.source = source

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            if hasattr(self.source, "aclose"):
                await self.source.aclose()


async def _chain(first, rest):
    yield first
    async for x in rest:
        yield x
