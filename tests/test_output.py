"""Request text: decoded incrementally while running, yet always what a full decode gives."""

from __future__ import annotations

import os
import random

import pytest

from osd_serve.config import SamplingParams
from osd_serve.output import Request

TEXT = "héllo wörld, naïve café: ∑ x² ≤ 日本語 🙂 — def f(x): return x * 2\n" * 4


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer (GPT-2/Llama-3 style) trained in code: multi-byte characters split
    across tokens, so a decode of a partial sequence ends in U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def _request(max_tokens: int, stop=()) -> Request:
    params = SamplingParams(max_tokens=max_tokens, stop=list(stop), ignore_eos=False)
    return Request("r", "", [0], params, None)


def test_incremental_text_equals_full_decode(bpe):
    rng = random.Random(0)
    eos = {bpe.eos_token_id}
    held_back = 0
    for trial in range(40):
        ids = bpe.encode(TEXT[rng.randrange(60):]) if trial % 2 else [rng.randrange(len(bpe)) for _ in range(90)]
        ids = [t for t in ids if t not in eos]
        r, pos, streamed = _request(max_tokens=rng.randint(5, len(ids))), 0, ""
        while not r.finished:
            assert pos < len(ids), "unfinished with every token appended: max_tokens was not applied"  # not a hang
            n = rng.randint(1, 6)  # accepted tokens per step
            r.append(ids[pos : pos + n], bpe, eos)
            pos += n
            full = bpe.decode(r.output_ids, skip_special_tokens=True)
            if r.finished:
                assert r.text == full
            else:  # the stream holds text back only while the full decode ends in an incomplete character
                assert r._stream is not None and full.startswith(r.text)
                assert full == r.text or full.endswith("\ufffd")
                held_back += len(full) > len(r.text)
            streamed += r.delta().text
        assert streamed == r.text
    assert held_back > 0  # multi-byte characters were split across steps


def test_stop_string_spanning_steps_and_eos(bpe):
    ids = bpe.encode(TEXT)
    text = bpe.decode(ids)
    stop = "café: ∑ x"
    assert len(bpe.encode(stop)) > 3  # so with a few tokens per step it arrives across steps
    kept = {}
    for per_step in (1, 2, 3, 7, len(ids)):  # 1: plain decoding; len(ids): the whole output in one step
        r = _request(max_tokens=len(ids), stop=[stop])
        for i in range(0, len(ids), per_step):
            r.append(ids[i : i + per_step], bpe, {bpe.eos_token_id})
            if r.finished:
                break
        assert r.finish_reason == "stop" and r.text == text[: text.find(stop)]
        kept[per_step] = r.output_ids
    # The token ids end at the token that completes the stop string, however many a step appended.
    assert all(k == kept[1] for k in kept.values()), {n: len(k) for n, k in kept.items()}
    assert stop in bpe.decode(kept[1]) and stop not in bpe.decode(kept[1][:-1])
    eos = bpe.eos_token_id
    r = _request(max_tokens=50)
    r.append(ids[:3] + [eos] + ids[3:6], bpe, {eos})
    assert r.finish_reason == "stop" and r.output_ids == ids[:3] + [eos] and r.text == bpe.decode(ids[:3])


def test_a_stop_string_followed_by_a_split_character_in_the_same_step_cuts_there(bpe):
    """A step whose last token ends inside a UTF-8 character: the incremental decode held back the text
    of the whole step, so a stop string earlier in it was found a step later, when the tokens after it
    could no longer be cut: the token ids then depended on how many tokens a step appended."""
    ids = bpe.encode(TEXT)
    for stop in ("h", "l", "w", "na", ": ", "x", "≤ ", "日", "2\n"):  # each followed, in TEXT, by text split across tokens
        kept = {}
        for per_step in range(1, 8):
            r, streamed = _request(max_tokens=len(ids), stop=[stop]), []
            for i in range(0, len(ids), per_step):
                r.append(ids[i : i + per_step], bpe, {bpe.eos_token_id})
                streamed += r.delta().token_ids
                if r.finished:
                    break
            assert r.finish_reason == "stop" and r.text == TEXT[: TEXT.find(stop)]
            assert streamed == r.output_ids  # no id streamed that the cut then took back (usage counts them)
            kept[per_step] = r.output_ids
        assert all(k == kept[1] for k in kept.values()), (stop, {n: len(k) for n, k in kept.items()})


