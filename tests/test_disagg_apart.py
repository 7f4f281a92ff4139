"""A disaggregated worker prefills a long new sequence in a forward of its own (prefill.apart), so the
batch forward is not padded to its prompt across every row. Verdicts and proposals stay the same."""

from __future__ import annotations

import pytest
import torch

import osd_serve.disagg as disagg_mod
import osd_serve.kv as kv_mod
from osd_serve.disagg import DraftWorker, ProposeItem, Sampling, TargetVerifier, VerifyItem
from osd_serve.prefill import apart
from tests.conftest import llama, perturbed
from tests.test_engine import _hf_greedy


class Fed:
    """The input positions of each forward of a model (rows x columns), in order."""

    def __init__(self, model):
        self.sizes: list[int] = []
        self.hook = model.register_forward_pre_hook(lambda m, args, kw: self.sizes.append(kw["input_ids"].numel()),
                                                    with_kwargs=True)


def test_apart_takes_the_long_new_rows_out_while_it_saves_positions():
    assert apart([2000] + [1] * 8, [True] + [False] * 8) == [True] + [False] * 8
    assert apart([2000, 1800] + [1] * 6, [True, True] + [False] * 6) == [True, True] + [False] * 6  # both, not the first alone
    assert apart([200] * 8, [True] * 8) == [False] * 8  # like lengths: one padded forward is cheapest
    assert apart([2000], [True]) == [False]  # alone, a forward of its own saves nothing
    # 2 x 64 padded against 2 x 5 + 63 + 32: a saving, but not half; an extra forward costs more than it says
    assert apart([64, 5], [True, False]) == [False, False]
    assert apart([2000] + [1] * 8, [False] * 9) == [False] * 9  # a row with a cache here is never taken


def _decoding(verifier, hists, k=3):
    """Verify one step of each history so the verifier holds their caches (they decode from here)."""
    items = [VerifyItem(f"d{i}", h, [3] * k, None, Sampling()) for i, h in enumerate(hists)]
    verifier.verify(items)
    return items


def test_a_long_new_sequence_among_decoding_ones_is_prefilled_apart(tok, monkeypatch):
    """7 sequences decode; an 80-token one arrives. Its prompt is fed in a forward of its own (79
    positions) and the batch forward 8 rows of at most 4 + k, not 8 x (80 + k); every verdict is the one a
    verifier batching it all in one forward gives, and its recomputed count is its history's."""
    target = llama(len(tok), seed=3)
    k, prompt = 3, list(range(3, 83))
    hists = [[5 + i, 6, 7, 8] for i in range(7)]
    runs = []
    for never_apart in (False, True):  # True: the batch forward takes everything (the old behaviour)
        if never_apart:
            monkeypatch.setattr(disagg_mod, "APART_OVERHEAD", 10**9)  # no history is long enough to look at
        verifier = TargetVerifier(target, target.config.vocab_size)
        _decoding(verifier, hists, k)
        fed = Fed(target)
        items = [VerifyItem(f"d{i}", h + [3, 3, 3, 3], [4, 4, 4], None, Sampling()) for i, h in enumerate(hists)]
        items.append(VerifyItem("new", prompt, [9, 9, 9], None, Sampling()))
        runs.append((fed.sizes, verifier.verify(items)[0]))
        fed.hook.remove()
    (sizes, verdicts), (old_sizes, old_verdicts) = runs
    # the decoding rows feed what their caches lack (up to 4 history tokens) and the k drafts
    assert len(sizes) == 2 and sizes[0] == 79 and sizes[1] <= 8 * (4 + k) and old_sizes == [8 * (80 + k)]
    assert [v.tokens for v in verdicts] == [v.tokens for v in old_verdicts]
    assert verdicts[-1].tokens[0] == _hf_greedy(target, prompt, 1)[0]
    assert verdicts[-1].recomputed == old_verdicts[-1].recomputed == len(prompt) - 1


def test_the_draft_worker_prefills_apart_too_and_proposes_the_same(tok):
    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.02)
    prompt = list(range(3, 83))
    hists = [[5 + i, 6, 7, 8] for i in range(5)]
    worker = DraftWorker(draft, target.config.vocab_size, ahead=False)
    worker.propose([ProposeItem(f"d{i}", h, 3, Sampling()) for i, h in enumerate(hists)])
    fed = Fed(draft)
    items = [ProposeItem(f"d{i}", h + [9], 3, Sampling()) for i, h in enumerate(hists)] + [ProposeItem("new", prompt, 3, Sampling())]
    props = worker.propose(items)
    assert fed.sizes[0] == 79 and max(fed.sizes[1:]) <= 6 * 2  # then the batch: a pending token or two per row
    alone = DraftWorker(draft, target.config.vocab_size, ahead=False).propose([ProposeItem("new", prompt, 3, Sampling())])
    assert props[-1].tokens == alone[0].tokens


def test_a_forward_that_fails_apart_changes_nothing(tok, monkeypatch):
    """Out of memory in the apart forward: the call fails, and the next call (the same batch) finds the
    caches as they were and gives the verdicts a fresh verifier gives."""
    target = llama(len(tok), seed=3)
    hists = [[5 + i, 6, 7, 8] for i in range(4)]
    verifier = TargetVerifier(target, target.config.vocab_size)
    _decoding(verifier, hists)
    items = [VerifyItem(f"d{i}", h + [3, 3, 3, 3], [4], None, Sampling()) for i, h in enumerate(hists)]
    items.append(VerifyItem("new", list(range(3, 83)), [9], None, Sampling()))
    forward = kv_mod.BatchKV.forward

    def oom(self, ids, valid, keep=None):
        if ids.shape == (1, 79):
            raise torch.OutOfMemoryError("test")
        return forward(self, ids, valid, keep)

    monkeypatch.setattr(kv_mod.BatchKV, "forward", oom)
    with pytest.raises(torch.OutOfMemoryError):
        verifier.verify(items)
    monkeypatch.setattr(kv_mod.BatchKV, "forward", forward)
    got, _ = verifier.verify(items)
    fresh = TargetVerifier(target, target.config.vocab_size)
    _decoding(fresh, hists)
    want, _ = fresh.verify(items)
    assert [v.tokens for v in got] == [v.tokens for v in want]
