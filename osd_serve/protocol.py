"""OpenAI-compatible request and response shapes (completions and chat completions), pydantic.

Unknown fields are refused (a 400 naming them) rather than silently ignored, and so are values of
OpenAI fields this server does not implement (`echo: true`, `n: 2`, a penalty): a client must learn
that this server does not do them, not get something else. Their neutral values (`echo: false`,
`frequency_penalty: 0`...), which clients send by default, are accepted. Types are strict: `"4"` is
not a number and `true` is not a token id.
Extensions beyond OpenAI: `top_k`, `expert` (pin a draft expert), `num_speculative_tokens`, `ignore_eos`.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .config import MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS, SEED_RANGE, TOP_K_LIMIT, SamplingParams, short_repr
from .logprobs import api_logprobs
from .output import Prompt, check_prompt


class _Strict(BaseModel):
    # strict: JSON types as sent, no coercion. Lenient pydantic took "max_tokens": "4", "stream": "yes",
    # and "prompt": [true, false] as the token ids [1, 0] (EOS and BOS of the default pair).
    model_config = ConfigDict(extra="forbid", strict=True)


def _unicode(v):
    """Text a tokenizer can take: JSON may carry a lone UTF-16 surrogate ("\udc80"), which Python keeps
    in a str and the tokenizer then refuses with a TypeError (a 500 before this check)."""
    for s in [v] if isinstance(v, str) else v if isinstance(v, list) else []:
        if isinstance(s, str):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"not valid Unicode text (a lone surrogate at character {e.start})") from None
    return v


# OpenAI fields this server does not implement: accepted only at the value that asks for nothing
# (SDK wrappers send them by default), any other value refused, never ignored. name -> (neutral
# values, why not).
_UNIMPLEMENTED = {
    "frequency_penalty": ((0,), "only 0 is supported: this server applies no penalties"),
    "presence_penalty": ((0,), "only 0 is supported: this server applies no penalties"),
    "logit_bias": ((None, {}), "logit bias is not supported; send null or {}"),
    "echo": ((False,), "echo is not supported; send false"),
    "top_logprobs": ((None, 0), "a completion's alternatives per token are its logprobs count; send null or 0"),
    "best_of": ((None, 1), "only 1 is supported (one choice per request)"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "tools": ((None, []), "tools are not supported; send null or []"),
    "tool_choice": ((None, "none"), "tools are not supported; send null or \"none\""),
    "response_format": ((None, {"type": "text"}), 'only {"type": "text"} is supported'),
    # an assistant turn's own fields, which a client echoes back in its history (OpenAI's SDK sets them
    # on the message object a reply from OpenAI parses into)
    "refusal": ((None,), "a refusal in a message is not supported; send null"),
    "tool_calls": ((None, []), "tool calls are not supported; send null or []"),
    "function_call": ((None,), "function calls are not supported; send null"),
    "audio": ((None,), "audio is not supported; send null"),
    "annotations": ((None, []), "annotations are not supported; send null or []"),
    # newer chat fields the openai SDK types: their values that ask for nothing
    "store": ((None, False), "stored completions are not supported; send null or false"),
    "metadata": ((None, {}), "metadata (for stored completions) is not supported; send null or {}"),
    "service_tier": ((None, "auto", "default"), 'only "auto" or "default" is supported'),
    "reasoning_effort": ((None,), "reasoning effort is not supported; send null"),
    "modalities": ((None, ["text"]), 'only ["text"] is supported'),
    "include_obfuscation": ((None, False), "stream obfuscation is not supported; send false"),
}


def _null_is_default(cls, v, info):
    """OpenAI's API takes null for these (nullable, "defaults to 1"...), and the openai client sends it for
    an argument passed as None (temperature=None): null means the default, as it does there. Strict
    types refused it with a 400."""
    return cls.model_fields[info.field_name].default if v is None else v


def _neutral_only(v, info):
    neutral, why = _UNIMPLEMENTED[info.field_name]
    if v not in neutral:  # by ==: 0.0 is 0; strict types already keep true out of the int fields
        raise ValueError(why)
    return v


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with no choices and the request's usage
    include_obfuscation: bool | None = None  # _UNIMPLEMENTED: only false (this server adds no obfuscation field)
    _neutral = field_validator("include_obfuscation")(_neutral_only)


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=TOP_K_LIMIT)  # -1 disables too, as vLLM's clients send it
    n: int = Field(1, ge=1, le=1)  # one choice per request; ask several times for more
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    user: str | None = None
    expert: str | None = Field(None, min_length=1)  # "" would fall through to the classifier unnoticed
    # None: the server's num_speculative_tokens; "auto": the engine picks k each step (colocated topology)
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_SPECULATIVE_TOKENS)] | Literal["auto"] | None = None
    ignore_eos: bool = False
    # _UNIMPLEMENTED: accepted at their neutral values only
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    _neutral = field_validator("frequency_penalty", "presence_penalty", "logit_bias")(_neutral_only)
    # top_k and ignore_eos too: vLLM's clients send them as null for "unset"
    _null = field_validator("temperature", "top_p", "top_k", "n", "stream", "ignore_eos", "frequency_penalty",
                            "presence_penalty", mode="before")(classmethod(_null_is_default))

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, v):
        return _unicode(v)

    def _limit(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:  # alternatives per token, or None: no logprobs (the fields differ per API)
        return None

    def sampling_params(self, default_k: int | str, default_max_tokens: int | None = 16) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        k = default_k if self.num_speculative_tokens is None else self.num_speculative_tokens
        return SamplingParams(
            max_tokens=self._limit() or default_max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, stop=stop, seed=self.seed, ignore_eos=self.ignore_eos, num_speculative_tokens=k,
            logprobs=self._logprobs(),
        )


_Ids = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_Sampling):
    # OpenAI's prompt may also be a batch (texts or token-id lists): typed, so an error inside one is
    # located where it is (prompt.0.1); one of one is that prompt (_one_prompt)
    prompt: str | _Ids | list[str] | list[_Ids]
    echo: bool = False  # these three: _UNIMPLEMENTED, accepted at their neutral values only
    best_of: int | None = None
    suffix: str | None = None
    # the legacy API's count: each token's logprob and its n likeliest alternatives (0: the token's own only);
    # false, which clients send for none, is null (top_logprobs is chat's: accepted at null or 0, as before)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    top_logprobs: int | None = None
    _false_is_null = field_validator("logprobs", mode="before")(classmethod(lambda cls, v: None if v is False else v))
    _neutral_completion = field_validator("echo", "best_of", "suffix", "top_logprobs")(_neutral_only)
    _null_echo = field_validator("echo", mode="before")(classmethod(_null_is_default))

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_batch(cls, v):
        # Also before the types: a batch mixing texts and id lists (["a", [1]]) failed every member of the
        # union, and the error named prompt.0 ("a valid integer"), an element that is fine. [1, "a"] is a
        # prompt of ids with a bad one, and keeps its located error.
        if isinstance(v, list) and len(v) > 1 and isinstance(v[0], (str, list)):
            raise ValueError(f"a batch of {len(v)} prompts is not supported: send one prompt per request")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        # A batch of one is that prompt, as LangChain's OpenAI LLM sends every prompt; a longer one is a
        # 400 (n is 1), refused by _no_batch.
        if v and isinstance(v, list) and not isinstance(v[0], int):
            v = v[0]
        return _unicode(v)

    def _logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, v):
        # An image part's own complaints (image_url not permitted, text missing) hid the one that matters
        if isinstance(v, dict) and "type" in v and v["type"] != "text":
            raise ValueError(f"only text content parts are supported, not type {short_repr(v['type'])}")
        return v

    @field_validator("text")
    @classmethod
    def _text(cls, v):
        return _unicode(v)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str | list[TextPart] | None  # None: an assistant turn that only called tools, in a client's history
    name: str | None = None
    refusal: str | None = None  # these five: _UNIMPLEMENTED, accepted at their neutral values only
    tool_calls: list | None = None
    function_call: dict | None = None
    audio: dict | None = None
    annotations: list | None = None
    _neutral = field_validator("refusal", "tool_calls", "function_call", "audio", "annotations")(_neutral_only)

    @field_validator("content")
    @classmethod
    def _content_text(cls, v, info: ValidationInfo):
        # A field validator (not a model one), so the 400 names messages.N.content; role is declared
        # first, so it is validated already (absent from info.data only when it was refused itself).
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError("only an assistant message may have null content")
        return _unicode(v)

    @field_validator("name")
    @classmethod
    def _name_text(cls, v):  # a chat template renders it, and the tokenizer refuses a lone surrogate
        return _unicode(v)

    def as_dict(self) -> dict:
        parts = [self.content or ""] if not isinstance(self.content, list) else [p.text for p in self.content]
        text = "".join(parts)
        # name goes to the chat template, as vLLM passes it (templates that know it render it; the rest
        # ignore it): dropped here it was a field accepted and silently ignored
        named = {"name": self.name} if self.name is not None else {}
        return {"role": "system" if self.role == "developer" else self.role, "content": text} | named


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict] | None = None  # these three: _UNIMPLEMENTED, accepted at their neutral values only
    tool_choice: str | None = None
    response_format: dict | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # any value: it means nothing without tools, which are refused
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    safety_identifier: str | None = None  # identification only, like user: accepted, not used
    prompt_cache_key: str | None = None  # a cache routing hint: accepted, not used
    logprobs: bool | None = None  # chat's switch (0 is false, as some clients send it), and top_logprobs its count
    _zero_is_off = field_validator("logprobs", mode="before")(classmethod(lambda cls, v: False if type(v) is int and v == 0 else v))
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    _neutral_chat = field_validator("tools", "tool_choice", "response_format", "store", "metadata", "service_tier",
                                    "reasoning_effort", "modalities")(_neutral_only)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):  # 0 without logprobs asks nothing (SDK wrappers send it)
            raise ValueError("needs logprobs: true")
        return v

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _limit(self) -> int | None:
        # OpenAI's newer name for the limit; with both sent it wins, as in vLLM (max_tokens is deprecated)
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]


def render_chat(messages: list[dict], tokenizer) -> str | list[int]:
    """A conversation as one prompt: the tokenizer's chat template when it has one (as token ids), else
    plain turns (as text). Templates write their own BOS ({{ bos_token }} in Llama-3's, Mistral's,
    Gemma's), so their text is encoded without the special tokens encode() would add: a second BOS."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001  templates raise their own rules ("roles must alternate")
            raise ValueError(f"messages: the model's chat template refused them: {e}") from None
        try:
            return tokenizer.encode(text, add_special_tokens=False)
        except (TypeError, UnicodeError) as e:  # what the template rendered (check_prompt's case for a text)
            raise ValueError(f"messages: the chat template's text could not be tokenized: {e}") from None
    # a name goes beside its role, as templates that know it write it: dropped, it was accepted and ignored
    return "".join(f"{m['role']}{' (' + m['name'] + ')' if m.get('name') else ''}: {m['content']}\n"
                   for m in messages) + "assistant:"


def prepare_prompt(tokenizer, vocab: int, max_model_len: int, prompt, params: SamplingParams) -> Prompt:
    """Text, token ids or chat messages [{"role", "content"}] as a checked Prompt. Tokenizer work: run it
    in a thread (asyncio.to_thread); a 1 MB prompt takes seconds to encode, and the tokenizer lets go of
    the GIL meanwhile."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt = render_chat(prompt, tokenizer)
    return check_prompt(tokenizer, vocab, max_model_len, prompt, params)


class RequestError(ValueError):
    """A bad request: becomes an HTTP 400 with OpenAI's error shape, naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 500: "server_error", 503: "server_error"}.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class UnknownExpert(ValueError):
    """An expert this replica does not serve: the client's 400 naming ``expert``. Its own type, so the
    disaggregated Router can tell it from a bug's ValueError when it comes back from a DraftPool replica
    (a RayTaskError wrapping it): during a rolling redeploy an old replica lacks an expert the Router knows."""

    def __init__(self, expert: str, known=()):
        self.expert, self.known = expert, sorted(known)
        super().__init__(f"expert: unknown expert {short_repr(expert)}; known: {self.known}")

    def __reduce__(self):  # pickled across Ray with its own arguments, not the message (args)
        return UnknownExpert, (self.expert, self.known)

    def not_loaded(self) -> "RequestError":
        """The answer when the router knows the expert (it checked) and the replica it reached does not:
        the two run different configs, a rolling redeploy in progress. The request is valid and a retry
        reaches a replica that has it (or, once the redeploy is done, the router's own 400), so a 503."""
        return RequestError(f"expert: {short_repr(self.expert)} is not loaded on the replica this request reached "
                            f"(a redeploy in progress; it serves {self.known}); retry shortly", "expert", 503,
                            "expert_not_loaded")


class _NotJSON(ValueError):
    pass


def _not_json(name: str):
    """Python's json takes NaN and Infinity, which JSON does not have ("temperature": NaN was then
    refused as "should be less than or equal to 2")."""
    raise _NotJSON(f"body is not valid JSON: {name} is not a JSON value")


class _LongInt:
    """An integer literal of more than sys.get_int_max_str_digits() digits (4300), which int() refuses
    with a plain ValueError (a 500 before it was caught: a 4 KB body could send one). Kept as a marker
    that no field type accepts, so the error names the field that held it."""

    __slots__ = ("digits",)

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:  # as a message may echo it (a content part's type)
        return f"an integer of {self.digits} digits"


def parse_request(raw: bytes, model: type[BaseModel]) -> BaseModel:
    long_ints: list[_LongInt] = []

    def parse_int(text: str) -> int | _LongInt:  # one call per integer: a prompt of token ids has 100k of them
        try:
            return int(text)
        except ValueError:
            long_ints.append(_LongInt(text))
            return long_ints[-1]

    try:
        # Decoded as UTF-8 here (RFC 8259 8.1; a leading BOM is let go): json.loads detected UTF-16 and -32 itself
        text = raw.decode("utf-8").removeprefix("\ufeff") if raw else "null"
        data = json.loads(text, parse_constant=_not_json, parse_int=parse_int)
    except UnicodeDecodeError as e:
        raise RequestError(f"body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise RequestError(f"body is not valid JSON: {e}") from None
    except _NotJSON as e:
        raise RequestError(str(e)) from None
    except RecursionError:
        raise RequestError("body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        # Only on the error path: the walk costs ~0.1 us per list item, and a prompt of token ids is long.
        if any(err["type"] == "string_unicode" for err in e.errors()) and (bad := _bad_key(data)) is not None:
            raise RequestError(f"{bad}: an object key that is not valid Unicode text (a lone surrogate)", bad) from None
        for err in e.errors():
            if isinstance(err.get("input"), _LongInt) and err["type"] != "extra_forbidden":  # an unknown field: say so
                param = validation_error([err]).param
                raise RequestError(f"{param}: an integer of {err['input'].digits} digits is too long to read", param) from None
        raise validation_error(e.errors()) from None
    if long_ints:  # one inside a free-form object (tools' JSON schema) that validation let through
        raise RequestError(f"body: an integer of {long_ints[0].digits} digits is too long to read")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options: only allowed when stream is true", "stream_options")
    return req


def _bad_key(data) -> str | None:
    """The path of the first object key holding a lone surrogate, written with it escaped, else None.
    pydantic refuses such a key without saying where ("unable to parse raw data as a unicode string"),
    and the key cannot be echoed as it is: the answer's JSON could not be encoded. Iterative: the
    body may nest as deep as json.loads allows."""
    stack = [([], data)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, dict):
            for key, value in obj.items():
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                if name != key:
                    return ".".join(path + [name])
                if isinstance(value, (dict, list)):
                    stack.append((path + [key], value))
        else:  # a list: only its containers have keys (a long list of token ids has none)
            stack.extend((path + [str(i)], v) for i, v in enumerate(obj) if isinstance(v, (dict, list)))
    return None


def validation_error(errors: list[dict]) -> RequestError:
    """pydantic's first error as a 400 naming the field. A value that fits no member of a union
    (prompt, stop) gets one error per member, located as prompt.str, prompt.list[int]...: name the
    field and list what it may be instead."""
    err = errors[0]
    extra = err["type"] == "extra_forbidden"  # its last part is the unknown field the client sent
    free = next((i for i, p in enumerate(err["loc"]) if p in _FREE_FORM), None)
    if free is not None and len(err["loc"]) > free + 1:  # the client's own keys below: named in the message, as
        # a param, a key named "seed" passed for the field and others were dropped
        key = ".".join(map(str, err["loc"][free + 1 :]))
        err = {**err, "loc": err["loc"][: free + 1], "msg": f"at key {short_repr(key)}: {err['msg'].removeprefix('Value error, ')}"}
    loc = [p for i, p in enumerate(err["loc"]) if isinstance(p, int) or p in _FIELD_NAMES or (extra and i == len(err["loc"]) - 1)]
    param = ".".join(map(str, loc)) or None
    under = [e for e in errors if list(e["loc"][: len(loc)]) == loc and len(e["loc"]) > len(loc)]
    members = [e["loc"][len(loc)] for e in under]
    if param and len(members) > 1 and len(loc) < len(err["loc"]):
        deep = max(under, key=lambda e: len(e["loc"]))  # the first of the deepest
        if len(deep["loc"]) > len(loc) + 1:  # the value is of that member's type and fails inside it: say where
            return validation_error([deep])
        kinds = dict.fromkeys(str(m).replace("constrained-int", "int >= 0") for m in members)
        # with the first member's own complaint: "int >= 0" alone hid num_speculative_tokens' upper bound
        return RequestError(f"{param}: must be one of {', '.join(kinds)} ({err['msg']})", param)
    msg = err["msg"].removeprefix("Value error, ")  # our validators' own words
    return RequestError(f"{param}: {msg}" if param else msg, param)


_FIELDS = ("prompt", "messages", "max_tokens", "temperature", "top_k", "top_p", "stop", "seed", "num_speculative_tokens", "expert",
           "logprobs")


def engine_error(e: ValueError) -> RequestError:
    """The engine's ValueErrors start with the field they are about (see SamplingParams.validate)."""
    msg = str(e)
    param = next((f for f in _FIELDS if msg.startswith(f)), None)
    # OpenAI's code for a prompt and completion over the model's context (check_prompt, check_room)
    return RequestError(msg, param, code="context_length_exceeded" if "max_model_len" in msg else None)


_FIELD_NAMES = {n for m in (CompletionRequest, ChatRequest, ChatMessage, StreamOptions, TextPart) for n in m.model_fields}
# Fields holding a dict of the client's own keys (logit_bias, metadata): a 400's param stops at the field
_FREE_FORM = {n for m in (CompletionRequest, ChatRequest, ChatMessage) for n, f in m.model_fields.items()
              if "dict" in str(f.annotation) and "list" not in str(f.annotation)}


# created: when the request was taken (int(time.time())), given by the caller. Every chunk of a stream
# carries the same one, as OpenAI's do ("Each chunk has the same timestamp"); stamped per chunk, a
# stream that crossed a second boundary changed it midway.


def completion_body(rid: str, model: str, text: str, finish: str | None, usage: dict, chat: bool, created: int,
                    logprobs: list[dict] | None = None) -> dict:  # logprobs: every token's logprobs.render entries
    lps = api_logprobs(logprobs, chat)
    if chat:
        # OpenAI's schema requires the choice's logprobs and the message's refusal (nullable, not optional):
        # clients typed from it (openapi-generator's Rust) refused an answer without them ("missing field")
        message = {"role": "assistant", "content": text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": lps, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice], "usage": usage}


def chunk_body(rid: str, model: str, text: str, finish: str | None, chat: bool, created: int, first: bool = False,
               include_usage: bool = False, logprobs: list[dict] | None = None, offset: int = 0) -> dict:
    """include_usage: the stream ends with usage_chunk, and OpenAI's other chunks then carry "usage": null.
    logprobs: this chunk's tokens' (their text starts at ``offset`` in the stream's)."""
    lps = api_logprobs(logprobs, chat, offset)
    if chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not finish else {})
        choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    else:
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    return body | ({"usage": None} if include_usage else {})


def usage_chunk(rid: str, model: str, usage: dict, chat: bool, created: int) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
