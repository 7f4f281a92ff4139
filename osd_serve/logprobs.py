"""Log probabilities of generated tokens (the API's ``logprobs``), taken from the target's own verify forward.

Every token a step emits was chosen at one position of that step's verify forward: an accepted draft token
at its own position, the corrected or bonus token at the one after the last accepted. So its logprob is the
log-softmax of the target's logits there, the same numbers a plain decode of the target computes, at no
extra forward. They are the target's raw distribution (temperature 1, no top-k or top-p), which is what
vLLM reports by default and what a client compares across requests of different temperatures.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .output import byte_tokens

# JSON has no -inf: a token the model rules out (a vocabulary's padding, fit_vocab) reads as vLLM's floor
LOGPROB_FLOOR = -9999.0


class TokenLogprob(NamedTuple):
    logprob: float  # of the generated token
    top: list[tuple[int, float]]  # the n likeliest ids with their logprobs, likeliest first (n = the request's logprobs)


def step_logprobs(target_logits: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor,
                  wanted: list[int | None]) -> list[list[TokenLogprob] | None]:
    """Per row, the TokenLogprobs of the tokens its step emits (tokens[i, :num_accepted[i] + 1]), or None
    where ``wanted[i]`` (the row's n alternatives) is None.

    target_logits [B, k+1, V] raw, fit to the vocabulary; tokens [B, k+1] int64, -1 padded; num_accepted [B]."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(wanted)
    if not rows:
        return out
    idx = torch.tensor(rows, device=target_logits.device)
    lp = target_logits.index_select(0, idx).float().log_softmax(-1)  # [R, k+1, V]
    chosen = lp.gather(2, tokens.index_select(0, idx).clamp_min(0)[..., None])[..., 0]  # [R, k+1]
    n_max = min(max(wanted[i] for i in rows), lp.shape[-1])
    top_v, top_i = lp.topk(n_max, dim=-1)  # [R, k+1, n_max], likeliest first
    chosen_l, top_vl, top_il, n_acc = chosen.tolist(), top_v.tolist(), top_i.tolist(), num_accepted.tolist()
    for r, i in enumerate(rows):
        n = wanted[i]
        out[i] = [TokenLogprob(chosen_l[r][j], list(zip(top_il[r][j][:n], top_vl[r][j][:n]))) for j in range(n_acc[i] + 1)]
    return out


_TOKEN_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token(tokenizer, t: int, lp: float, memo: dict) -> dict:
    """{"token", "logprob", "bytes"}: the token's own text (tokenizer.decode([t]), as vLLM and OpenAI give
    it) and its UTF-8 bytes; a byte-fallback token (<0xE2>) decodes to nothing or U+FFFD alone, so its
    bytes are the byte it stands for, from which a client rebuilds the characters it takes part in."""
    if t not in memo:
        text = tokenizer.decode([t])
        byte = byte_tokens(tokenizer).value.get(t)
        memo[t] = (text, [byte] if byte is not None else list(text.encode("utf-8", "surrogatepass")))
    text, raw = memo[t]
    return {"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": raw}


def render(tokenizer, ids: list[int], entries: list[TokenLogprob]) -> list[dict]:
    """Per generated token, OpenAI's chat form {"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}: plain data that crosses Ray as it is. Token texts are kept per tokenizer."""
    try:
        memo = _TOKEN_TEXT.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference
        memo = {}
    return [_token(tokenizer, t, e.logprob, memo) | {"top_logprobs": [_token(tokenizer, a, v, memo) for a, v in e.top]}
            for t, e in zip(ids, entries)]


def api_logprobs(content: list[dict] | None, chat: bool, offset: int = 0) -> dict | None:
    """The choice's ``logprobs`` from rendered entries (None: not asked for). Chat: {"content": [...],
    "refusal": null}. Completions (the legacy form): tokens, token_logprobs, top_logprobs (the n
    likeliest and the chosen token, up to n + 1 as OpenAI documents) and text_offset, each token's
    start in the completion's text counted from ``offset`` (a stream's text so far)."""
    if content is None:
        return None
    if chat:
        return {"content": content, "refusal": None}
    starts, at = [], offset
    for e in content:
        starts.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in content], "token_logprobs": [e["logprob"] for e in content],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} | {e["token"]: e["logprob"]}
                             for e in content],
            "text_offset": starts}


def delta_body(d, tokenizer, prompt_tokens: int) -> dict:
    """A StreamDelta as an API backend yields it (deployments/api.py), in plain data that crosses Ray, its
    logprobs rendered where the tokenizer is (None: not asked for)."""
    return {"text": d.text, "token_ids": d.token_ids, "finished": d.finished, "finish_reason": d.finish_reason,
            "prompt_tokens": prompt_tokens, "logprobs": None if d.logprobs is None else render(tokenizer, d.token_ids, d.logprobs)}
