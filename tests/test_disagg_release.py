"""What a disaggregated worker (osd_serve/disagg.py) keeps for a sequence once it is released or pushed
out by its bounds. The end-to-end tests cannot see this: their sequences end with the run, and a row
or proposal left behind changes no token, only the memory a long-running replica holds (a KV row on
the draft's or target's device per sequence)."""

from __future__ import annotations

import pytest

from osd_serve.disagg import DraftWorker, ProposeItem, Sampling, TargetVerifier, VerifyItem
from tests.conftest import llama, perturbed
from tests.test_engine import _hf_greedy, _prompts


@pytest.fixture(scope="module")
def target(tok):
    return llama(len(tok), seed=3)


def _held(caches) -> set[str]:
    """The sequences a SeqCaches holds anything for: recorded tokens, or a detached row."""
    return set(caches.tokens) | set(caches._rows)


def test_a_released_sequence_keeps_no_row_or_proposal(target):
    """Released in each place a sequence can be: in the slab (its row must not be detached into the
    LRU at the next change of the batch), already detached (its row must go at once), and with a
    proposal drafted ahead (dropped). Each was kept until it idled out (IDLE_ROW_S) or max_seqs others
    pushed it out, and no test looked: the sequences of the end-to-end tests never outlive their run."""
    vocab = target.config.vocab_size
    pa, pb, pc = _prompts(vocab, n=3, seed=4)
    s = Sampling()
    dw = DraftWorker(perturbed(target, 0.05), vocab, ahead=True)
    dw.propose([ProposeItem("A", pa, 2, s), ProposeItem("B", pb, 2, s)])
    dw.draft_ahead()
    assert {"A", "B"} <= set(dw._ahead)
    dw.release("A")  # in the slab, with a proposal drafted ahead
    assert "A" not in dw._ahead
    dw.propose([ProposeItem("B", pb, 2, s)])  # the batch changes: the slab is split
    assert "A" not in _held(dw.caches)
    dw.propose([ProposeItem("C", pc, 2, s)])  # B leaves the slab, detached
    assert "B" in dw.caches._rows
    dw.release("B")
    assert "B" not in _held(dw.caches) and _held(dw.caches) == {"C"}

    ver = TargetVerifier(target, vocab)
    ver.verify([VerifyItem("A", pa, [], None, s), VerifyItem("B", pb, [], None, s)])
    ver.release("A")
    ver.verify([VerifyItem("B", pb, [], None, s)])
    assert "A" not in _held(ver.caches)
    ver.verify([VerifyItem("C", pc, [], None, s)])
    ver.release("B")
    assert _held(ver.caches) == {"C"}


def test_the_caches_keep_at_most_max_seqs_detached_rows_least_recently_used_out(target):
    """max_seqs bounds the rows a worker keeps for sequences outside its current batch (their steps
    went to another replica, or their release was lost): with more sequences than that, the least
    recently used is recomputed when it comes back and the most recent is still a cache hit. No test
    reached the bound (the default is 1024), so a cap that freed nothing passed every test."""
    vocab = target.config.vocab_size
    prompts = _prompts(vocab, n=5, seed=7)
    prompts = [p + [5, 6] for p in prompts]  # at least 3 tokens each, so a hit and a recompute differ
    ver = TargetVerifier(target, vocab, max_seqs=2)
    s = Sampling()
    for i, p in enumerate(prompts):  # one at a time: each call detaches the one before
        ver.verify([VerifyItem(f"s{i}", p, [], None, s)])
    assert set(ver.caches._rows) == {"s2", "s3"} and set(ver.caches.tokens) == {"s2", "s3", "s4"}
    (hit,), _ = ver.verify([VerifyItem("s3", prompts[3], [], None, s)])
    (miss,), _ = ver.verify([VerifyItem("s0", prompts[0], [], None, s)])
    assert hit.recomputed == 0 and miss.recomputed == len(prompts[0]) - 1
    # and a recomputed sequence's verdict is still the target's
    assert hit.tokens == _hf_greedy(target, prompts[3], 1) and miss.tokens == _hf_greedy(target, prompts[0], 1)


def test_a_batch_that_keeps_its_sequences_squeezes_out_its_holes(target):
    """Four sequences verified together every step, each accepting all 8 drafts one step in four and
    none the others: rejected columns pile up as holes in the slab (the batch never changes, so it is
    never re-merged). Past half holes the slab is compacted, as the colocated engine does; without that
    it grew by 9 columns a step while its longest row grew by 3 (attention reads them all). The
    end-to-end test of this passed without the compaction, as its last batches held one sequence."""
    vocab = target.config.vocab_size
    prompts = [[5 + i, 9, 12, 20] for i in range(4)]
    refs = [_hf_greedy(target, p, 60) for p in prompts]
    ver, s = TargetVerifier(target, vocab), Sampling()
    out = [[] for _ in prompts]
    widest = 0
    for step in range(12):
        items = []
        for i, (p, ref, o) in enumerate(zip(prompts, refs, out)):
            n = len(o)
            draft = ref[n : n + 8] if step % 4 == i else [(ref[n] + 1) % vocab] * 8  # all right, or wrong at once
            items.append(VerifyItem(f"s{i}", p + o, draft, None, s))
        verdicts, _ = ver.verify(items)
        for o, v in zip(out, verdicts):
            o += v.tokens
        slab = ver.caches.slab
        widest = max(widest, slab.width - 2 * int(slab.length.max()))
    assert out == [ref[: len(o)] for ref, o in zip(refs, out)]  # the target's tokens throughout
    assert widest <= 9  # at most one step's columns (k + 1) past twice the longest row
