"""logprobs: each generated token's logprob and its likeliest alternatives, which must be the target's own
(the log-softmax of a plain forward of the target over prompt + output), whatever k, batch or sampling."""

from __future__ import annotations

import json

import pytest
import torch

from osd_serve.config import SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.logprobs import TokenLogprob, api_logprobs, render, step_logprobs
from tests.conftest import byte_fallback_tokenizer, char_tokenizer, llama, perturbed

PROMPTS = ["def f(x):", "select a", "x = [1, 2", "import os, sys\nprint(", "a"]


@torch.inference_mode()
def _target_logprobs(target, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """[n_out, V]: the target's log-softmax at the position that chose each output token."""
    ids = torch.tensor([prompt_ids + out_ids])
    logits = target(ids).logits[0, len(prompt_ids) - 1 : -1]  # [n_out, V]
    return logits.float().log_softmax(-1)


def _check(target, prompt_ids: list[list[int]], outputs: list[tuple[list[int], list]], n: int):
    """outputs: (generated ids, their TokenLogprobs) per prompt."""
    for p, (ids, lps) in zip(prompt_ids, outputs):
        assert lps is not None and len(lps) == len(ids) > 0
        want = _target_logprobs(target, p, ids)  # [n_out, V]
        got = torch.tensor([e.logprob for e in lps])
        chosen = want.gather(1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(got, chosen, atol=2e-4, rtol=0)
        for e, row in zip(lps, want):
            assert len(e.top) == n
            top_v, _ = row.topk(n)
            torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top_v, atol=2e-4, rtol=0)
            # each alternative's own logprob (ids may swap on an exact tie, values may not)
            torch.testing.assert_close(torch.tensor([v for _, v in e.top]), row[[i for i, _ in e.top]], atol=2e-4, rtol=0)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_targets_own(pair, tok, k, temperature):
    """Batched, padded prompts, greedy and seeded sampling: every logprob is the target's raw one at the
    position that chose the token (not the processed distribution a sampled row drew from, not a draft's)."""
    _, target, draft = pair
    eng = SpecEngine(target, draft, tok)
    params = [SamplingParams(max_tokens=12, temperature=temperature, top_k=5 if temperature else 0, seed=i,
                             num_speculative_tokens=k, logprobs=3) for i in range(len(PROMPTS))]
    done = eng.generate(PROMPTS, params)
    _check(target, [tok.encode(p) for p in PROMPTS], [(c.token_ids, c.logprobs) for c in done], 3)
    if k:  # the drafts did get accepted: logprobs came from verify forwards emitting several tokens
        assert sum(c.accepted for c in done) > 0


def test_logprobs_stay_aligned_through_stop_strings_and_streaming(tok):
    """A stop string cuts tokens after the one completing it, a step appends up to k+1 tokens, and a stream
    holds back ids: every delta's logprobs are its own ids', and they add up to the completion's."""
    target = llama(len(tok), seed=5)
    eng = SpecEngine(target, perturbed(target, 0.01), tok)
    base = SamplingParams(max_tokens=16, num_speculative_tokens=4, logprobs=1)
    free = eng.generate(PROMPTS[:2], base)
    assert all(len(c.text) >= 7 for c in free)
    stops = [c.text[5:7] for c in free]  # two characters inside each output: the cut lands mid-step
    params = [SamplingParams(max_tokens=16, num_speculative_tokens=4, logprobs=1, stop=[s]) for s in stops]
    ids, lps, ends = {}, {}, {}
    for d in eng.stream(PROMPTS[:2], params):
        assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
        ids.setdefault(d.request_id, []).extend(d.token_ids)
        lps.setdefault(d.request_id, []).extend(d.logprobs)
        ends[d.request_id] = d.finish_reason
    assert list(ends.values()) == ["stop", "stop"]
    for c in eng.generate(PROMPTS[:2], params):  # the whole completion's: the cut dropped the cut tokens' entries too
        assert c.finish_reason == "stop" and len(c.logprobs) == len(c.token_ids)
    for (rid, got), c in zip(ids.items(), free):
        assert len(got) < len(c.token_ids) and got == c.token_ids[: len(got)]  # cut at the completing token
        # the same numbers up to float sums (another step layout): ids exactly, values within 1e-5
        assert [[i for i, _ in e.top] for e in lps[rid]] == [[i for i, _ in e.top] for e in c.logprobs[: len(got)]]
        torch.testing.assert_close(torch.tensor([e.logprob for e in lps[rid]]),
                                   torch.tensor([e.logprob for e in c.logprobs[: len(got)]]), atol=1e-5, rtol=0)


def test_byte_tokens_taken_one_at_a_time_keep_their_logprobs():
    """A byte-fallback tokenizer with stop strings appends a step's tokens one at a time (output.py): each
    keeps its own logprob, and a byte token's bytes are the byte it stands for."""
    tok = byte_fallback_tokenizer()
    target = llama(len(tok), seed=2)
    eng = SpecEngine(target, perturbed(target, 0.01), tok)
    prompt = tok.decode(tok.encode("The é a"), skip_special_tokens=True)
    [c] = eng.generate([prompt], SamplingParams(max_tokens=10, num_speculative_tokens=4, logprobs=2, stop=["\x00zz"]))
    _check(target, [tok.encode(prompt)], [(c.token_ids, c.logprobs)], 2)
    assert any(3 <= t < 259 for t in c.token_ids)  # the random target speaks mostly bytes
    rendered = render(tok, c.token_ids, c.logprobs)
    assert [e["logprob"] for e in rendered] == [e.logprob for e in c.logprobs]
    for t, e in zip(c.token_ids, rendered):
        if 3 <= t < 259:  # <0x00>..<0xFF>
            assert e["bytes"] == [t - 3]
        else:
            assert e["bytes"] == list(e["token"].encode())


def test_no_logprobs_unless_asked(tok):
    target = llama(len(tok), seed=1)
    eng = SpecEngine(target, perturbed(target, 0.01), tok)
    [c] = eng.generate(["x"], SamplingParams(max_tokens=4))
    assert c.logprobs is None
    assert all(d.logprobs is None for d in eng.stream(["x"], SamplingParams(max_tokens=4)))


def test_step_logprobs_rows_and_counts():
    """Rows not asking get None; n 0 gives the token's own only; n past the vocabulary is cut to it."""
    logits = torch.randn(3, 4, 6)  # [B, k+1, V]
    tokens = torch.tensor([[1, 2, -1, -1], [3, -1, -1, -1], [0, 5, 4, 2]])
    out = step_logprobs(logits, tokens, [1, 0, 3], [0, None, 9])
    assert out[1] is None and len(out[0]) == 2 and len(out[2]) == 4
    lp = logits.log_softmax(-1)
    assert out[0][1] == TokenLogprob(pytest.approx(lp[0, 1, 2].item()), [])
    assert [i for i, _ in out[2][3].top] == lp[2, 3].argsort(descending=True).tolist()


def test_api_shapes_and_floor(tok):
    entries = render(tok, [tok.convert_tokens_to_ids("a"), 1], [TokenLogprob(-0.5, [(4, -0.25)]),
                                                                 TokenLogprob(-1.0, [(1, float("-inf"))])])
    chat = api_logprobs(entries, chat=True)
    assert chat["refusal"] is None and chat["content"][0]["token"] == "a" and chat["content"][0]["bytes"] == [97]
    assert chat["content"][1]["top_logprobs"][0]["logprob"] == -9999.0  # JSON has no -inf
    legacy = api_logprobs(entries, chat=False, offset=7)
    assert legacy["tokens"] == ["a", "<eos>"] and legacy["token_logprobs"] == [-0.5, -1.0]
    assert legacy["text_offset"] == [7, 8]
    assert legacy["top_logprobs"][0] == {"b": -0.25, "a": -0.5}  # the n likeliest and the chosen token
    assert api_logprobs(None, chat=True) is None


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_disaggregated_verifier_returns_the_targets_logprobs(pair, tok, temperature):
    """DraftWorkers and TargetVerifiers with sequences moving between them (cache misses recomputed): the
    Verdicts carry the same logprobs, from the Verifier's forward, as the colocated engine's."""
    from tests.test_disagg import _serve

    _, target, draft = pair
    prompts = [tok.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=10, temperature=temperature, seed=i, num_speculative_tokens=3, logprobs=2)
              for i in range(len(prompts))]
    reqs, _, _, verdicts = _serve(target, draft, tok, prompts, params)
    _check(target, prompts, [(r.output_ids, r.logprobs) for r in reqs], 2)
    assert any(v.recomputed for v in verdicts) and sum(r.accepted for r in reqs) > 0


