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
from .sampling import overflow_holds_all

# JSON has no -inf: a token the model rules out (a vocabulary's padding, fit_vocab) reads as vLLM's floor
LOGPROB_FLOOR = -9999.0


class TokenLogprob(NamedTuple):
    logprob: float  # of the generated token
    top: list[tuple[int, float]]  # the n likeliest ids with their logprobs, likeliest first (n = the request's logprobs)


def step_logprobs(target_logits: torch.Tensor, tokens: torch.Tensor, num_accepted: list[int],
                  wanted: list[int | None]) -> list[list[TokenLogprob] | None]:
    """Per row, the TokenLogprobs of the tokens its step emits (tokens[i, :num_accepted[i] + 1]), or None
    where ``wanted[i]`` (the row's n alternatives) is None.

    target_logits [B, k+1, V] raw, fit to the vocabulary; tokens [B, k+1] int64, -1 padded; num_accepted: B ints
    (the caller's own list: the step already read them to the host)."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(wanted)
    if not rows:
        return out
    idx = torch.tensor(rows, device=target_logits.device)
    x = target_logits.index_select(0, idx).float()  # [R, k+1, V]
    if bool(torch.isposinf(x).any()):  # rare (a float16 overflow): read as the sampler did, not inf - inf = NaN
        x = overflow_holds_all(x)
    lse = x.logsumexp(-1, keepdim=True)  # [R, k+1, 1]: gathered and top values less it, no [R, k+1, V] log_softmax
    chosen = (x.gather(2, tokens.index_select(0, idx).clamp_min(0)[..., None]) - lse)[..., 0]  # [R, k+1]
    n_max = min(max(wanted[i] for i in rows), x.shape[-1])
    top_v, top_i = x.topk(n_max, dim=-1)  # [R, k+1, n_max], likeliest first
    top_v = top_v - lse
    chosen_l, top_vl, top_il = chosen.tolist(), top_v.tolist(), top_i.tolist()
    for r, i in enumerate(rows):
        n = wanted[i]
        out[i] = [TokenLogprob(chosen_l[r][j], list(zip(top_il[r][j][:n], top_vl[r][j][:n]))) for j in range(num_accepted[i] + 1)]
    return out


class _TokenTexts:
    """Each id's text and bytes for one tokenizer, worked out once per id (a few decodes each).

    The text is the id decoded after an anchor token, cut after the anchor's own: a SentencePiece decoder
    strips the leading space from the start of a text, so "▁is" decoded alone gave "is" where the output
    reads " is" (the tokens then no longer add up to the text, nor text_offset to its positions). Special
    tokens keep their names ("</s>"), as vLLM gives them. The bytes are the token's own: a byte-fallback
    <0xE2>'s byte, a byte-level BPE token's (GPT-2, Llama-3, Qwen) through its byte-to-character table, so
    a character split across tokens is rebuilt from them, where the texts show U+FFFD; otherwise the
    text's UTF-8."""

    def __init__(self, tokenizer):
        # The tokenizer is passed to each call, never kept: a value holding its WeakKeyDictionary key kept it alive
        self.memo: dict[int, tuple[str, list[int]]] = {}
        self.anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self.head = self._decode(tokenizer, self.anchor)
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = None
        if "ByteLevel" in repr(decoder):
            from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character table

            self.byte_level = {c: b for b, c in bytes_to_unicode().items()}
        self.bytes = byte_tokens(tokenizer).value
        self.special = set(getattr(tokenizer, "all_special_ids", ()))

    @staticmethod
    def _decode(tokenizer, ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __call__(self, tokenizer, t: int) -> tuple[str, list[int]]:
        if t not in self.memo:
            full = self._decode(tokenizer, self.anchor + [t])
            text = full[len(self.head):] if full.startswith(self.head) else self._decode(tokenizer, [t])
            name = tokenizer.convert_ids_to_tokens(t) if self.byte_level is not None and t not in self.special else None
            if t in self.bytes:
                raw = [self.bytes[t]]
            elif name and all(c in self.byte_level for c in name):
                raw = [self.byte_level[c] for c in name]
            else:
                raw = list(text.encode("utf-8", "surrogatepass"))
            self.memo[t] = (text, raw)
        return self.memo[t]


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token(texts: _TokenTexts, tokenizer, t: int, lp: float) -> dict:
    text, raw = texts(tokenizer, t)
    # >= is False for NaN too: JSON has neither NaN nor -inf
    return {"token": text, "logprob": lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR, "bytes": raw}


def render(tokenizer, ids: list[int], entries: list[TokenLogprob]) -> list[dict]:
    """Per generated token, OpenAI's chat form {"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}: plain data that crosses Ray as it is."""
    if len(ids) != len(entries):  # a replica of a release before logprobs returns none: not a short list
        raise RuntimeError(f"logprobs: {len(entries)} entries for {len(ids)} tokens (a replica of an older osd-serve?)")
    try:
        texts = _TOKEN_TEXTS.get(tokenizer) or _TOKEN_TEXTS.setdefault(tokenizer, _TokenTexts(tokenizer))
    except TypeError:  # a tokenizer that takes no weak reference
        texts = _TokenTexts(tokenizer)
    return [_token(texts, tokenizer, t, e.logprob) | {"top_logprobs": [_token(texts, tokenizer, a, v) for a, v in e.top]}
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