def test_earliest_of_several_stop_strings_wins_within_one_step(bpe):
    ids = bpe.encode(TEXT)
    text = bpe.decode(ids)
    early, late = "wörld", "café"  # listed late-first; both arrive in one step after some streamed text
    cut = len(bpe.encode(TEXT[:3]))
    r = _request(max_tokens=len(ids), stop=[late, early])
    r.append(ids[:cut], bpe, {bpe.eos_token_id})
    assert not r.finished and 0 < len(r.text) < text.find(early)
    r.append(ids[cut:], bpe, {bpe.eos_token_id})
    assert r.finish_reason == "stop" and r.text == text[: text.find(early)]


def test_the_first_stop_string_to_complete_wins_whatever_the_list_order():
    from tests.conftest import char_tokenizer

    tok = char_tokenizer()
    ids = tok.encode("xxabcdyy")
    for stops, want in ((["cd", "bcd"], "xxa"), (["abcd", "bc"], "xxa"), (["abcd", "cdy"], "xx")):
        for order in (stops, stops[::-1]):
            for per_step in (1, len(ids)):
                r = Request("r", "", [3], SamplingParams(max_tokens=50, stop=order), None)
                for i in range(0, len(ids), per_step):
                    r.append(ids[i : i + per_step], tok, {1})
                    if r.finished:
                        break
                assert (r.finish_reason, r.text) == ("stop", want), (order, per_step)


def test_text_is_not_cleaned_up_so_a_stream_never_rewrites_what_it_sent():
    """Llama-3's tokenizer sets clean_up_tokenization_spaces, which turns " ." into "." once the "."
    arrives: a stream would already have sent the space. The text is the decode without it."""
    from tests.conftest import char_tokenizer

    tok = char_tokenizer()
    tok.clean_up_tokenization_spaces = True
    ids = tok.encode("Hello . Bye")
    assert tok.decode(ids) == "Hello. Bye"  # what the clean-up would give
    r, streamed = Request("r", "", [3], SamplingParams(max_tokens=len(ids)), None), ""
    for t in ids:
        r.append([t], tok, {1})
        streamed += r.delta().text
    assert r.finish_reason == "length" and r.text == streamed == "Hello . Bye"
    r = Request("r", "", [3], SamplingParams(max_tokens=len(ids), stop=["o ."]), None)
    for t in ids:
        r.append([t], tok, {1})
    assert (r.finish_reason, r.text) == ("stop", "Hell")


class _SlowTokenizer:
    """A tokenizer without a fast backend: its requests decode all output ids every step."""

    def __init__(self, tok):
        self.decode = tok.decode
        self.convert_tokens_to_ids, self.convert_ids_to_tokens = tok.convert_tokens_to_ids, tok.convert_ids_to_tokens
        self.all_special_ids, self.added_tokens_decoder = tok.all_special_ids, tok.added_tokens_decoder


def test_a_full_decode_finds_a_stop_string_after_a_character_split_across_tokens(bpe):
    ids = bpe.encode("ab 日本語 zz")
    assert bpe.decode(ids[:4]).endswith("\ufffd")  # the decode of a prefix ends mid-character
    r = Request("r", "", [0], SamplingParams(max_tokens=len(ids), stop=[" 日"]), None)
    for t in ids:
        r.append([t], _SlowTokenizer(bpe), {bpe.eos_token_id})
        if r.finished:
            break
    assert (r.finish_reason, r.text) == ("stop", "ab")
    assert " 日" in bpe.decode(r.output_ids) and " 日" not in bpe.decode(r.output_ids[:-1])


def test_the_first_token_keeps_its_leading_space_with_a_sentencepiece_decoder():
    """Llama-2/Mistral-style decoders strip the start of a text: the output decoded alone lost its first
    space ("Paris." for "The capital is" + "▁Paris."), in the stream and the final text, and a stop
    string starting with that space could never match."""
    from tests.conftest import byte_fallback_tokenizer

    sp = byte_fallback_tokenizer(["▁The", "▁capital", "▁is", "▁Paris", ".", "▁"])
    the, capital, is_, paris, dot = sp.convert_tokens_to_ids(["▁The", "▁capital", "▁is", "▁Paris", "."])
    prompt = [1, the, capital, is_]  # <s> The capital is
    assert sp.decode(prompt + [paris, dot], skip_special_tokens=True) == "The capital is Paris."
    for stop, want in (((), " Paris."), ((" Paris",), "")):
        r = Request("r", "", prompt, SamplingParams(max_tokens=8, stop=list(stop)), None)
        streamed = ""
        for t in (paris, dot, 2):
            if not r.finished:
                r.append([t], sp, {2})
                streamed += r.delta().text
        assert r.text == streamed == want and r.finish_reason == "stop"


