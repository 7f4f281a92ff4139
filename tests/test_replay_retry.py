"""A retried add(): Ray resubmits an actor call whose process died mid-call (max_task_retries=3) to the
restarted process, with the same record. When the first call had kept the record and its file was
written, the restarted buffer read it back, and before ReplayRecord.rid it kept the retry as a second
copy: trained on twice, and counted twice toward the trigger."""

from __future__ import annotations

import safetensors.torch as st

from osd_serve.distill.spill import RecordSpill
from tests.test_replay_spill import CFG, PAIR, _record, _restarted, _started, actor_cls  # noqa: F401  (a fixture)


def _shard(b, expert="default"):
    return b.buffer.shard(expert)


def test_an_add_retried_after_a_restart_keeps_its_record_once(actor_cls, tmp_path):  # noqa: F811
    b = _started(actor_cls, tmp_path)
    first, other = _record(0), _record(1)
    assert b.add("default", first, 999, PAIR) and b.add("default", other, 999, PAIR)
    again = _restarted(actor_cls, b, tmp_path)  # killed after the first call's file was written
    assert again.add("default", first, 999, PAIR)  # the retry: the caller is told it is kept, as it is
    assert len(_shard(again).records) == 2 and _shard(again).new_since_update == 2 and _shard(again).seen == 2
    assert [r.rid for r in _shard(again).records] == [first.rid, other.rid]
    again.flush()
    assert len(list((tmp_path / "default").glob("*.safetensors"))) == 2  # and no second file
    assert again.add("default", _record(0), 999, PAIR)  # the same tokens in another request: another record
    assert len(_shard(again).records) == 3


def test_a_retry_whose_first_write_was_lost_is_kept(actor_cls, tmp_path):  # noqa: F811
    b = _started(actor_cls, tmp_path)
    rec = _record(0)
    assert b.add("default", rec, 999, PAIR)
    b.flush()
    for f in (tmp_path / "default").glob("*.safetensors"):
        f.unlink()  # killed with the write still queued
    again = _restarted(actor_cls, b, tmp_path)
    assert not _shard(again).records and again.add("default", rec, 999, PAIR)
    assert [r.rid for r in _shard(again).records] == [rec.rid]


def test_a_record_without_an_id_is_never_refused(actor_cls, tmp_path):  # noqa: F811
    """A record pickled by an older osd-serve has no rid: kept at every add, as before."""
    b = _started(actor_cls, tmp_path)
    rec = _record(0)
    del rec.rid
    assert b.add("default", rec, 999, PAIR) and b.add("default", rec, 999, PAIR)
    assert len(_shard(b).records) == 2


def test_the_ids_known_are_bounded(actor_cls, tmp_path, monkeypatch):  # noqa: F811
    import deployments.replay_actor as ra

    monkeypatch.setattr(ra, "RIDS_KEPT", 2)
    b = _started(actor_cls, tmp_path)
    recs = [_record(i) for i in range(3)]
    for r in recs:
        assert b.add("default", r, 999, PAIR)
    assert list(b.rids) == [recs[1].rid, recs[2].rid]
    again = _restarted(actor_cls, b, tmp_path)
    assert list(again.rids) == [recs[1].rid, recs[2].rid]  # the newest, by number, from the files


def test_the_id_is_saved_and_an_older_file_reads_back_with_one_of_its_own(tmp_path):
    spill = RecordSpill(tmp_path)
    recs = [_record(i) for i in range(3)]
    for seq, r in enumerate(recs):
        spill.save(seq, "default", r)
    for path in sorted((tmp_path / "default").glob("*.safetensors"))[1:]:  # written by an older osd-serve
        st.save_file(st.load_file(str(path)), str(path), metadata={"wall": "0.0"})
    back = [s.record.rid for s in spill.load("default")]
    assert back[0] == recs[0].rid
    assert len(set(back)) == 3 and all(len(r) == 32 for r in back) and not {recs[1].rid, recs[2].rid} & set(back)


def test_a_refused_record_or_another_pairs_is_not_known(actor_cls, tmp_path):  # noqa: F811
    """Only a kept record's id is known: a retry of one the buffer refused, or dropped with its pair, is kept."""
    b = _started(actor_cls, tmp_path)
    big, rec = _record(0), _record(1)
    assert not b.add("default", big, 2 << 20, PAIR)  # over the shard's whole bound: refused
    assert b.add("default", big, 999, PAIR) and b.add("default", rec, 999, PAIR)
    b.configure(CFG, ["another", "pair"])  # a redeploy onto another pair empties the buffer
    assert not _shard(b).records and not b.rids
    assert b.add("default", rec, 999, None)  # an older replica's, sending no pair: kept, not answered from memory
    assert [r.rid for r in _shard(b).records] == [rec.rid]
