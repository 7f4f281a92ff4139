"""Request text: decoded incrementally while running, yet always what a full decode gives."""

from __future__ import annotations

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
    for per_step in (1, 2, 3):
        r = _request(max_tokens=len(ids), stop=[stop])
        for i in range(0, len(ids), per_step):
            r.append(ids[i : i + per_step], bpe, {bpe.eos_token_id})
            if r.finished:
                break
        assert r.finish_reason == "stop" and r.text == text[: text.find(stop)]
    eos = bpe.eos_token_id
    r = _request(max_tokens=50)
    r.append(ids[:3] + [eos] + ids[3:6], bpe, {eos})
    assert r.finish_reason == "stop" and r.output_ids == ids[:3] + [eos] and r.text == bpe.decode(ids[:3])


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
