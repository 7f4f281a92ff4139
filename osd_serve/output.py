"""Request state on the host: accepted tokens, stop conditions, incremental text for streaming."""

from __future__ import annotations

import codecs
from array import array
import weakref
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from tokenizers.decoders import DecodeStream

from .config import SamplingParams, short_repr


class Prompt(NamedTuple):
    """A prompt that ``check_prompt`` accepted: its text and token ids."""

    text: str
    ids: list[int]


def check_room(max_tokens: int | None, max_model_len: int, name: str = "max_tokens", whose: str = "") -> None:
    """max_tokens must leave a prompt at least one position; name and whose word it as an option (the CLI's
    --max-tokens, said once before any prompt rather than blamed on the first)."""
    if max_tokens is not None and max_tokens >= max_model_len:
        raise ValueError(f"{name} {short_repr(max_tokens)} leaves no room for a prompt within {whose}max_model_len {max_model_len}")


def check_prompt(tokenizer, vocab: int, max_model_len: int, prompt, params: SamplingParams) -> Prompt:
    """(text, ids) of a prompt given as text or token ids, or ValueError saying what is wrong with it.
    Tokenizing a long prompt takes seconds: servers call this in a thread (``asyncio.to_thread``), not
    on their event loop or the engine loop, where it would stall every other request."""
    params.validate()
    check_room(params.max_tokens, max_model_len)
    if isinstance(prompt, str):
        try:
            text, ids = prompt, tokenizer.encode(prompt)
        except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate, which the tokenizer refuses
            raise ValueError(f"prompt could not be tokenized: {e}") from None
    else:
        ids, text = [int(t) for t in prompt], None
    if not ids:
        raise ValueError("prompt must contain at least one token")
    if any(not 0 <= t < vocab for t in ids):  # before decode, which overflows on huge ids
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    # Not + k: Request.step_k never drafts past max_tokens, so k needs no positions of its own.
    if len(ids) + (params.max_tokens or 1) > max_model_len:  # unset: the rest of the context, at least 1
        if len(ids) < max_model_len and params.max_tokens is not None:  # either can give: not "too long" of 2 tokens
            raise ValueError(f"prompt and max_tokens exceed the context: {len(ids)} prompt tokens + max_tokens "
                             f"{params.max_tokens} > max_model_len {max_model_len}; shorten the prompt or lower "
                             f"max_tokens (to at most {max_model_len - len(ids)})")
        raise ValueError(f"prompt is too long: {len(ids)} prompt tokens leave no room for output within "
                         f"max_model_len {max_model_len}")
    return Prompt(tokenizer.decode(ids) if text is None else text, ids)


def fit_max_tokens(params: SamplingParams, n_prompt: int, max_model_len: int) -> SamplingParams:
    """params with max_tokens set: unset (None), the rest of the context after a checked prompt of
    n_prompt tokens. A copy, not in place: one params object may serve many prompts (generate)."""
    return params if params.max_tokens is not None else replace(params, max_tokens=max_model_len - n_prompt)


# Prompt ids decoded before the output and cut off again (_decode): one would do for the known cases.
DECODE_CONTEXT = 4


def _decode(tokenizer, ids: list[int], context: list[int] = ()) -> str:
    """Text of generated ids, without the tokenizer's ``clean_up_tokenization_spaces`` (as vLLM): that
    post-processing rewrites text already streamed (" ." becomes "." once the "." arrives) and
    changes what the model wrote (code such as ``x .y``). Llama-3's tokenizer turns it on.

    ``context``: the last prompt ids. Decoded alone, the output's first token loses its leading space
    with SentencePiece-style decoders, which strip the start of a text (Llama-2, Mistral: "▁Paris"
    gave "Paris" after "The capital is"); decoded after the context it keeps it, and the context's own
    text is cut off. Request.context() passes none that ends inside a UTF-8 character."""
    kw = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
    if not context:
        return tokenizer.decode(ids, **kw)
    head = tokenizer.decode(list(context), **kw)
    full = tokenizer.decode(list(context) + list(ids), **kw)
    return full[common_prefix_len(head, full):]


