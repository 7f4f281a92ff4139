"""The Ray replay buffer's records on disk (osd_serve/distill/spill.py): a buffer actor that Ray restarts
(max_restarts re-runs __init__ with its creation's arguments) reads back the records it held, their guard
flags and its trigger state, instead of starting empty. The actor class is driven without a cluster, as in
test_distiller_mutants.py: ray.put is the identity."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import safetensors.torch as st
import torch

from osd_serve.distill.replay import BufferConfig, ReplayBuffer, make_record
from osd_serve.distill import spill as sp
from osd_serve.distill.spill import RecordSpill, restore

CFG = {"max_bytes": 1 << 20, "trigger_records": 4, "trigger_age_s": 60.0}
PAIR = ["t", "d"]
BLOCK = 4096  # replay_actor.SEQ_BLOCK: a restarted buffer numbers from the next block


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


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk: each record's half-written temporary file stayed, one more per record, until a restart."""
    def full(tensors, path, metadata=None):
        open(path, "wb").write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sp, "save_file", full)
    spill = RecordSpill(tmp_path)
    assert not spill.save(0, "default", _record(0)) and list((tmp_path / "default").iterdir()) == []


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
    kept, next_seq = restore(spill, buffer, sp.as_kept)  # the buffer keeps the records themselves
    shard = buffer.shard("default")
    assert (kept, next_seq, len(shard.records), shard.new_since_update, shard.seen) == (6, 6, 6, 2, 9)
    assert 99 < time.monotonic() - shard.oldest_new < 110  # its age, not the restart's: due by age at once
    assert buffer.due() == {"default": "age"}


class _Ref:  # what ray.put returns here: hashable, as an ObjectRef is
    def __init__(self, obj):
        self.obj = obj


@pytest.fixture
def actor_cls(monkeypatch):  # a test that undid this would have restore() start a Ray cluster
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    import deployments.replay_actor as ra

    monkeypatch.setattr(ra, "ray", SimpleNamespace(put=_Ref))
    started = ray.is_initialized()
    yield ra.ReplayBufferActor.__ray_metadata__.modified_class.__ray_actor_class__
    assert ray.is_initialized() == started, "the test reached the real ray (a Ray cluster it started)"


def _started(cls, root, cfg=CFG):
    """A buffer as connect() makes one: created with the spill directory, then configured with the pair."""
    b = cls(cfg, str(root))
    b.configure(cfg, PAIR)
    return b


def _restarted(cls, old, root, cfg=CFG):
    """What Ray runs when the actor's process dies: __init__ with the creation's arguments, no configure()
    yet. The old one's queued writes are waited for first (a real kill loses those: the last moments')."""
    old.flush()
    return cls(cfg, str(root))


def _files(b, root, expert="default"):
    b.flush()
    return sorted(p.name for p in (root / expert).glob("*.safetensors"))


