"""The replay buffer: byte bound, size and age triggers, FIFO and reservoir eviction, shards."""

from __future__ import annotations

import os

import pytest
import torch

from osd_serve.distill.replay import RECORD_OVERHEAD, BufferConfig, ReplayBuffer, make_record


def _rec(i: int, expert: str = "default", n: int = 2, vocab: int = 50, topk: int = 0):
    p = torch.softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(i)), -1)
    rec = make_record([1, 2, 3], [i % 50, 5, 6, 7], list(range(n)), p, topk=topk, expert=expert)
    rec.tag = i  # test-only marker of insertion order
    return rec


def test_bytes_per_record_and_topk_round_trip():
    full, top = _rec(0), _rec(0, topk=8)
    # the tensors' data, and each record's fixed cost as objects (counted: short top-k records are mostly that)
    assert full.nbytes == RECORD_OVERHEAD + 3 * 4 + 4 * 4 + 2 * 8 + 2 * 50 * 2
    assert top.nbytes < full.nbytes
    dense = top.dense_probs(50)
    assert dense.shape == (2, 50) and torch.allclose(dense.sum(-1), torch.ones(2), atol=2e-3)
    p = full.dense_probs(50)
    assert torch.equal(dense.topk(8).indices.sort().values, p.topk(8).indices.sort().values)


@pytest.mark.parametrize("eviction", ["fifo", "reservoir"])
def test_byte_bound_is_respected(eviction):
    size = _rec(0).nbytes
    buf = ReplayBuffer(BufferConfig(max_bytes=10 * size, eviction=eviction))
    for i in range(200):
        buf.add(_rec(i))
        assert buf.nbytes <= 10 * size
    assert len(buf.shard("default").records) == 10


def test_fifo_keeps_newest_reservoir_keeps_a_uniform_sample():
    size = _rec(0).nbytes
    fifo = ReplayBuffer(BufferConfig(max_bytes=10 * size, eviction="fifo"))
    for i in range(100):
        fifo.add(_rec(i))
    assert [r.tag for r in fifo.shard("default").records] == list(range(90, 100))
    # Reservoir: over many runs every one of 100 items is kept with probability ~10/100.
    kept = torch.zeros(100)
    for seed in range(300):
        res = ReplayBuffer(BufferConfig(max_bytes=10 * size, eviction="reservoir", seed=seed))
        for i in range(100):
            res.add(_rec(i))
        for r in res.shard("default").records:
            kept[r.tag] += 1
    freq = kept / 300
    assert freq[:50].mean() == pytest.approx(0.1, abs=0.03) and freq[50:].mean() == pytest.approx(0.1, abs=0.03)


def test_triggers_by_size_and_by_age_and_shards_are_separate():
    buf = ReplayBuffer(BufferConfig(trigger_records=3, trigger_age_s=10.0))
    buf.add(_rec(0, "code"), now=100.0)
    buf.add(_rec(1, "math"), now=100.0)
    assert buf.due(now=101.0) == {}
    buf.add(_rec(2, "code"), now=101.0)
    buf.add(_rec(3, "code"), now=102.0)
    assert buf.due(now=102.0) == {"code": "size"}
    assert buf.due(now=111.0) == {"code": "size", "math": "age"}
    buf.shard("code").mark_updated()
    assert buf.due(now=111.0) == {"math": "age"}


def test_topk_ids_beyond_the_draft_vocabulary():
    """A target with ids the draft lacks can put its top-k there: the dense row must not fail and keeps
    the whole distribution (the trainer and the guard cut it to the draft's ids)."""
    p = torch.zeros(2, 12)
    p[0, [1, 10, 11]] = torch.tensor([0.5, 0.3, 0.2])
    p[1, [2, 3, 11]] = torch.tensor([0.6, 0.3, 0.1])
    rec = make_record([1], [2, 3], [0, 1], p, topk=3)
    dense = rec.dense_probs(8)  # the draft's width
    assert dense.shape == (2, 12) and torch.allclose(dense, p, atol=1e-3)
    assert rec.dense_probs(16).shape == (2, 16)


def test_reconfigure_applies_new_bounds_and_triggers():
    size = _rec(0).nbytes
    buf = ReplayBuffer(BufferConfig(max_bytes=10 * size, trigger_records=100))
    for i in range(8):
        buf.add(_rec(i))
    assert buf.due() == {}
    buf.reconfigure(BufferConfig(max_bytes=5 * size, trigger_records=4))
    assert [r.tag for r in buf.shard("default").records] == [3, 4, 5, 6, 7] and buf.nbytes == 5 * size
    assert buf.due() == {"default": "size"}
    buf.add(_rec(8))
    assert buf.nbytes == 5 * size  # the new bound holds for later records too


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the RSS from /proc")
def test_a_full_shard_of_small_records_stays_near_its_byte_bound_in_memory():
    """Top-k records of short requests hold a few hundred bytes of data each but ~3 KB as objects (six
    small tensors and the dataclass). With data alone counted, a shard at an 8 MiB bound took ~100 MiB."""
    import gc

    from osd_serve.distill.replay import compress

    bound = 8 << 20
    buf = ReplayBuffer(BufferConfig(max_bytes=bound, trigger_records=10**9))
    p = torch.softmax(torch.randn(4, 1000), -1)
    gc.collect()
    before = _rss_mib()
    for i in range(200_000):
        n = 1 + i % 4
        parts = tuple(t.clone() for t in compress(p[:n], 8))  # each its own tensors, as the recorder's
        buf.add(make_record(list(range(20)), list(range(16)), list(range(n)), parts, topk=8))
        if buf.shard("default").seen > len(buf.shard("default").records) + 1000:
            break  # full: a thousand records evicted
    gc.collect()
    assert _rss_mib() - before < 3 * bound / 2**20, (_rss_mib() - before, len(buf.shard("default").records))
