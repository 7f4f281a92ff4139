"""The Ray replay buffer's records on disk (osd_serve/distill/spill.py): a buffer actor that Ray restarts
(max_restarts re-runs __init__ with its creation's arguments) reads back the records it held, their guard
flags and its trigger state, instead of starting empty. The actor class is driven without a cluster, as in
test_distiller_mutants.py: ray.put is the identity."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest
import safetensors.torch as st
import torch

from osd_serve.distill.replay import BufferConfig, ReplayBuffer, make_record
from osd_serve.distill.spill import RecordSpill, restore

CFG = {"max_bytes": 1 << 20, "trigger_records": 4, "trigger_age_s": 60.0}
PAIR = ["t", "d"]


def _record(i: int, expert: str = "default", heldout: bool = False, topk: int = 0):
    g = torch.Generator().manual_seed(i)
    p = torch.softmax(torch.randn(3, 32, generator=g), -1)  # [n=3, V=32]
    rec = make_record(torch.arange(5) + i, torch.arange(4) + i, [0, 1, 3], p, topk=topk, expert=expert)
    rec.heldout = heldout
    return rec


def _same(a, b) -> bool:
    fields = ("prompt_ids", "response_ids", "positions", "probs", "topk_ids", "rest_mass")
    return all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
               for x, y in ((getattr(a, f), getattr(b, f)) for f in fields)) and (a.expert, a.heldout) == (b.expert, b.heldout)


def test_a_record_reads_back_as_it_was_saved(tmp_path):
    spill = RecordSpill(tmp_path)
    recs = [_record(0), _record(1, "sql", heldout=True, topk=4), make_record([], [], [], torch.zeros(0, 32))]
    for seq, r in enumerate(recs):
        assert spill.save(seq, r.expert, r)
    back = {s.seq: s for e in spill.experts() for s in spill.load(e)}
    assert sorted(back) == [0, 1, 2] and all(_same(back[i].record, r) for i, r in enumerate(recs))
    assert abs(back[0].wall - time.time()) < 60
    assert (tmp_path / "sql" / "000000000001.g.safetensors").exists()  # a guard sample says so in its name
    spill.unguard("sql", 1)
    assert not spill.load("sql")[0].record.heldout
    spill.drop("sql", 1)
    assert spill.load("sql") == [] and spill.experts() == ["default", "sql"]


def test_a_torn_file_is_removed_and_the_rest_read_back(tmp_path, caplog):
    spill = RecordSpill(tmp_path)
    for seq in range(3):
        spill.save(seq, "default", _record(seq))
    (tmp_path / "default" / "000000000001.safetensors").write_bytes(b"\x10\x00\x00")  # a crash mid-write
    (tmp_path / "default" / ".000000000003.safetensors.tmp").write_bytes(b"half")  # killed before its rename
    with caplog.at_level(logging.WARNING):
        assert [s.seq for s in spill.load("default")] == [0, 2]
    assert "000000000001.safetensors is not a readable record" in caplog.text
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["000000000000.safetensors",
                                                                        "000000000002.safetensors"]


def test_restore_counts_only_records_after_the_last_finished_update_and_keeps_their_age(tmp_path):
    spill = RecordSpill(tmp_path)
    for seq in range(6):
        spill.save(seq, "default", _record(seq))
    spill.finished("default", 3, seen=9)  # an update took records 0..3 and finished
    for path in (tmp_path / "default").glob("00000000000[45]*"):  # records 4 and 5 were made 100 s ago
        st.save_file(st.load_file(str(path)), str(path), metadata={"wall": repr(time.time() - 100)})
    buffer = ReplayBuffer(BufferConfig(**CFG))

    def made(s, created):  # what the buffer keeps of a record: here the record itself
        s.record.created, s.record.seq = created, s.seq
        return s.record

    kept, next_seq = restore(spill, buffer, made)
    shard = buffer.shard("default")
    assert (kept, next_seq, len(shard.records), shard.new_since_update, shard.seen) == (6, 6, 6, 2, 9)
    assert 99 < time.monotonic() - shard.oldest_new < 110  # its age, not the restart's: due by age at once
    assert buffer.due() == {"default": "age"}


class _Ref:  # what ray.put returns here: hashable, as an ObjectRef is
    def __init__(self, obj):
        self.obj = obj


@pytest.fixture
def actor_cls(monkeypatch):
    pytest.importorskip("ray.serve")
    import deployments.replay_actor as ra

    monkeypatch.setattr(ra, "ray", SimpleNamespace(put=_Ref))
    return ra.ReplayBufferActor.__ray_metadata__.modified_class.__ray_actor_class__


def _started(cls, root, cfg=CFG):
    """A buffer as connect() makes one: created with the spill directory, then configured with the pair."""
    b = cls(cfg, str(root))
    b.configure(cfg, PAIR)
    return b


def _files(root, expert="default"):
    return sorted(p.name for p in (root / expert).glob("*.safetensors"))


def test_a_restarted_buffer_has_its_records_guard_flags_and_trigger_back(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(4):
        assert b.add("default", _record(i, heldout=i == 1), 999, PAIR)
    refs, flags, _ = b.take("default")  # a job trained on the 4 and published
    b.retire("default", [refs[1]])
    b.finish("default")
    b.add("default", _record(4), 999, PAIR)
    b.add("sql", _record(5, "sql", heldout=True), 999, PAIR)
    assert b.due() == {}

    again = actor_cls(CFG, str(tmp_path))  # what Ray runs on a restart: no configure() yet
    assert again.pair == PAIR  # the pair the records belong to: another pair's replicas are refused
    assert {e: s["records"] for e, s in again.stats().items()} == {"default": 5, "sql": 1}
    assert [r.seq for r in again.buffer.shard("default").records] == [0, 1, 2, 3, 4]
    # record 1 was retired: read back as a guard sample, the guard would score drafts on data they fitted
    assert [r.heldout for r in again.buffer.shard("default").records] == [False] * 5
    assert [r.heldout for r in again.buffer.shard("sql").records] == [True]
    assert [_same(r.ref[0].obj, _record(i)) for i, r in enumerate(again.buffer.shard("default").records)] == [True] * 5
    # the finished update's 4 no longer count; the one after it does, and 3 more make the trigger
    assert again.buffer.shard("default").new_since_update == 1 and again.due() == {}
    for i in range(6, 9):
        again.add("default", _record(i), 999, PAIR)
    assert again.due() == {"default": "size"}
    assert again.buffer.shard("default").records[-1].seq == 8  # numbering goes on; no file is overwritten


def test_records_a_job_held_when_the_buffer_died_are_due_again(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(4):
        b.add("default", _record(i), 999, PAIR)
    b.take("default")  # the job's records died with the buffer: it fails, and they must be trained again
    assert actor_cls(CFG, str(tmp_path)).due() == {"default": "size"}


def test_eviction_removes_the_files_of_the_records_it_drops(actor_cls, tmp_path):
    size = _record(0).nbytes
    small = {**CFG, "max_bytes": 3 * size}
    b = _started(actor_cls, tmp_path, small)
    for i in range(5):
        b.add("default", _record(i), size, PAIR)
    assert _files(tmp_path) == [f"{i:012d}.safetensors" for i in (2, 3, 4)]
    b.configure({**small, "max_bytes": size}, PAIR)  # a redeploy with a smaller buffer_mb
    assert _files(tmp_path) == ["000000000004.safetensors"]
    res = _started(actor_cls, tmp_path / "r", {**small, "eviction": "reservoir"})
    for i in range(40):
        res.add("default", _record(i), size, PAIR)
    assert _files(tmp_path / "r") == [f"{r.seq:012d}.safetensors" for r in res.buffer.shard("default").records]


def test_another_pair_empties_the_files_too(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(3):
        b.add("default", _record(i), 999, PAIR)
    again = actor_cls(CFG, str(tmp_path))  # restarted, read back the old pair's records...
    again.due(CFG, ["t2", "d"])  # ...and the controller's first poll names the current pair
    assert again.stats() == {} and _files(tmp_path) == [] and json.loads((tmp_path / "pair.json").read_text()) == ["t2", "d"]
    assert actor_cls(CFG, str(tmp_path)).stats() == {}  # nothing of the old pair comes back after a later restart


def test_a_restart_gets_the_current_config_though_it_knows_its_pair(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(3):
        b.add("default", _record(i), 999, PAIR)
    again = actor_cls({**CFG, "trigger_records": 8}, str(tmp_path))  # its creation's trigger
    again.due({**CFG, "trigger_records": 2}, PAIR)  # the controller's poll: the current one
    assert again.buffer.cfg.trigger_records == 2 and again.due() == {"default": "size"}


def test_a_disk_that_refuses_writes_keeps_records_in_memory(actor_cls, tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    b = actor_cls(CFG, str(tmp_path / "file" / "replay"))
    b.configure(CFG, PAIR)
    with caplog.at_level(logging.WARNING):
        assert all(b.add("default", _record(i), 999, PAIR) for i in range(4))
    assert b.due() == {"default": "size"} and caplog.text.count("could not") == 1  # warned once
    assert [r.seq for r in b.buffer.shard("default").records] == [-1] * 4