def test_a_restarted_buffer_has_its_records_guard_flags_and_trigger_back(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(4):
        assert b.add("default", _record(i, heldout=i == 1), 999, PAIR)
    refs, flags, window = b.take("default")  # a job trained on the 4 and published
    b.retire("default", [refs[1]])
    b.finish("default", window)
    b.add("default", _record(4), 999, PAIR)
    b.add("sql", _record(5, "sql", heldout=True), 999, PAIR)
    assert b.due() == {}

    again = _restarted(actor_cls, b, tmp_path)
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
    # numbered past every number the former process could have handed out: no file or window is mistaken
    assert [r.seq for r in again.buffer.shard("default").records][-3:] == [BLOCK, BLOCK + 1, BLOCK + 2]


def test_a_record_added_while_a_job_ran_counts_after_a_restart(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(4):
        b.add("default", _record(i), 999, PAIR)
    _, _, window = b.take("default")
    b.add("default", _record(4), 999, PAIR)  # while the job runs: not in it
    b.finish("default", window)
    assert _restarted(actor_cls, b, tmp_path).buffer.shard("default").new_since_update == 1


def test_numbering_after_a_restart_never_falls_back_to_a_finished_seq(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(4):
        b.add("default", _record(i), 999, PAIR)
    b.finish("default", b.take("default")[2])  # records 0..3 finished
    b.configure({**CFG, "max_bytes": 1}, PAIR)  # every record and its file dropped
    again = _restarted(actor_cls, b, tmp_path)
    again.configure(CFG, PAIR)
    again.add("default", _record(9), 999, PAIR)  # numbered 4: as 0, it would count as finished after a restart
    assert _restarted(actor_cls, again, tmp_path).buffer.shard("default").new_since_update == 1


def test_records_a_job_held_when_the_buffer_died_are_due_again_and_counted_once(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(3):
        b.add("default", _record(i), 999, PAIR)
    _, _, window = b.take("default")  # the job's refs die with the buffer: it fails, and they must be trained again
    again = _restarted(actor_cls, b, tmp_path)
    assert again.buffer.shard("default").new_since_update == 3
    again.rearm("default", window)  # the failed job's rearm reaches the restarted buffer: counted already
    assert again.buffer.shard("default").new_since_update == 3 and again.due() == {}
    again.add("default", _record(3), 999, PAIR)
    assert again.due() == {"default": "size"}


def test_a_job_that_finishes_on_a_restarted_buffer_ends_its_window_there(actor_cls, tmp_path):
    """The buffer died after the job had its records, and the job published: its records are trained on."""
    b = _started(actor_cls, tmp_path)
    for i in range(4):
        b.add("default", _record(i), 999, PAIR)
    _, _, window = b.take("default")
    again = _restarted(actor_cls, b, tmp_path)
    again.add("default", _record(4), 999, PAIR)
    again.finish("default", window)
    assert again.buffer.shard("default").new_since_update == 1
    assert _restarted(actor_cls, again, tmp_path).buffer.shard("default").new_since_update == 1
    # a buffer that restarted with no files numbers anew: another process's mark would mean other records
    fresh = actor_cls(CFG)
    fresh.configure(CFG, PAIR)
    for i in range(3):
        fresh.add("default", _record(i), 999, PAIR)
    fresh.finish("default", window)
    assert fresh.buffer.shard("default").new_since_update == 3


def _killed_in_a_job(actor_cls, tmp_path, n):
    """n guard samples, the last one's write still queued when the process is killed, as a job holds them all.
    Returns the job's refs and window, and the restarted buffer."""
    b = _started(actor_cls, tmp_path)
    for i in range(n - 1):
        b.add("default", _record(i, heldout=True), 999, PAIR)
    gate = _stalled(b.spill)
    b.add("default", _record(n - 1, heldout=True), 999, PAIR)  # lost
    refs, _, window = b.take("default")
    b.spill._q.queue.clear()
    gate.set()
    again = actor_cls(CFG, str(tmp_path))
    again.due(CFG, PAIR)
    return refs, window, again


def test_a_job_that_publishes_on_a_restarted_buffer_retires_its_guard_samples_there(actor_cls, tmp_path):
    """The restarted buffer holds the records under refs of its own, which matched none of the job's: the
    guard samples it trained on stayed guard samples, and later guards scored drafts on data they fitted."""
    refs, window, again = _killed_in_a_job(actor_cls, tmp_path, 5)
    again.add("default", _record(5, heldout=True), 999, PAIR)  # no job took it
    trained = [0, 2, 4]  # the job trained on three of its guard samples and published
    again.retire("default", [refs[i] for i in trained], [window[4][i] for i in trained], window)
    assert [(r.seq, r.heldout) for r in again.buffer.shard("default").records] == [
        (0, False), (1, True), (2, False), (3, True), (BLOCK, True)]
    assert _files(again, tmp_path) == ["000000000000.safetensors", "000000000001.g.safetensors",
                                       "000000000002.safetensors", "000000000003.g.safetensors",
                                       "000000004096.g.safetensors"]
    # this process's own job still names its records by ref
    refs, _, window = again.take("default")
    again.retire("default", [refs[-1]], [window[4][-1]], window)
    assert again.buffer.shard("default").records[-1].heldout is False


def test_a_number_lost_in_a_kill_is_never_handed_out_again(actor_cls, tmp_path):
    """A job outliving two restarts: the first process's last record was never written, the second numbered
    a new guard sample as that one, then died too; the job's retire on the third retired it by that number."""
    refs, window, second = _killed_in_a_job(actor_cls, tmp_path, 3)
    second.add("default", _record(3, heldout=True), 999, PAIR)
    third = _restarted(actor_cls, second, tmp_path)
    third.due(CFG, PAIR)
    third.retire("default", refs, list(window[4]), window)  # trained on all three, and published
    assert [(r.seq, r.heldout) for r in third.buffer.shard("default").records] == [(0, False), (1, False), (BLOCK, True)]
    assert 2 * BLOCK == third.first_seq


def test_numbers_are_reserved_before_they_are_handed_out(actor_cls, tmp_path, monkeypatch):
    """Queued behind the record writes, a reservation a kill lost let the restart number from the files."""
    b = _started(actor_cls, tmp_path)
    gate = _stalled(b.spill)  # the disk hangs from the first record on
    for i in range(2):
        b.add("default", _record(i), 999, PAIR)
    _, _, window = b.take("default")
    b.spill._q.queue.clear()  # killed: both records lost
    gate.set()
    again = actor_cls(CFG, str(tmp_path))
    again.due(CFG, PAIR)
    again.add("default", _record(2), 999, PAIR)
    assert window[4] == (0, 1) and again.buffer.shard("default").records[-1].seq == BLOCK


def test_a_failed_or_unreadable_reservation_costs_no_number_and_no_files(actor_cls, tmp_path, monkeypatch):
    real, fails = sp.replace_json, iter([OSError(5, "I/O error")])

    def flaky(path, obj):
        if path.name == sp.SEQ_FILE and (e := next(fails, None)) is not None:
            raise e
        return real(path, obj)

    monkeypatch.setattr(sp, "replace_json", flaky)
    b = _started(actor_cls, tmp_path)
    for i in range(2):  # the first one's reservation fails: the second one's is written
        b.add("default", _record(i), 999, PAIR)
    assert RecordSpill(tmp_path).reserved() == 1 + BLOCK
    (tmp_path / sp.SEQ_FILE).write_text("")  # a power loss after an unsynced rename
    again = _restarted(actor_cls, b, tmp_path)
    again.due(CFG, PAIR)
    again.add("default", _record(2), 999, PAIR)
    assert again.spill is not None and [r.seq for r in again.buffer.shard("default").records] == [0, 1, 2]
    assert RecordSpill(tmp_path).reserved() == 2 + BLOCK


def test_a_restart_keeps_what_the_current_bound_keeps(actor_cls, tmp_path):
    """Ray restarts the actor with its creation's config; a redeploy raised buffer_mb since. Restored under
    the creation's bound, the records past it were evicted and their files removed for good."""
    size = _record(0).nbytes
    small, big = {**CFG, "max_bytes": 2 * size}, {**CFG, "max_bytes": 100 * size}
    b = _started(actor_cls, tmp_path, small)
    b.configure(big, PAIR)
    for i in range(6):
        b.add("default", _record(i), size, PAIR)
    again = _restarted(actor_cls, b, tmp_path, small)
    again.due(big, PAIR)  # the controller's poll brings the current config
    assert len(again.buffer.shard("default").records) == 6 and len(_files(again, tmp_path)) == 6
    again.configure(small, PAIR)  # and a smaller one evicts as ever
    assert _files(again, tmp_path) == [f"{i:012d}.safetensors" for i in (4, 5)]


def test_eviction_removes_the_files_of_the_records_it_drops(actor_cls, tmp_path):
    size = _record(0).nbytes
    small = {**CFG, "max_bytes": 3 * size}
    b = _started(actor_cls, tmp_path, small)
    for i in range(5):
        b.add("default", _record(i), size, PAIR)
    assert _files(b, tmp_path) == [f"{i:012d}.safetensors" for i in (2, 3, 4)]
    b.configure({**small, "max_bytes": size}, PAIR)  # a redeploy with a smaller buffer_mb
    assert _files(b, tmp_path) == ["000000000004.safetensors"]
    res = _started(actor_cls, tmp_path / "r", {**small, "eviction": "reservoir"})
    for i in range(40):
        res.add("default", _record(i), size, PAIR)
    assert _files(res, tmp_path / "r") == [f"{r.seq:012d}.safetensors" for r in res.buffer.shard("default").records]


def test_another_pair_empties_the_files_too(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(3):
        b.add("default", _record(i), 999, PAIR)
    again = _restarted(actor_cls, b, tmp_path)  # read back the old pair's records...
    again.due(CFG, ["t2", "d"])  # ...and the controller's first poll names the current pair
    assert again.stats() == {} and _files(again, tmp_path) == []
    assert json.loads((tmp_path / ".pair.json").read_text()) == ["t2", "d"]
    assert _restarted(actor_cls, again, tmp_path).stats() == {}  # nothing of the old pair comes back later


def test_the_pair_file_is_read_once_and_names_no_expert(actor_cls, tmp_path, monkeypatch):
    b = _started(actor_cls, tmp_path)
    for i in range(3):
        b.add("default", _record(i), 999, PAIR)
    b.add("pair.json", _record(3, "pair.json"), 999, PAIR)  # a valid expert name
    with monkeypatch.context() as m:  # not undo(): that would give the actor module its real ray back
        m.setattr(RecordSpill, "pair", lambda self: None)  # the shared disk failing a read
        b.configure(CFG, PAIR)  # a replica starting: connect() configures the same pair again
    assert len(_files(b, tmp_path)) == 3 and _files(b, tmp_path, "pair.json") == ["000000000003.safetensors"]


def test_a_restart_comes_up_whatever_the_disk_does(actor_cls, tmp_path, monkeypatch):
    """Ray does not retry a restart whose __init__ raises: the buffer would stay dead."""
    b = _started(actor_cls, tmp_path)
    b.add("default", _record(0), 999, PAIR)
    b.flush()
    (tmp_path / "default" / ".000000000001.safetensors.tmp").write_bytes(b"x")

    def refused(self, missing_ok=False):
        raise PermissionError(13, "Read-only file system", str(self))

    monkeypatch.setattr(type(tmp_path), "unlink", refused)
    assert actor_cls(CFG, str(tmp_path)).stats()["default"]["records"] == 1  # the leftover stays; the record is back
    module, said = sys.modules[actor_cls.__module__], []
    monkeypatch.setattr(module, "restore", lambda *a: 1 / 0)
    monkeypatch.setattr(module.logger, "warning", lambda msg, *args: said.append(msg % args))  # ray.serve's: no caplog
    size = _record(0).nbytes
    again = actor_cls({**CFG, "max_bytes": size}, str(tmp_path))
    assert again.stats() == {} and again.pair is None and "failed (ZeroDivisionError" in said[-1]
    again.configure({**CFG, "max_bytes": size}, PAIR)
    assert all(again.add("default", _record(i), size, PAIR) for i in range(3))  # evicting: no hook left to fail


def test_a_restart_gets_the_current_config_though_it_knows_its_pair(actor_cls, tmp_path):
    b = _started(actor_cls, tmp_path)
    for i in range(3):
        b.add("default", _record(i), 999, PAIR)
    again = _restarted(actor_cls, b, tmp_path, {**CFG, "trigger_records": 8})  # its creation's trigger
    again.due({**CFG, "trigger_records": 2}, PAIR)  # the controller's poll: the current one
    assert again.buffer.cfg.trigger_records == 2 and again.due() == {"default": "size"}


def test_a_disk_that_refuses_writes_keeps_records_in_memory(actor_cls, tmp_path, caplog):
    b = _started(actor_cls, tmp_path)
    (tmp_path / "default").write_text("not a directory")  # where the expert's records go
    with caplog.at_level(logging.WARNING):
        assert all(b.add("default", _record(i), 999, PAIR) for i in range(4))
        b.flush()
    assert b.due() == {"default": "size"} and caplog.text.count("could not") == 1  # warned once


def _stalled(writer):
    """The writer thread held by a disk that hangs until the returned event is set; its queue empty again."""
    gate = threading.Event()
    writer._q.put((gate.wait, ()))
    while writer._q.qsize():
        time.sleep(0.01)
    return gate


def test_the_write_backlog_is_bounded_in_bytes_and_skips_records_dropped_meanwhile(tmp_path, monkeypatch, caplog):
    """A full-distribution record is MBs (a guard sample: every position x the vocabulary): a bound in records
    let a slow shared disk queue tens of GB in the buffer's memory, and OOM-kill it."""
    writer = sp.SpillWriter(RecordSpill(tmp_path))
    size = _record(0).nbytes
    monkeypatch.setattr(sp.SpillWriter, "MAX_BACKLOG_BYTES", 3 * size)
    gate = _stalled(writer)
    with caplog.at_level(logging.WARNING):
        saved = [writer.save(i, "default", _record(i)) for i in range(5)]
    writer.drop("default", 1)  # evicted while its save waits: never written
    gate.set()
    writer.flush()
    assert saved == [True, True, True, False, False] and caplog.text.count("queued") == 1
    assert [s.seq for s in RecordSpill(tmp_path).load("default")] == [0, 2] and writer._queued == 0
    assert writer.save(5, "default", _record(5))  # drained: saved again


def test_a_finish_from_before_a_restart_marks_no_record_the_job_did_not_take(actor_cls, tmp_path):
    """The killed process's newest writes were still queued: the restarted one numbered its own records from
    below the old job's mark, and that job's finish counted them as trained, also on disk."""
    b = _started(actor_cls, tmp_path)
    for i in range(4):
        b.add("default", _record(i), 999, PAIR)
    gate = _stalled(b.spill)
    for i in range(4, 6):
        b.add("default", _record(i), 999, PAIR)  # queued behind the hung write...
    _, _, window = b.take("default")  # mark 5
    b.spill._q.queue.clear()  # ...when the process is killed: lost
    gate.set()
    again = actor_cls(CFG, str(tmp_path))
    again.due(CFG, PAIR)
    for i in range(6, 8):
        again.add("default", _record(i), 999, PAIR)  # numbered 4 and 5; no job took them
    again.finish("default", window)
    assert again.buffer.shard("default").new_since_update == 2
    assert _restarted(actor_cls, again, tmp_path).buffer.shard("default").new_since_update == 2


def test_a_disk_error_at_a_restart_leaves_the_files_alone(actor_cls, tmp_path, monkeypatch):
    """A passing error reading the pair file (a shared disk) read as "no pair", and the next configure()
    removed every record's file."""
    b = _started(actor_cls, tmp_path)
    for i in range(3):
        b.add("default", _record(i), 999, PAIR)
    b.flush()
    read = type(tmp_path).read_text

    def eio(self, *args, **kw):
        if self.name == sp.PAIR_FILE:
            raise OSError(5, "Input/output error")
        return read(self, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(type(tmp_path), "read_text", eio)
        again = actor_cls(CFG, str(tmp_path))
    again.configure(CFG, PAIR)
    assert again.add("default", _record(3), 999, PAIR) and again.spill is None  # in memory only, this process
    assert sorted(p.name for p in (tmp_path / "default").glob("*.safetensors")) == [f"{i:012d}.safetensors"
                                                                                   for i in range(3)]
    assert _restarted(actor_cls, b, tmp_path).stats()["default"]["records"] == 3  # the next restart has them


def test_a_restart_no_configure_reaches_stays_bounded(actor_cls, tmp_path):
    """A controller made by an older connect() polls with no settings: the buffer read back is bounded by
    what it read back, or its creation's bound if larger, not by nothing."""
    size = _record(0).nbytes
    b = _started(actor_cls, tmp_path, {**CFG, "max_bytes": 3 * size})
    for i in range(3):
        b.add("default", _record(i), size, PAIR)
    again = _restarted(actor_cls, b, tmp_path, {**CFG, "max_bytes": 2 * size})
    assert again.buffer.cfg.max_bytes == 3 * size and again.stats()["default"]["records"] == 3
    again.add("default", _record(3), size, PAIR)
    assert [r.seq for r in again.buffer.shard("default").records] == [1, 2, BLOCK]