def test_an_overflowed_logit_is_all_the_mass_not_nan():
    """A float16 overflow to +inf holds the row's mass for the sampler (sampling.overflow_holds_all): its
    logprob is 0 and the others floor out; log_softmax made the whole row NaN, which JSON cannot carry."""
    logits = torch.zeros(1, 1, 8)
    logits[0, 0, 5] = float("inf")
    [[e]] = step_logprobs(logits, torch.tensor([[5]]), [0], [2])
    assert e.logprob == 0.0 and e.top[0] == (5, 0.0) and e.top[1][1] == float("-inf")
    [out] = render(char_tokenizer(), [5], [e])
    assert out["logprob"] == 0.0 and out["top_logprobs"][1]["logprob"] == -9999.0
    json.dumps(out, allow_nan=False)


def test_token_texts_keep_the_space_a_sentencepiece_decoder_strips():
    """Decoded alone, "▁is" is "is"; in the output it reads " is": the tokens add up to the text, and so do
    the completions' text_offsets."""
    tok = byte_fallback_tokenizer()
    ids = tok.convert_tokens_to_ids(["▁The", "▁is", "▁a"])
    legacy = api_logprobs(render(tok, ids, [TokenLogprob(-0.1, [])] * 3), chat=False)
    assert legacy["tokens"] == [" The", " is", " a"] and legacy["text_offset"] == [0, 4, 7]


def test_a_character_split_over_byte_level_tokens_keeps_its_bytes():
    """Byte-level BPE (GPT-2, Llama-3, Qwen): "é" as two one-byte tokens shows U+FFFD twice as text; the
    bytes are the token's own, so a client rebuilds the character (OpenAI's reason for the field)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    ids = tok.encode("é a")
    out = render(tok, ids, [TokenLogprob(-0.1, [])] * len(ids))
    assert bytes(sum((e["bytes"] for e in out), [])).decode() == "é a"
    assert [e["token"] for e in out][2:] == [" ", "a"]


def test_entries_short_of_the_ids_are_an_error_not_a_short_list(tok):
    """A replica of a release before logprobs answers with none: the request fails, never silently short."""
    with pytest.raises(RuntimeError, match="1 entries for 2 tokens"):
        render(tok, [3, 4], [TokenLogprob(-0.1, [])])


def test_the_token_text_memo_lets_its_tokenizer_go():
    """The memo is keyed weakly by tokenizer; a value holding its tokenizer kept every one alive for good."""
    import gc
    import weakref

    tok = char_tokenizer()
    render(tok, [3], [TokenLogprob(-0.1, [(4, -0.2)])])
    ref = weakref.ref(tok)
    del tok
    gc.collect()
    assert ref() is None