class ByteTokens(NamedTuple):
    """A SentencePiece byte-fallback vocabulary's (Llama-2, Mistral, Gemma) <0x00>..<0xFF> tokens, which
    its decoder turns into text a run at a time, and the special ids a decode skips (the special-tokens
    map's and every added token marked special), which a run goes on across. Empty for other tokenizers
    (a byte-level BPE such as GPT-2's has no such tokens)."""

    value: dict[int, int]  # id -> its byte
    skipped: frozenset[int]
    size: int = 1 << 62  # ids from here on are not the tokenizer's: a decode drops them, as it does specials

    def skips(self, t: int) -> bool:
        return t in self.skipped or t >= self.size

    def ends_run(self, t: int) -> bool:
        return t not in self.value and not self.skips(t)


_BYTE_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_tokens(tokenizer) -> ByteTokens:
    """The tokenizer's ByteTokens, looked up once per tokenizer (256 lookups a step would cost more
    than the step's decode)."""
    try:
        return _BYTE_TOKENS[tokenizer]
    except (KeyError, TypeError):  # TypeError: a tokenizer that takes no weak reference
        pass
    names = [f"<0x{i:02X}>" for i in range(256)]
    to_ids, to_tokens = (getattr(tokenizer, f, None) for f in ("convert_tokens_to_ids", "convert_ids_to_tokens"))
    value = {} if to_ids is None or to_tokens is None else {  # a stand-in with only decode: none known
        i: b for b, (i, n) in enumerate(zip(to_ids(names), names)) if i is not None and to_tokens(i) == n}  # not unk
    skipped = set(getattr(tokenizer, "all_special_ids", ())) if value else set()
    if value:  # added specials outside the special-tokens map (<unused0>, ChatML's <|im_start|>) are skipped too
        skipped |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    found = ByteTokens(value, frozenset(skipped), len(tokenizer) if value and hasattr(tokenizer, "__len__") else 1 << 62)
    try:
        _BYTE_TOKENS[tokenizer] = found
    except TypeError:
        pass
    return found


def eos_token_ids(model_or_config, tokenizer) -> set[int]:
    """The target's EOS ids: its generation_config's (one or a list), else the tokenizer's."""
    gen = getattr(model_or_config, "generation_config", model_or_config)
    eos = getattr(gen, "eos_token_id", None)
    eos = eos if eos is not None else tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


@dataclass
class Completion:
    """What a finished (or streaming) request returns. ``token_ids`` are generated ids only."""

    request_id: str
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (NaN target logits) | None while running
    proposed: int = 0  # draft tokens proposed for this request
    accepted: int = 0  # draft tokens the target accepted
    steps: int = 0  # target forwards spent on this request (decode steps)
    logprobs: list | None = None  # logprobs.TokenLogprob per token id, when the request asked for them

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / self.steps if self.steps else 0.0


# How a request can end. "abort": stopped from outside (its client went away); "error": its step
# failed, or the target's logits for it were NaN.
FINISH_REASONS = ("stop", "length", "abort", "error")


def finish_counts(counts) -> dict[str, int]:
    """{reason: count} over FINISH_REASONS, zeros included (a stable schema for /admin/experts)."""
    return {r: counts.get(r, 0) for r in FINISH_REASONS}


@dataclass
class StreamDelta:
    request_id: str
    text: str  # new text since the last delta
    token_ids: list[int]  # new token ids since the last delta
    finished: bool
    finish_reason: str | None
    logprobs: list | None = None  # logprobs.TokenLogprob per token id of this delta, when asked for