def test_output_decoded_after_the_prompt_streams_what_it_returns_wherever_the_prompt_ends(bpe):
    """The output is decoded after the prompt's last ids; a prompt of token ids may end inside a UTF-8
    character, and a stream prefilled with half of one disagreed with the final text ('日本語 ' streamed,
    '本語 🙂' returned). There the output is decoded alone, as before."""
    ids = bpe.encode("naïve 日本語 🙂 — x² ≤ café")
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        r, streamed = Request("r", "", prompt, SamplingParams(max_tokens=len(out)), None), ""
        for t in out:
            r.append([t], bpe, set())
            streamed += r.delta().text
        assert streamed == r.text
        head = bpe.decode(prompt)
        if not head.endswith("\ufffd"):  # the prompt ends between characters: the output is the rest
            assert r.text == bpe.decode(prompt + out)[len(head):]


@pytest.mark.parametrize("window", [4, 4096])
def test_stop_hold_back_is_the_longest_stop_prefix_the_text_ends_with(monkeypatch, window):
    """The hold-back, scanned incrementally as the text grows (and from where it differs when a full
    decode rewrote its end), against trying every prefix length of every stop, on texts made of pieces
    of the stops (so partial matches are common). window 4: states dropped, and rescans past them."""
    from osd_serve.output import StopScan

    monkeypatch.setattr(StopScan, "WINDOW", window)
    rng = random.Random(0)
    for _ in range(5000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 40))) for _ in range(rng.randrange(1, 4))]
        scan, text = StopScan(stops), ""
        for _ in range(rng.randrange(1, 6)):
            if text and rng.random() < 0.3:  # a rewrite of the end
                text = text[: rng.randrange(0, len(text) + 1)]
            stop = rng.choice(stops)
            text += "".join(stop[: rng.randrange(0, len(stop) + 1)] if rng.random() < 0.5 else rng.choice("ab") for _ in range(3))
            end = rng.randrange(0, len(text) + 1)
            want = max(next((n for n in range(min(len(s) - 1, end), 0, -1) if text[:end].endswith(s[:n])), 0) for s in stops)
            assert scan.hold(text, end) == want, (text, end, stops)


def test_stop_hold_back_work_follows_the_output_not_the_stops_length():
    """Each stop's failure table was built whole at the first delta, in Python ints: 16 stops of 36k
    characters (a body under the default limit) took 236 ms on the loop and 20 MiB per request."""
    from osd_serve.output import StopScan, common_prefix_len

    reads = [0]

    class Counted(str):
        def __getitem__(self, i):
            reads[0] += 1
            return str.__getitem__(self, i)

    scan = StopScan([Counted(f"x{i:02d}" + "a" * 36_000) for i in range(16)])
    assert scan.hold("hello x0", 8) == 2 and reads[0] < 16 * 50, reads[0]
    rng = random.Random(1)
    for _ in range(2000):  # the rewrite's common prefix, by binary search, against os.path.commonprefix
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(30)))
        b = a[: rng.randrange(len(a) + 1)] + "".join(rng.choice("ab") for _ in range(rng.randrange(30)))
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == len(os.path.commonprefix([a, b]))


def test_stop_hold_back_does_work_linear_in_the_new_text():
    """Repetitive output against stops that match it for 16 characters and then never: the search this
    replaced tested every such place (O(len(stop)^2) a step, 26 ms a step for one row with 16 stops).
    Counted in character reads of the stops (failure tables included), not timed: a few per new character and stop."""
    from osd_serve.output import StopScan

    reads = [0]

    class Counted(str):
        def __getitem__(self, i):
            reads[0] += 1
            return str.__getitem__(self, i)

    stops = [Counted("a" * 16 + "Q" * 500 + str(i)) for i in range(16)]
    scan, text = StopScan(stops), ""
    reads[0] = 0
    for _ in range(1000):
        text += "aaaa"  # a step's new text
        assert scan.hold(text, len(text)) == min(len(text), 16)
    assert reads[0] <= 4 * len(text) * len(stops), reads[0]  # a rescan of the text each step: ~500x this


