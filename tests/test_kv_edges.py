"""Edge cases of the disaggregated workers' state (osd_serve/disagg.py: SeqCaches over osd_serve/kv.py
BatchKV, DraftWorker.swap) after failed, duplicated or refused calls: every verdict must still be the
target's own greedy choice, and a refused swap must leave the draft as it was."""

from __future__ import annotations

import pytest
import torch

from osd_serve.disagg import DraftWorker, Sampling, TargetVerifier, VerifyItem
from tests.conftest import llama, perturbed
from tests.test_engine import _hf_greedy, _prompts


@pytest.fixture(scope="module")
def target(tok):
    return llama(len(tok), seed=3)


def _verify(ver: TargetVerifier, items: list[tuple[str, list[int], list[int]]]) -> list[list[int]]:
    verdicts, _ = ver.verify([VerifyItem(sid, h, d, None, Sampling()) for sid, h, d in items])
    return [v.tokens for v in verdicts]


def test_a_call_after_a_failed_one_gets_the_targets_verdict(target, monkeypatch):
    """A late call (an older history) rolled the row back, then its forward raised; the row was cut
    back to that prefix but the tokens it was recorded to hold were not, so the next call fed from past
    the row's end and got a verdict that was not the target's."""
    vocab = target.config.vocab_size
    prompt = _prompts(vocab, n=1, seed=8)[0] * 2
    ref = _hf_greedy(target, prompt, 8)  # [8]
    ver = TargetVerifier(target, vocab)
    assert _verify(ver, [("A", prompt, ref[:3])]) == [ref[:4]]

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as m:
        m.setattr(target, "forward", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            _verify(ver, [("A", prompt[:4], [])])
    assert _verify(ver, [("A", prompt + ref[:4], ref[4:7])]) == [ref[4:8]]


def test_a_sequence_twice_in_one_batch_gets_each_historys_verdict(target):
    """One id at two places of a batch (a duplicated or retried request): tokens[id] described the last
    place's row, and when the next batch had the same ids the first place's row, holding another
    history, was taken for it (a token the target would not have chosen)."""
    vocab = target.config.vocab_size
    pa, pb = _prompts(vocab, n=2, seed=6)
    ha, hb = [5, 9, 12] + pa, [5, 9, 12] + pb  # a shared prefix, then different
    ra, rb = _hf_greedy(target, ha, 9), _hf_greedy(target, hb, 9)  # [9] each
    ver = TargetVerifier(target, vocab)
    assert _verify(ver, [("A", ha, ra[:2]), ("A", hb, rb[:2])]) == [ra[:3], rb[:3]]
    # the same ids again (no re-split of the batch), the histories at the other places
    assert _verify(ver, [("A", hb + rb[:3], rb[3:5]), ("A", ha + ra[:3], ra[3:5])]) == [rb[3:6], ra[3:6]]
    assert _verify(ver, [("A", ha + ra[:6], ra[6:8])]) == [ra[6:9]]


def test_a_swap_that_does_not_fit_leaves_the_draft_as_it_was(target):
    """DraftWorker.swap checked names but not shapes: load_state_dict copied every tensor that fit
    before raising on the one that did not, so the worker went on serving a mix of two versions with
    the old version's label and caches."""
    worker = DraftWorker(perturbed(target, 0.05), target.config.vocab_size)
    own = {n: t.clone() for n, t in worker.draft.state_dict().items()}
    names = list(own)
    state = {names[0]: torch.zeros(3, 3), names[1]: torch.zeros_like(own[names[1]])}
    with pytest.raises((ValueError, RuntimeError)):  # refused, by either: what matters is what is left
        worker.swap(state, 1)
    assert worker.version == 0
    assert all(torch.equal(t, own[n]) for n, t in worker.draft.state_dict().items())


def test_a_temperature_that_is_zero_in_float32_is_greedy_on_both_paths(target, tok):
    """temperature 1e-46 passed validation as sampled, but the rows hold it in float32 as 0.0: the
    batch read as all greedy, the draft computed no probabilities, and the disaggregated worker indexed
    the None it got (a TypeError failing the whole draft call). Both paths now decode it greedily."""
    from osd_serve.config import SamplingParams
    from osd_serve.disagg import ProposeItem
    from osd_serve.engine import SpecEngine

    draft = perturbed(target, 0.05)
    prompt = _prompts(target.config.vocab_size, n=1, seed=4)[0]
    props = DraftWorker(draft, target.config.vocab_size).propose([ProposeItem("a", prompt, 3, Sampling(temperature=1e-46, seed=1))])
    assert props[0].probs is None and len(props[0].tokens) == 3
    params = SamplingParams(max_tokens=8, temperature=1e-46, num_speculative_tokens=3, ignore_eos=True, seed=1)
    assert params.greedy and not SamplingParams(temperature=1.5e-45).greedy  # 1.5e-45 is float32's smallest
    out = SpecEngine(target, draft, tok).generate([prompt], params)[0]
    assert out.token_ids == _hf_greedy(target, prompt, 8)


def test_a_sequence_twice_in_one_batch_is_recorded_once(target):
    """Both places of a duplicated id went into one replay trace: its record mixed positions and
    target distributions from two histories. The first place is recorded, as its cache is kept."""
    from osd_serve.distill.recorder import Recorder, RecordConfig

    vocab = target.config.vocab_size
    pa, pb = _prompts(vocab, n=2, seed=6)
    rec = Recorder(RecordConfig("all"))
    ver = TargetVerifier(target, vocab, recorder=rec)
    ra, rb = _hf_greedy(target, pa, 2), _hf_greedy(target, pb, 3)
    v, _ = ver.verify([VerifyItem("A", pa, ra[:2], None, Sampling()), VerifyItem("A", pb, [rb[0] + 1], None, Sampling()),
                       VerifyItem("B", pb, rb, None, Sampling())])
    assert [x.accepted for x in v] == [2, 0, 3]
    a, b = rec.traces["A"], rec.traces["B"]
    # A's first place only: 2 tested, 2 accepted, 3 positions kept (the second place would add 1, 0, 1)
    assert (a.steps, a.tested, a.accepted, len(a.positions)) == (1, 2, 2, 3)
    assert (b.steps, b.tested, b.accepted, len(b.positions)) == (1, 3, 3, 4)


def test_an_empty_verify_batch_is_answered_empty(target):
    """verify([]) raised on max() of no k, having detached every held row first; propose([]) answered []."""
    ver = TargetVerifier(target, target.config.vocab_size)
    prompt = _prompts(target.config.vocab_size, n=1, seed=2)[0]
    first = _verify(ver, [("s", prompt, [])])
    assert ver.verify([]) == ([], {})
    assert _verify(ver, [("s", prompt + first[0], [])])[0] == _hf_greedy(target, prompt, 2)[1:]