@dataclass
class Request:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # one logprobs.TokenLogprob per output id, if params.logprobs is set
    text: str = ""
    finish_reason: str | None = None
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # steps in which one of its drafts was rejected (tested = accepted + rejected)
    steps: int = 0
    expert: str = "default"  # the draft expert (LoRA adapter) serving it; its records go to that shard
    _sent_ids: int = 0  # how many output ids / chars were already streamed
    _sent_chars: int = 0
    _rendered: int = 0  # output ids whose text is in ``text`` (the rest end inside a UTF-8 character)
    _stream: DecodeStream | None = None  # incremental detokenizer (see _render)
    _full_decode: bool = False  # the stream refused this output: decoded in full every step (see _render)
    _until_run_ends: bool = False  # its last byte run is not UTF-8: decoded in full until a token ends it
    _run_at: int = 0  # output ids from here on are byte tokens (or skipped specials), whose text a later one may rewrite
    _fixed_chars: int = 0  # the chars of ``text`` before that run, which no later token changes
    _run_utf8: codecs.IncrementalDecoder | None = None  # an open run's bytes so far, to see when they stop being UTF-8
    _context: list[int] | None = None  # see context()
    _stops: StopScan | None = None  # see delta()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def context(self, tokenizer) -> list[int]:
        """The prompt ids the output is decoded after (_decode): the last DECODE_CONTEXT, or none where
        they end inside a UTF-8 character (a prompt given as token ids), since a stream prefilled with
        half a character and the full decode would then disagree on where the output's text starts.
        With byte tokens, they end before the prompt's trailing bytes (and skipped specials): a byte
        decoder decodes a run as a whole, so output bytes that are not valid UTF-8 made the prompt's
        valid ones U+FFFD too, one more in the output's text per prompt byte. A prompt of nothing but
        bytes keeps its last ids: there the output's first space (which a Strip decoder drops from a
        text's start) is worth more than the U+FFFD count of an output starting with a stray byte."""
        if self._context is None:
            bt, end = byte_tokens(tokenizer), len(self.prompt_ids)
            while end and not bt.ends_run(self.prompt_ids[end - 1]):
                end -= 1
            end = end or len(self.prompt_ids)
            tail = list(self.prompt_ids[max(0, end - DECODE_CONTEXT) : end])
            self._context = [] if _decode(tokenizer, tail).endswith("\ufffd") else tail
        return self._context

    def step_k(self, emitted: int | None = None, auto_k: int | None = None) -> int:
        """Draft tokens for this request's next step (or for a step once ``emitted`` tokens are out):
        its k (``auto_k``, the engine's choice, for an "auto" request), but never past max_tokens. With
        n tokens left it emits at most n (accepted + 1), so drafts beyond n - 1 could only be thrown
        away. So no forward reaches position prompt + max_tokens - 1."""
        emitted = len(self.output_ids) if emitted is None else emitted
        k = self.params.num_speculative_tokens
        if self.params.auto_k:
            if auto_k is None:
                raise ValueError("num_speculative_tokens: 'auto' is chosen by the colocated engine (SpecEngine), "
                                 "not here; give an integer")
            k = auto_k
        return min(k, self.k_cap(emitted))

    def k_cap(self, emitted: int | None = None) -> int:
        """The most drafts max_tokens leaves a step any use for (see step_k)."""
        emitted = len(self.output_ids) if emitted is None else emitted
        return max(self.params.max_tokens - emitted - 1, 0)

    def append(self, new_ids: list[int], tokenizer, eos_ids: set[int], logprobs: list | None = None) -> None:
        """Append accepted tokens one by one, stopping at EOS, max_tokens or a stop string. ``logprobs``:
        one entry per new id, kept while its id is (a stop string's cut drops both)."""
        if self.params.stop and len(new_ids) > 1 and byte_tokens(tokenizer).value:
            # A byte token can turn its run's text into U+FFFD (see _render), so a stop string completed
            # by one of a step's tokens may be gone from the step's text: taken a token at a time, the
            # output is the one a step of one token gives, whatever k.
            for j, t in enumerate(new_ids):
                if not self.finished:
                    self._append([t], tokenizer, eos_ids, logprobs and logprobs[j : j + 1])
            return
        self._append(new_ids, tokenizer, eos_ids, logprobs)

    def _append(self, new_ids: list[int], tokenizer, eos_ids: set[int], logprobs: list | None = None) -> None:
        p = self.params
        start = len(self.output_ids)
        for t in new_ids:
            self.output_ids.append(t)
            if t in eos_ids and not p.ignore_eos:
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= p.max_tokens:
                self.finish_reason = "length"
                break
        if logprobs is not None:
            self.logprobs.extend(logprobs[: len(self.output_ids) - start])
        # EOS is kept in token_ids (as HF generate does) but never rendered as text.
        ids = self.output_ids[:-1] if self.finish_reason == "stop" else self.output_ids
        before, shown = self.text, self._rendered
        self.text = self._render(tokenizer, ids, start)
        if p.stop:
            self._stop_at_string(tokenizer, before, shown)

    def _stop_at_string(self, tokenizer, before: str, shown: int) -> None:
        """End at the first stop string to complete in the text: cut the text before it, and drop
        the tokens after the one that completed it. A step appends up to k+1 tokens at once, so
        without the token cut the token ids (and usage) would depend on k; with it they are what
        one token per step gives. Of two stops completing at once, the one starting first wins.
        ``shown``: output ids whose text the last step already had; a stop may end in any later one,
        including ids of earlier steps whose text was held back (they end inside a character)."""
        # Only text after what the last step already showed can complete a stop first seen now. The
        # text grows by appending, except that a full decode may turn a trailing U+FFFD into the
        # character it was the start of: search from the common prefix.
        stable = common_prefix_len(before, self.text)
        hits = [(at + len(s), at) for s in self.params.stop if (at := self.text.find(s, max(0, stable - len(s) + 1))) >= 0]
        if not hits:
            return
        end, at = min(hits)
        self.text, self.finish_reason = self.text[:at], "stop"
        for j in range(shown, len(self.output_ids)):  # the first new token whose text reaches the stop's end
            if len(_decode(tokenizer, self.output_ids[: j + 1], self.context(tokenizer)).rstrip("\ufffd")) >= end:
                del self.output_ids[j + 1 :], self.logprobs[j + 1 :]
                break

    def _render(self, tokenizer, ids: list[int], start: int) -> str:
        """The text of ``ids``. While running, only the new ids ``ids[start:]`` are decoded, by the
        tokenizers library's own incremental ``DecodeStream``: decoding all output ids every step cost
        O(length) per step (0.5 ms per row at 2,000 tokens on CPU). The stream holds back an incomplete
        UTF-8 tail that a full decode shows as U+FFFD; once finished, one full decode gives the final
        text exactly as ``_decode`` would. Tokenizers without a fast backend are decoded in full every
        step. The new ids go in one at a time: given a step's ids at once, the stream holds back all of
        their text while the last one ends inside a UTF-8 character, so a stop string before it was
        seen a step late, after the step's tokens past it were kept (token ids then depended on k).

        Also keeps ``_run_at`` and ``_fixed_chars`` (what ``delta`` may stream): a byte-fallback decoder
        decodes a run of byte tokens as a whole, one U+FFFD per byte where the run is not valid UTF-8,
        so a later byte can rewrite the text of the run's earlier ones ("é" of <0xC3><0xA9>, then <0xE6>
        and " a": "\ufffd\ufffd\ufffd a"). Text before the last run is fixed. The stream assumes text only
        grows: it raises on such a rewrite, or, where a Strip decoder dropped the run's leading spaces
        from its window, misses it and returns other text than a decode. So a request whose run stops
        being UTF-8 is decoded in full until a token ends the run, whose text is then fixed; a new stream
        takes over from there (decoded in full for the rest, a step cost O(length): 0.8 ms a row at 3,000
        tokens, 4 ms with a stop string; 0.03-0.04 ms so)."""
        bt = byte_tokens(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.finished or backend is None or self._full_decode or self._until_run_ends:
            text = self._decode_all(tokenizer, ids, start, bt)
            if self._until_run_ends and not self.finished and self._run_at == len(ids):
                # Prefilled with ids up to the run's end: its text (and any U+FFFD) is in every decode the
                # stream compares, so what it adds is the text of the ids after them.
                self._stream = DecodeStream(ids=ids[-DECODE_CONTEXT:], skip_special_tokens=True)
                self._until_run_ends, self._run_utf8 = False, None
            return text
        if self._stream is None:  # prefilled with the same context as _decode, for the same reason
            self._stream = DecodeStream(ids=self.context(tokenizer) or None, skip_special_tokens=True)
        pieces, chars = [], len(self.text)
        for i, t in enumerate(ids[start:], start):
            if bt.value and not self._run_still_utf8(t, bt):
                self._until_run_ends, self._stream = True, None
                return self._render(tokenizer, ids, start)
            try:
                piece = self._stream.step(backend, [t])  # None while t ends inside a character
            except Exception as e:
                if "Invalid prefix" not in str(e):
                    raise
                # A rewrite by a decoder not known above. Raised, it failed the engine step of every
                # request in the batch (vLLM #17448).
                self._full_decode, self._stream = True, None
                return self._decode_all(tokenizer, ids, start, bt)
            if piece is not None:
                pieces.append(piece)
                chars += len(piece)
                self._rendered = i + 1
            if bt.ends_run(t):  # with its own text out, all text so far is fixed
                self._run_at, self._fixed_chars = i + 1, chars if piece is not None else self._fixed_chars
        return self.text + "".join(pieces)

    def _run_still_utf8(self, t: int, bt: ByteTokens) -> bool:
        """Whether the output's last run of byte tokens, t included, can still decode as UTF-8: every byte
        fits, and a token ending the run leaves no character unfinished (its bytes are U+FFFD too).
        ``_run_utf8`` exists only while a run is open, so a token that is not a byte costs nothing."""
        if bt.skips(t):
            return True
        try:
            if t in bt.value:
                if self._run_utf8 is None:
                    self._run_utf8 = codecs.getincrementaldecoder("utf-8")()
                self._run_utf8.decode(bytes((bt.value[t],)))
            elif self._run_utf8 is not None:
                run, self._run_utf8 = self._run_utf8, None
                run.decode(b"", final=True)
        except UnicodeDecodeError:
            return False
        return True

    def _decode_all(self, tokenizer, ids: list[int], start: int, bt: ByteTokens) -> str:
        """``_render`` by one full decode; and where the output ends in a run of byte tokens, one more
        decode, of the ids before the run (only while running: a finished request's text is all streamed)."""
        text = _decode(tokenizer, ids, self.context(tokenizer))
        self._rendered = len(ids)
        self._run_at = next((i + 1 for i in range(len(ids) - 1, start - 1, -1) if bt.ends_run(ids[i])), self._run_at)
        if self._run_at >= len(ids) or self.finished:
            self._fixed_chars = len(text)
        else:
            head = _decode(tokenizer, ids[: self._run_at], self.context(tokenizer))
            self._fixed_chars = common_prefix_len(head, text)
        return text

    def delta(self) -> StreamDelta:
        """New text since the last delta. Holds back text that may still become a stop string or is an
        incomplete UTF-8 sequence, so a stream never shows what the final text will not contain; and
        the ids of such a sequence, which a stop string found once it completes may still cut (the
        ids streamed then always add up to the final ones, and the API counts usage from them)."""
        end = len(self.text)
        if not self.finished:
            if self.text.endswith("\ufffd"):
                end -= 1
            end = min(end, self._fixed_chars)  # not the last run of byte tokens (see _render)
            if self.params.stop:  # the longest hold any stop needs: a stop match to come begins in it or later
                self._stops = self._stops or StopScan(self.params.stop)
                end -= self._stops.hold(self.text, end)
        end = max(end, self._sent_chars)
        ids_end = max(len(self.output_ids) if self.finished else min(self._rendered, self._run_at), self._sent_ids)
        d = StreamDelta(
            self.request_id,
            self.text[self._sent_chars : end],
            self.output_ids[self._sent_ids : ids_end],
            self.finished,
            self.finish_reason,
            self.logprobs[self._sent_ids : ids_end] if self.params.logprobs is not None else None,
        )
        self._sent_chars, self._sent_ids = end, ids_end
        return d

    def completion(self) -> Completion:
        return Completion(
            self.request_id, self.prompt, self.text, list(self.output_ids), self.finish_reason,
            self.proposed, self.accepted, self.steps, list(self.logprobs) if self.params.logprobs is not None else None,
        )


def common_prefix_len(a: str, b: str) -> int:
    """len(os.path.commonprefix([a, b])), by binary search on C-speed comparisons: commonprefix walks
    the characters in Python (9 ms at 50k characters, on the loop every row waits on). The usual case,
    b growing a by appending, is one comparison."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # a[:lo] == b[:lo] holds
        mid = (lo + hi + 1) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _extend_failure(fail: array, stop: str, upto: int) -> None:
    """Extends fail (fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix) to
    ``upto`` entries. Built as far as a match can have reached, not whole: a stop's length is bounded
    only by the request body (16 stops of 36k characters at the default limits), the text by the output."""
    n = fail[-1]  # fail starts as [0]: a stop is never empty
    for i in range(len(fail), min(upto, len(stop))):
        while n and stop[i] != stop[n]:
            n = fail[n - 1]
        n += stop[i] == stop[n]
        fail.append(n)


class StopScan:
    """A request's stop strings as Knuth-Morris-Pratt automata, run over its text as it grows: after
    each character, the length of the longest prefix of each stop that the text up to there ends with.
    A step scans only its new characters. Testing each place a stop's first characters occur in the
    last len(stop) characters (what this replaced) was quadratic on repetitive output: 26 ms a step
    for one row with 16 stops like "a" * 16 + "Q" * 500 on 8,000 characters of "a", on the loop every row
    waits on (colocated) or the router's event loop (disaggregated). Memory and time follow the output,
    not the stops' length: each failure table is built only as far as a match has reached, and the
    states of only the last WINDOW..2*WINDOW characters are kept (a rewrite reaching further back, which
    a decoder does only at the text's last characters, rescans from the start)."""

    WINDOW = 4096

    def __init__(self, stops: list[str]):
        self.stops = list(dict.fromkeys(stops))  # a stop sent twice needs one automaton
        self.fails = [array("I", [0]) for _ in self.stops]
        self._reset()

    def _reset(self) -> None:
        self.states = [array("I", [0]) for _ in self.stops]  # per stop: its state after text[:base + j]
        self.base, self.seen = 0, ""

    def hold(self, text: str, end: int) -> int:
        """How many characters at the end of text[:end] may begin a stop string (the longest proper
        prefix of a stop that text[:end] ends with; 0 if none)."""
        keep = common_prefix_len(self.seen, text)
        if min(keep, end) < self.base:  # a rewrite (or a query) before the kept states: rare, rescan
            self._reset()
            keep = 0
        new = text[keep:]  # normally what this step appended; after a rewrite, from where it differs
        for stop, fail, st in zip(self.stops, self.fails, self.states):
            del st[keep - self.base + 1 :]
            n = st[-1]
            _extend_failure(fail, stop, n + len(new))  # no state can pass n + len(new)
            for c in new:
                if n == len(stop):  # a whole stop (the request ends there): go on from its longest border
                    n = fail[n - 1]
                while n and stop[n] != c:
                    n = fail[n - 1]
                n += stop[n] == c
                st.append(n)
        cut = min(len(self.states[0]) - self.WINDOW, end - self.base)  # keeps WINDOW states, and end's
        if len(self.states[0]) > 2 * self.WINDOW and cut > 0:  # every stop's states cover the same characters
            for st in self.states:
                del st[:cut]
            self.base += cut
        self.seen = text
        return max((n if (n := st[end - self.base]) < len(stop) else fail[n - 1])
                   for stop, fail, st in zip(self.stops, self.fails, self.states))
