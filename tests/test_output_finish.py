"""Request endings and what a stream shows before them: ignore_eos, an EOS id that is an ordinary
token, stop-prefix hold-back, the full-decode path's U+FFFD hold-back, and check_prompt's limits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from osd_serve.config import SamplingParams
from osd_serve.output import Completion, Request, check_prompt, eos_token_ids, fit_max_tokens

TEXT = "héllo wörld, naïve café: ∑ x² ≤ 日本語 🙂 — def f(x): return x * 2\n" * 2


def _stream(r: Request, steps, tokenizer, eos: set[int]) -> list[str]:
    """Appends each step's ids, returns the delta texts (one per step, until finished)."""
    out = []
    for ids in steps:
        r.append(ids, tokenizer, eos)
        out.append(r.delta().text)
        if r.finished:
            break
    return out


def test_ignore_eos_keeps_generating_past_eos_until_max_tokens(tok):
    """ignore_eos: an EOS id is an output token like any other (benchmarks force full lengths with it);
    the request ends at max_tokens, with finish reason "length", not "stop"."""
    eos = tok.eos_token_id
    r = Request("r", "", [3], SamplingParams(max_tokens=4, ignore_eos=True), None)
    r.append(tok.encode("a") + [eos] + tok.encode("b"), tok, {eos})
    assert not r.finished and r.output_ids == tok.encode("a") + [eos] + tok.encode("b")
    r.append(tok.encode("cd"), tok, {eos})
    assert r.finish_reason == "length" and len(r.output_ids) == 4 and r.text == "abc"


def test_an_eos_id_that_is_an_ordinary_token_ends_the_output_but_not_its_text(tok):
    """A generation_config's EOS need not be a special token (some models end on a newline token): it
    is kept in token_ids, as HF generate keeps it, but never shown in the text or the stream."""
    nl = tok.encode("\n")[0]
    r = Request("r", "", [3], SamplingParams(max_tokens=20), None)
    deltas = _stream(r, [tok.encode("ab"), tok.encode("c\nd")], tok, {nl})
    assert r.finish_reason == "stop" and r.output_ids == tok.encode("abc\n") and r.text == "abc"
    assert "".join(deltas) == "abc"


def test_a_stream_holds_back_a_possible_stop_string_and_releases_it_when_it_is_not_one(tok):
    """Text that may still become a stop string is not streamed: once the stop completes it is cut from
    the final text, which a stream that had sent it could not take back. Where it turns out not to be
    the stop, it is released. Either way the deltas add up to the final text."""
    r = Request("r", "", [3], SamplingParams(max_tokens=20, stop=["xyz"]), None)
    deltas = _stream(r, [tok.encode(c) for c in "abxyz"], tok, {tok.eos_token_id})
    assert deltas == ["a", "b", "", "", ""] and r.text == "ab" and r.finish_reason == "stop"
    r = Request("r", "", [3], SamplingParams(max_tokens=20, stop=["xyz"]), None)
    deltas = _stream(r, [tok.encode(c) for c in "abxyq"], tok, {tok.eos_token_id})
    assert deltas == ["a", "b", "", "", "xyq"] and not r.finished


def test_a_tokenizer_without_a_fast_backend_never_streams_a_half_character():
    """Without a fast backend the text is a full decode every step, which ends in U+FFFD while the last
    token ends inside a UTF-8 character: the delta holds that U+FFFD back, so what is streamed adds
    up to the final text and never shows a replacement character the final text does not have."""
    from tests.test_output import bpe as bpe_fixture

    fast = bpe_fixture.__wrapped__()

    class Slow:  # the decode of a fast tokenizer, without its backend_tokenizer
        eos_token_id = fast.eos_token_id

        def decode(self, *a, **kw):
            return fast.decode(*a, **kw)

    slow, ids = Slow(), fast.encode(TEXT)
    assert any(fast.decode(ids[: i + 1]).endswith("\ufffd") for i in range(len(ids)))  # characters split
    r = Request("r", "", [fast.encode("x")[0]], SamplingParams(max_tokens=len(ids)), None)
    deltas = _stream(r, [[t] for t in ids], slow, {fast.eos_token_id})
    assert r.finish_reason == "length" and r.text == TEXT
    assert "".join(deltas) == TEXT and not any("\ufffd" in d for d in deltas)