# sp_bytes: a byte-fallback tokenizer, its word ids, and its byte ids (byte[b] is the id of <0xbb>)
_WORDS = ["▁The", "▁is", "a", "▁a", "."]


@pytest.fixture(scope="module")
def sp_bytes():
    from tests.conftest import byte_fallback_tokenizer

    sp = byte_fallback_tokenizer(_WORDS)
    return sp, [sp.convert_tokens_to_ids(w) for w in _WORDS], [sp.convert_tokens_to_ids(f"<0x{i:02X}>") for i in range(256)]


def _words_and_bytes(rng, n: int, word_ids, byte, p_word: float = 0.35, chars: str = "éü日本語🙂xΣ",
                     specials=()) -> list[int]:
    """At least n ids: words; characters as their UTF-8 bytes; one in ten a stray byte (a lone first
    byte, a lone continuation byte or one that is never UTF-8), which makes its run invalid; and, if
    given, one in twenty a special id, which a decode skips (so a run of bytes goes on across it)."""
    ids = []
    while len(ids) < n:
        u = rng.random()
        if u < p_word:
            ids.append(rng.choice(word_ids))
        elif u < 0.9:
            ids += [byte[b] for b in rng.choice(chars).encode()]
        elif specials and u < 0.95:
            ids.append(rng.choice(specials))
        else:
            ids.append(byte[rng.choice([0xC3, 0xE6, 0xF0, 0x97, 0xA9, 0xFF])])
    return ids


def test_a_stream_never_shows_text_a_byte_fallback_decoder_rewrites_later(sp_bytes):
    """A byte-fallback decoder (Llama-2, Mistral, Gemma) decodes a run of byte tokens as a whole, one
    U+FFFD per byte where the run is not valid UTF-8: a later byte can rewrite the text of earlier ones
    ("é" of <0xC3><0xA9>, then <0xE6> and " a": "\ufffd\ufffd\ufffd a"), and the stream had already sent
    "é". Random outputs of mostly valid characters split into bytes, stray bytes, skipped special ids
    and words, in random steps, with and without stop strings, decoded incrementally or (no fast
    backend) in full:
    - what streams adds up to the final text and ids; once a word ends a run of bytes, all is out;
    - the text is the tokenizer's decode, cut before the first stop string in it (a stop ending a
      step's text kept the DecodeStream's text, which a Strip decoder's dropped spaces made wrong);
    - ids, text and finish reason are those of one token a step (a stop that a later byte of its
      step rewrote was never seen)."""
    sp, word_ids, byte = sp_bytes
    rng = random.Random(0)
    rewritten = resumed = 0
    for trial in range(300):
        ids = _words_and_bytes(rng, 40, word_ids, byte, chars="éü日本語🙂xΣ ", specials=[0, 1, 2])
        stop = [rng.choice(["a.", "日本", " is", "\ufffd a", "é"])] if trial % 3 == 0 else []
        tk = _SlowTokenizer(sp) if trial % 4 == 1 else sp
        params = SamplingParams(max_tokens=len(ids), stop=stop, ignore_eos=True)
        r, one = Request("r", "", [1], params, None), Request("r", "", [1], params, None)
        pos, streamed, streamed_ids = 0, "", []
        while not r.finished:
            assert pos < len(ids), "unfinished with every token appended: max_tokens was not applied"  # not a hang
            n = rng.randint(1, 6)  # accepted tokens per step
            r.append(ids[pos : pos + n], tk, set())
            pos += n
            d = r.delta()
            streamed, streamed_ids = streamed + d.text, streamed_ids + d.token_ids
            if not r.finished and not stop and r.output_ids[-1] in word_ids:
                assert streamed == r.text  # a word ended the run: nothing is held back
                # and a stream decodes again, after a run that was not UTF-8 too (it was a full decode a step)
                assert r._stream is not None or tk is not sp
        assert streamed == r.text and streamed_ids == r.output_ids
        full = sp.decode([1] + r.output_ids, skip_special_tokens=True)
        if r.finish_reason == "stop":
            assert full.startswith(r.text) and any(full[len(r.text) :].startswith(s) for s in stop)
            assert not any(s in r.text for s in stop)
        else:
            assert r.text == full and r.output_ids == ids
        for t in ids:
            if not one.finished:
                one.append([t], tk, set())
        assert (one.output_ids, one.text, one.finish_reason) == (r.output_ids, r.text, r.finish_reason)
        texts = [sp.decode([1] + r.output_ids[:j], skip_special_tokens=True).rstrip("\ufffd") for j in range(len(r.output_ids))]
        rewritten += not all(full.startswith(t) for t in texts)
        resumed += r._stream is not None and "\ufffd" in r.text
    assert rewritten > 50 and resumed > 10  # runs a later byte made invalid, after text of theirs was decoded


