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

from .config import MAX_SPECULATIVE_TOKENS, SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1)  # one choice per request; ask several times for more
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
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


def render_chat(messages: list[dict], tokenizer) -> str:
    """A conversation as one prompt: the tokenizer's chat template when it has one, else plain turns."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class RequestError(ValueError):
    """A bad request: becomes an HTTP 400 with OpenAI's error shape, naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status == 400 else "authentication_error" if self.status == 401 else "error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


def parse_request(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise RequestError(f"{param}: {err['msg']}" if param else err["msg"], param) from None


_FIELDS = ("prompt", "max_tokens", "temperature", "top_k", "top_p", "stop", "seed", "num_speculative_tokens", "expert")


def engine_error(e: ValueError) -> RequestError:
    """The engine's ValueErrors start with the field they are about (see SamplingParams.validate)."""
    msg = str(e)
    param = next((f for f in _FIELDS if msg.startswith(f)), None)
    return RequestError(msg, param)


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


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