def test_check_prompt_limits_are_exact(tok):
    """prompt + max_tokens may fill max_model_len exactly, not one more; max_tokens alone must leave
    room for a prompt; unset max_tokens needs one position left and is then fitted to the rest."""
    v = len(tok)
    assert check_prompt(tok, v, 8, "abc", SamplingParams(max_tokens=5)).ids == tok.encode("abc")
    # the prompt fits alone: both are named, and how far max_tokens may go (it was "prompt is too long")
    with pytest.raises(ValueError, match=r"^prompt and max_tokens exceed the context: 3 prompt tokens \+ max_tokens 6 > "
                                         r"max_model_len 8; shorten the prompt or lower max_tokens \(to at most 5\)$"):
        check_prompt(tok, v, 8, "abc", SamplingParams(max_tokens=6))
    with pytest.raises(ValueError, match=r"^prompt is too long: 8 prompt tokens leave no room for output within max_model_len 8$"):
        check_prompt(tok, v, 8, "abcdefgh", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens 8 leaves no room for a prompt"):
        check_prompt(tok, v, 8, "a", SamplingParams(max_tokens=8))
    assert check_prompt(tok, v, 8, "a", SamplingParams(max_tokens=7)).text == "a"
    assert check_prompt(tok, v, 8, "abcdefg", SamplingParams(max_tokens=None)).text == "abcdefg"
    with pytest.raises(ValueError, match="leave no room for output"):
        check_prompt(tok, v, 8, "abcdefgh", SamplingParams(max_tokens=None))
    assert fit_max_tokens(SamplingParams(max_tokens=None), 3, 8).max_tokens == 5  # the rest of the context
    assert fit_max_tokens(SamplingParams(max_tokens=2), 3, 8).max_tokens == 2


def test_eos_ids_come_from_the_generation_config_list_else_the_tokenizer():
    """Llama-3-style configs list several EOS ids; every one ends a request."""
    tokenizer = SimpleNamespace(eos_token_id=9)
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 7])), tokenizer) == {5, 7}
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=4)), tokenizer) == {4}
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)), tokenizer) == {9}


def test_completion_acceptance_is_accepted_over_proposed():
    c = Completion("r", "p", "t", [1, 2, 3], "length", proposed=8, accepted=6, steps=2)
    assert c.acceptance == 0.75 and c.tokens_per_step == 1.5
    assert Completion("r", "p", "t", [], None).acceptance == 0.0


@pytest.mark.parametrize("case", ["invalid run, then more text", "valid bytes after the dropped id"])
def test_ids_past_the_tokenizer_do_not_end_a_byte_run(case):
    """A model's embedding may be padded past its tokenizer (Phi-3: 32064 rows, 32011 tokens) and can
    sample those ids; a decode drops them, as it drops specials. Taken as ending a byte run, the stream
    repeated text (A) or sent "x" that the final text had as U+FFFD (B), and the text depended on how many
    tokens a step accepted."""
    from osd_serve.output import _decode
    from tests.conftest import byte_fallback_tokenizer

    sp = byte_fallback_tokenizer(["▁The", "▁is", "a", "▁a", "."])
    a, dot = sp.convert_tokens_to_ids("▁a"), sp.convert_tokens_to_ids(".")
    byte = [sp.convert_tokens_to_ids(f"<0x{i:02X}>") for i in range(256)]
    x = len(sp) + 3  # an id the model has and the tokenizer lacks
    assert sp.decode([x]) == ""
    out = [a, byte[0xC3], byte[0xFF], x, a, a] if case.startswith("invalid") else \
        [a, byte[0xC3], byte[0xE6], byte[0x97], byte[0xA5], x, byte[0x78], dot, a]
    want = _decode(sp, out, [1, a])
    for max_tokens in (len(out), len(out) + 1):  # finished on the last token, and still running
        r = Request("r", "", [1, a], SamplingParams(max_tokens=max_tokens, ignore_eos=True), None)
        streamed = ""
        for t in out:  # one token a step: the case a whole step's acceptance hid
            r.append([t], sp, set())
            streamed += r.delta().text
        assert r.text == want and streamed == want


def test_an_eos_landing_exactly_on_max_tokens_is_a_stop(tok):
    """EOS is checked before max_tokens (as vLLM does): an EOS that is the max_tokens-th token ends the
    request as "stop" and its text stays out. With the checks swapped it ended as "length" with the
    EOS (a newline token here, as some models' generation_config has) rendered; no test saw it."""
    nl = tok.encode("\n")[0]
    ids = tok.encode("abc\n")
    r = Request("r", "", [3], SamplingParams(max_tokens=len(ids)), None)
    r.append(ids, tok, {nl})
    assert r.finish_reason == "stop" and r.output_ids == ids and r.text == "abc"
    r = Request("r", "", [3], SamplingParams(max_tokens=len(ids)), None)  # one token per step
    for t in ids:
        r.append([t], tok, {nl})
    assert r.finish_reason == "stop" and r.text == "abc"