def test_output_bytes_never_turn_the_prompts_last_bytes_into_replacement_characters(sp_bytes):
    """The output is decoded after the prompt's last ids, and a byte-fallback decoder decodes a run of
    byte tokens as a whole: a prompt ending in an emoji's 4 valid bytes and an output of bytes that are
    not valid UTF-8 gave 4 U+FFFD more than the output's own (6 characters for 2 tokens). Random
    prompts and outputs of words and bytes: the output's text has the U+FFFD its own ids decode to, and
    is what it decodes to after the prompt's last word (which keeps its first token's space)."""
    sp, word_ids, byte = sp_bytes
    rng = random.Random(1)
    kw = {"skip_special_tokens": True}

    def some(n):
        return _words_and_bytes(rng, n, word_ids, byte, p_word=0.3, chars="é日🙂")

    for _ in range(300):
        prompt, out = [1, rng.choice(word_ids)] + some(rng.randrange(1, 8)), some(rng.randrange(1, 6))
        tk = _SlowTokenizer(sp) if rng.random() < 0.25 else sp
        r, streamed = Request("r", "", prompt, SamplingParams(max_tokens=len(out), ignore_eos=True), None), ""
        for t in out:
            r.append([t], tk, set())
            streamed += r.delta().text
        assert streamed == r.text
        assert r.text.count("\ufffd") == sp.decode(out, **kw).count("\ufffd")
        last_word = max(i for i, t in enumerate(prompt) if t not in byte)
        head = sp.decode(prompt[: last_word + 1], **kw)
        assert r.text == sp.decode(prompt[: last_word + 1] + out, **kw)[len(head) :]


def test_a_special_token_that_only_the_added_tokens_mark_is_inside_a_byte_run(sp_bytes):
    """Added tokens marked special (<unused0>, ChatML's <|im_start|>) are skipped by a decode, but not in
    the special-tokens map: taken as ending a byte run, the run's "é" was streamed and then became
    U+FFFD with the next byte."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import byte_fallback_tokenizer

    byte = sp_bytes[2]
    backend = byte_fallback_tokenizer(_WORDS).backend_tokenizer
    backend.add_special_tokens([AddedToken("<unused0>", special=True)])
    sp = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", bos_token="<s>", unk_token="<unk>")
    unused, a = sp.convert_tokens_to_ids("<unused0>"), sp.convert_tokens_to_ids("▁a")
    assert unused not in sp.all_special_ids
    for tk in (sp, _SlowTokenizer(sp)):
        r, streamed = Request("r", "", [1, a], SamplingParams(max_tokens=99, ignore_eos=True), None), ""
        for step in ([a, byte[0xFF], a], [byte[0xC3], byte[0xA9], unused], [byte[0xFF], a]):
            r.append(step, tk, set())
            streamed += r.delta().text
        assert streamed == r.text == " a\ufffd a\ufffd\ufffd\ufffd a"


def test_a_prompt_of_only_byte_tokens_keeps_the_outputs_first_space(sp_bytes):
    """The output is decoded after the prompt's last word, which a prompt of token ids that are all bytes
    lacks: decoded alone, a Strip decoder dropped its first space ("a a" for " a a")."""
    sp, _, byte = sp_bytes
    a = sp.convert_tokens_to_ids("▁a")
    for prompt in ([1, byte[0xC3], byte[0xA9], byte[0x3A]], [byte[0x3A]]):
        r = Request("r", "", prompt, SamplingParams(max_tokens=2, ignore_eos=True), None)
        r.append([a, a], sp, set())
        assert r.text == sp.decode(prompt + [a, a], skip_special_tokens=True)[len(sp.decode(prompt, skip_special_tokens=True)) :] == " a a"
