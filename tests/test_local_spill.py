"""The local backend's replay buffer on disk (spill.ReplicaSpill): a SpecService replica's records are
files in its versions slot, so the replica that takes the slot over after a crash (or scaling down and up)
resumes with them, their guard flags and the trigger state, instead of starting empty."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import types

import pytest

from deployments.config import AppConfig
from osd_serve.config import SamplingParams
from osd_serve.distill import online
from osd_serve.distill import spill as sp
from osd_serve.distill.guard import Verdict
from osd_serve.distill.replay import BufferConfig, ReplayBuffer
from osd_serve.distill.spill import ReplicaSpill
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed
from tests.test_replay_spill import PAIR, _record, _same

PROMPTS = ["def f(x):", "SELECT a FROM", "import os\n", "class A:", "x = [1, 2,", "for i in range(",
           "return x +", "print('a"]


def _files(root, expert="default"):
    return sorted(p.name for p in (root / expert).glob("*.safetensors"))


def _buffer(files: ReplicaSpill, max_bytes: int = 1 << 20) -> ReplayBuffer:
    return ReplayBuffer(BufferConfig(max_bytes=max_bytes, trigger_records=100), on_drop=files.dropped)


def _keep(files, buf, rec):
    if buf.add(rec):
        files.kept(rec)


def test_records_read_back_with_their_flags_and_trigger_state(tmp_path):
    files = ReplicaSpill(tmp_path, PAIR)
    buf, recs = _buffer(files), [_record(i, heldout=i % 3 == 0) for i in range(5)] + [_record(9, "sql")]
    for r in recs:
        _keep(files, buf, r)
    files.finished("default", recs[2].seq, buf.shard("default").seen)  # an update took the first three
    files.close()
    again = ReplicaSpill(tmp_path, PAIR)
    back = _buffer(again)
    assert again.restore("default", back) == 5 and again.restore("sql", back) == 1
    got = list(back.shard("default").records) + list(back.shard("sql").records)
    assert all(_same(a, b) for a, b in zip(got, recs, strict=True))
    assert [r.seq for r in got] == [0, 1, 2, 3, 4, 5]
    assert back.shard("default").new_since_update == 2 and back.shard("sql").new_since_update == 1
    new = _record(10)
    _keep(again, back, new)
    assert new.seq == 6  # numbered on from the files: an old record's file is never overwritten
    again.close()


def test_eviction_and_retiring_reach_the_files(tmp_path):
    files = ReplicaSpill(tmp_path, PAIR)
    buf = _buffer(files, max_bytes=3 * _record(0).nbytes)
    recs = [_record(i, heldout=True) for i in range(5)]
    for r in recs:
        _keep(files, buf, r)
    files.retired(recs[3:4])
    files.writer.flush()
    # the two oldest were evicted: their files are gone; the retired guard sample is an ordinary record's
    assert _files(tmp_path) == ["000000000002.g.safetensors", "000000000003.safetensors", "000000000004.g.safetensors"]
    files.close()


def test_another_pair_drops_the_records(tmp_path):
    files = ReplicaSpill(tmp_path, PAIR)
    _keep(files, _buffer(files), _record(0))
    files.close()
    other = ReplicaSpill(tmp_path, ["another target", "d"])
    buf = _buffer(other)
    assert other.restore("default", buf) == 0 and not buf.shard("default").records
    assert not (tmp_path / "default").exists() and sp.RecordSpill(tmp_path).pair() == ["another target", "d"]
    other.close()


def test_a_failed_read_back_keeps_the_files_and_writes_no_more(tmp_path, monkeypatch):
    """A passing disk error must not cost the records: this replica runs in memory only, and the files
    wait, untouched, for the next one."""
    files = ReplicaSpill(tmp_path, PAIR)
    _keep(files, _buffer(files), _record(0))
    files.close()
    monkeypatch.setattr(sp.RecordSpill, "load", lambda self, e: (_ for _ in ()).throw(OSError(5, "I/O error")))
    again = ReplicaSpill(tmp_path, PAIR)
    buf = _buffer(again)
    assert again.restore("default", buf) == 0 and not buf.shard("default").records and not again.on
    _keep(again, buf, _record(1))
    again.close()
    assert _files(tmp_path) == ["000000000000.safetensors"]


def test_close_writes_what_is_queued_and_nothing_after(tmp_path):
    files = ReplicaSpill(tmp_path, PAIR)
    buf = _buffer(files)
    for i in range(20):
        _keep(files, buf, _record(i))
    files.close()
    assert len(_files(tmp_path)) == 20
    _keep(files, buf, _record(20))  # a record that finishes as the replica shuts down
    files.writer.flush()
    assert len(_files(tmp_path)) == 20  # the slot may be the next replica's by now
    files.writer._thread.join(timeout=10)
    assert not files.writer._thread.is_alive()  # and its thread ended


def test_the_slot_is_let_go_only_after_a_hung_write_ends(tmp_path, monkeypatch):
    """Past close()'s wait, a write under way (a hung shared disk) landed after the replica had let its slot
    go, in the directory the next replica was reading."""
    gate, events = threading.Event(), []
    real = sp.RecordSpill.save
    monkeypatch.setattr(sp.RecordSpill, "save", lambda *a: gate.wait() and events.append("written") or real(*a))
    files = ReplicaSpill(tmp_path, PAIR)
    _keep(files, _buffer(files), _record(0))
    files.close(timeout_s=0.1, then=lambda: events.append("slot let go"))
    assert events == []
    gate.set()
    files.writer._thread.join(timeout=10)
    assert events == ["written", "slot let go"] and _files(tmp_path) == ["000000000000.safetensors"]
    assert files.writer.close() is True  # a second close changes nothing
    with pytest.raises(RuntimeError):
        files.writer.close(then=lambda: None)  # the thread is gone: nothing would let that slot go
    broken = sp.SpillWriter(sp.RecordSpill(tmp_path / "b"))
    broken.close(then=lambda: 1 / 0)  # releasing the slot raised: the thread still ends
    broken._thread.join(timeout=10)
    assert not broken._thread.is_alive()


def test_a_redeploy_that_drops_an_expert_removes_its_records(tmp_path):
    files = ReplicaSpill(tmp_path, PAIR)
    buf = _buffer(files)
    for expert in ("default", "sql"):
        _keep(files, buf, _record(0, expert))
    files.close()
    again = ReplicaSpill(tmp_path, PAIR)
    again.keep_only(["default"])
    assert sp.RecordSpill(tmp_path).experts() == ["default"]
    again.close()


def _make(tok, tmp_path, **distill):
    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.05)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "mode": "full", "trigger_records": 1000,
                             "trigger_age_s": 3600, **distill}, wandb={"mode": "disabled"})
    return lambda tag: SpecService(cfg, models=(target, copy.deepcopy(draft), tok), replica_tag=tag,  # noqa: E731
                                   private_versions=True)


async def _serve(svc, prompts):
    for p in prompts:
        async for _ in svc.stream("default", p, SamplingParams(max_tokens=12, temperature=0)):
            pass


def test_a_replica_that_takes_the_slot_over_resumes_its_records(tok, tmp_path, monkeypatch):
    """The buffer lived in the replica's process: a crashed replica's replacement started empty, and the
    traffic it had recorded (up to buffer_mb per expert) had to be served again before anything trained."""
    monkeypatch.setattr(online, "check", lambda *a, **k: Verdict(True, "published by the test", {}, {}))
    make = _make(tok, tmp_path)
    first = make("r1")
    try:
        dist = first.distillers["default"]
        dist.engine.recorder.cfg.guard_every = 1  # every record a guard sample: an update trains on some
        asyncio.run(_serve(first, PROMPTS))
        res = asyncio.run(first.admin_update("default"))
        assert res["updated"] and res["published"]
        asyncio.run(_serve(first, PROMPTS[:3]))  # after the update: new toward the next one
        held = [copy.copy(r) for r in dist.buffer.shard("default").records]
        assert len(held) >= 8 and dist.buffer.shard("default").new_since_update == 3
        flags = [r.heldout for r in held]
        assert True in flags and False in flags  # the update retired the guard samples it trained on
    finally:
        first.close()
    replay = tmp_path / "replicas" / "slot-0" / ".replay"
    sp.RecordSpill(replay).save(99, "gone", _record(0, "gone"))  # an expert a redeploy dropped
    second = make("r2")  # slot-0 is free again: this is the replica that replaces the first
    try:
        shard = second.distillers["default"].buffer.shard("default")
        assert [r.seq for r in shard.records] == [r.seq for r in held]
        assert all(_same(a, b) for a, b in zip(shard.records, held, strict=True))
        assert shard.new_since_update == 3  # the update's records stay trained on; the three after it count
        assert second.spill.writer.disk.root == replay and sp.RecordSpill(replay).experts() == ["default"]
        seen = asyncio.run(second.admin_experts())["experts"]["default"]
        assert (seen["buffer_bytes"], seen["buffer_records"], seen["buffer_new"]) == (shard.nbytes, len(held), 3)
        third = make("r3")  # a replica beside it: a slot of its own, and none of slot-0's records
        try:
            assert not third.distillers["default"].buffer.shard("default").records
        finally:
            third.close()
    finally:
        second.close()


def test_a_replica_without_a_slot_keeps_no_files(tok, tmp_path):
    """Outside Ray Serve (the CLI, tests) nothing holds the directory for one process: no files."""
    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "mode": "full"}, wandb={"mode": "disabled"})
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    try:
        asyncio.run(_serve(svc, PROMPTS[:2]))
        assert svc.spill is None and svc.distillers["default"].files is None
        assert svc.distillers["default"].buffer.shard("default").records and not list(tmp_path.rglob(".replay"))
    finally:
        svc.close()


def test_records_that_arrive_during_an_update_stay_new_after_a_restart(tok, tmp_path):
    """The update's mark is the newest record it took, not the newest when it ends: records kept while it
    trained are not trained on, and a restart must count them toward the next update."""
    make = _make(tok, tmp_path)
    first = make("r1")
    try:
        dist = first.distillers["default"]
        asyncio.run(_serve(first, PROMPTS))
        train = dist.trainer.train

        def train_while_traffic_comes(records):
            for i in range(2):
                dist._on_finish(_record(100 + i), None)
            return train(records)

        dist.trainer.train = train_while_traffic_comes
        assert asyncio.run(first.admin_update("default"))["updated"]
        assert dist.buffer.shard("default").new_since_update == 2
    finally:
        first.close()
    second = make("r2")
    try:
        assert second.distillers["default"].buffer.shard("default").new_since_update == 2
    finally:
        second.close()


def test_a_replica_lets_its_slot_go_after_its_records_are_written(tok, tmp_path, monkeypatch):
    """Else the replica that takes the slot over reads it while the last records are still being written."""
    real = sp.RecordSpill.save
    monkeypatch.setattr(sp.RecordSpill, "save", lambda *a: time.sleep(0.05) or real(*a))
    svc = _make(tok, tmp_path)("r1")
    root = tmp_path / "replicas" / "slot-0" / ".replay"
    try:
        asyncio.run(_serve(svc, PROMPTS))
        held = len(svc.distillers["default"].buffer.shard("default").records)
        slot, seen = svc._slot, []
        svc._slot = types.SimpleNamespace(close=lambda: seen.append(len(_files(root))) or slot.close())
    finally:
        svc.close()
    assert seen == [held] and held >= 6


def test_a_replica_whose_target_changed_drops_the_records(tok, tmp_path):
    """New weights at the same path (a retrained target): the records are the old target's distributions,
    and training on them would fit the draft to a model no longer served."""
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "mode": "full", "trigger_records": 1000}, wandb={"mode": "disabled"})
    target = llama(len(tok), seed=3)
    for weights, kept in ((target, 0), (target, 2), (perturbed(target, 0.05, seed=9), 0)):
        svc = SpecService(cfg, models=(weights, perturbed(target, 0.05), tok), replica_tag="r", private_versions=True)
        try:
            assert len(svc.distillers["default"].buffer.shard("default").records) == kept
            asyncio.run(_serve(svc, PROMPTS[:2]))
        finally:
            svc.close()
