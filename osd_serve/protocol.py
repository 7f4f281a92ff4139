"""OpenAI-compatible request and response shapes (completions and chat completions), pydantic.

Unknown fields are refused (a 400 naming them) rather than silently ignored: a client that sends
`logprobs` or `n=2` must learn that this server does not do them, not get something else.
Extensions beyond OpenAI: `top_k`, `expert` (pin a draft expert), `num_speculative_tokens`, `ignore_eos`.
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import MAX_SPECULATIVE_TOKENS, SEED_RANGE, TOP_K_LIMIT, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with no choices and the request's usage


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=TOP_K_LIMIT)
    n: int = Field(1, ge=1, le=1)  # one choice per request; ask several times for more
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    user: str | None = None
    expert: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    ignore_eos: bool = False

    def sampling_params(self, default_k: int, default_max_tokens: int = 16) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        k = default_k if self.num_speculative_tokens is None else self.num_speculative_tokens
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, stop=stop, seed=self.seed, ignore_eos=self.ignore_eos, num_speculative_tokens=k,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


def render_chat(messages: list[dict], tokenizer) -> str | list[int]:
    """A conversation as one prompt: the tokenizer's chat template when it has one (as token ids), else
    plain turns (as text). Templates write their own BOS ({{ bos_token }} in Llama-3's, Mistral's,
    Gemma's), so their text is encoded without the special tokens encode() would add: a second BOS."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class RequestError(ValueError):
    """A bad request: becomes an HTTP 400 with OpenAI's error shape, naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = {401: "authentication_error", 500: "server_error"}.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


def parse_request(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options: only allowed when stream is true", "stream_options")
    return req


def validation_error(errors: list[dict]) -> RequestError:
    """pydantic's first error as a 400 naming the field. A value that fits no member of a union
    (prompt, stop) gets one error per member, located as prompt.str, prompt.list[int]...: name the
    field and list what it may be instead."""
    err = errors[0]
    extra = err["type"] == "extra_forbidden"  # its last part is the unknown field the client sent
    loc = [p for i, p in enumerate(err["loc"]) if isinstance(p, int) or p in _FIELD_NAMES or (extra and i == len(err["loc"]) - 1)]
    param = ".".join(map(str, loc)) or None
    members = [e["loc"][len(loc)] for e in errors if list(e["loc"][: len(loc)]) == loc and len(e["loc"]) > len(loc)]
    if param and len(members) > 1 and len(loc) < len(err["loc"]):
        return RequestError(f"{param}: must be one of {', '.join(dict.fromkeys(map(str, members)))}", param)
    return RequestError(f"{param}: {err['msg']}" if param else err["msg"], param)


_FIELDS = ("prompt", "max_tokens", "temperature", "top_k", "top_p", "stop", "seed", "num_speculative_tokens", "expert")


def engine_error(e: ValueError) -> RequestError:
    """The engine's ValueErrors start with the field they are about (see SamplingParams.validate)."""
    msg = str(e)
    param = next((f for f in _FIELDS if msg.startswith(f)), None)
    return RequestError(msg, param)


_FIELD_NAMES = {n for m in (CompletionRequest, ChatRequest, ChatMessage, StreamOptions) for n in m.model_fields}


def completion_body(rid: str, model: str, text: str, finish: str | None, usage: dict, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}


def chunk_body(rid: str, model: str, text: str, finish: str | None, chat: bool, first: bool = False) -> dict:
    if chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not finish else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, usage: dict, chat: bool) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [], "usage": usage}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
