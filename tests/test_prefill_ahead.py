"""Prompts prefilled ahead (SpecEngine._prefill): an admission prefills up to a batch's worth of the queue
in one forward; those beyond the free slots stay queued with their caches and join as slots free, without
a forward of their own. Output stays the target's own decoding; aborts, resets and draft swaps drop them."""

from __future__ import annotations

import random

import pytest

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from tests.conftest import llama, perturbed
from tests.test_engine import _hf_greedy


def _watch(eng):
    """Per step: (prompts each _prefill call took, rows running, prompts held ahead)."""
    calls, seen = [], []
    prefill, step = eng._prefill, eng._step

    def counting_prefill(new, room):
        calls.append(len(new))
        return prefill(new, room)

    def watching_step():
        out = step()
        seen.append((len(eng.running), len(eng._ahead)))
        return out

    eng._prefill, eng._step = counting_prefill, watching_step
    return calls, seen


@pytest.mark.parametrize("k", [0, 3])
def test_prompts_held_ahead_join_as_slots_free_and_output_is_the_targets(pair, tok, k):
    """24 prompts of 1-30 tokens with 3-14 max_tokens each at batch 4: rows free at different steps,
    one or two at a time. Every admission after the first prefills a batch's worth, so 20 prompts
    take few forwards, the batch never passes 4 rows, and every output is the target's greedy one."""
    arch, target, draft = pair
    rng = random.Random(2)
    prompts = [[rng.randrange(3, target.config.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(3, 14), num_speculative_tokens=k, ignore_eos=True) for _ in prompts]
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4, prefill_chunk_tokens=None))
    calls, seen = _watch(eng)
    outs = eng.generate(prompts, params)
    refs = [_hf_greedy(target, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in outs] == refs
    assert sum(calls) == 24 and len(calls) <= 7  # one a freed slot would be ~20 calls
    assert max(a for _, a in seen) >= 2 and max(r for r, _ in seen) == 4
    assert not eng._ahead and not eng.has_unfinished()


def _held(tok, draft_noise: float = 0.015):
    """An engine at batch 4 whose first row ends after 2 tokens: the next admission has one free slot
    and prefills 4 prompts, so 3 wait held."""
    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, draft_noise), tok, EngineConfig(max_batch_size=4))
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]
    params = [SamplingParams(max_tokens=2 if i == 0 else 12, num_speculative_tokens=2, ignore_eos=True) for i in range(8)]
    reqs = eng.submit(prompts, params)
    for _ in range(10):
        if eng._ahead:
            break
        eng.step()
    assert len(eng._ahead) == 3 and len(eng.running) == 4 and len(eng.waiting) == 3
    return target, eng, prompts, reqs


def test_an_aborted_held_prompt_leaves_with_its_cache(tok):
    target, eng, prompts, reqs = _held(tok)
    held = eng._ahead[1][0]
    eng.abort(held.request_id)
    assert [r for r, _, _ in eng._ahead] == [a for a in eng.waiting] and held not in eng.waiting
    assert eng.finished["abort"] == 1
    while eng.has_unfinished():
        eng.step()
    for p, r in zip(prompts, reqs):
        if r is not held:
            assert r.output_ids == _hf_greedy(target, p, r.params.max_tokens)
    assert held.output_ids == [] and held.finish_reason == "abort"


def test_a_reset_drops_the_held_prompts(tok):
    target, eng, _, _ = _held(tok)
    eng.reset()
    assert not eng._ahead and not eng.has_unfinished()
    prompt = list(range(10, 30))
    assert eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids == _hf_greedy(target, prompt, 6)


def test_a_draft_swap_prefills_the_held_prompts_again(tok):
    """The draft starts as noise and is swapped for the target's own weights while 3 prompts are held:
    their draft caches held the noise's keys, so kept they would reject drafts; prefilled again, every
    draft token of theirs is accepted."""
    target, eng, prompts, reqs = _held(tok, draft_noise=0.5)
    held = [r for r, _, _ in eng._ahead]
    eng.swap_draft({n: t.clone() for n, t in target.state_dict().items()}, 1)
    eng.step()
    assert not eng._ahead
    while eng.has_unfinished():
        eng.step()
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _hf_greedy(target, p, r.params.max_tokens)
    for r in held:
        assert r.accepted == r.proposed > 0


def test_prefill_ahead_off_prefills_only_the_free_slots(tok):
    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=4, prefill_ahead=False))
    calls, seen = _watch(eng)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]
    params = [SamplingParams(max_tokens=2 + i, num_speculative_tokens=2, ignore_eos=True) for i in range(8)]
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [_hf_greedy(target, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert max(a for _, a in seen) == 0 and calls[0] == 4 and len(calls) > 2
    with pytest.raises(ValueError, match="prefill_ahead must be true or false"):
        EngineConfig(prefill_ahead=1)
