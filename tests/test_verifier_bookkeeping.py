"""The Verifier deployment's bookkeeping (deployments/disagg.py), over stand-ins for its core and
telemetry: which sequences count as live (the running counts of /admin/experts and the distill
controller's heartbeat), the draft version it reports, the released ids it remembers, and how the
sequences released on it ended."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch


def test_the_verifier_stops_counting_a_sequence_whose_release_never_came(monkeypatch):
    pytest.importorskip("ray.serve")
    import deployments.disagg as dd

    v = type("V", (), {})()
    v.live = {"a": ("default", 0.0), "b": ("sql", 500.0)}  # least recently verified first, as verify keeps it
    forget = dd.Verifier.func_or_class._forget_idle
    forget(v, 550.0)  # a verified 550 s ago, b 50 s ago: both within IDLE_SEQUENCE_S
    assert list(v.live) == ["a", "b"]
    forget(v, 601.0)
    assert v.live == {"b": ("sql", 500.0)}
    forget(v, 1101.0)
    assert v.live == {}


def _verifier(monkeypatch, now: list[float], versions_dir=None, distill: bool = True):
    """A Verifier's bookkeeping over a core that accepts nothing, on a clock the test sets (now[0]), its
    versions under versions_dir (default: none published). Returns (verifier, its verify batch body, its
    telemetry's version events)."""
    from collections import Counter, OrderedDict, defaultdict
    from types import SimpleNamespace

    import deployments.disagg as dd
    from osd_serve.disagg import Verdict

    cls, events = dd.Verifier.func_or_class, []
    monkeypatch.setattr(dd, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter))
    monkeypatch.setattr(dd, "_versions_dir", lambda cfg: versions_dir or Path("/nonexistent/osd-versions"))
    core = SimpleNamespace(verify=lambda items: ([Verdict([7], 0, 0) for _ in items], {}), release=lambda seq_id: None)
    telemetry = SimpleNamespace(on_step=lambda *a: None, on_request=lambda *a: None,
                                on_event=lambda expert, version, **kw: events.append((expert, version, *kw.values())))
    v = SimpleNamespace(live={}, released=OrderedDict(), versions={}, finished=defaultdict(Counter), recomputed=0,
                        core=core, telemetry=telemetry, store_manifest={},
                        cfg=SimpleNamespace(distill=SimpleNamespace(enabled=distill)))
    v._note_version = lambda expert, version, t: cls._note_version(v, expert, version, t)

    async def run(fn, *args):
        return fn(*args)

    v._run, v._forget_idle, v._verify = run, lambda t: cls._forget_idle(v, t), lambda items: cls._verify(v, items)
    v._free_released = lambda items, release: cls._free_released(v, items, release)
    return v, lambda items: cls.verify.__wrapped__(v, items), events


def _item(seq_id: str, draft: list[int], version: int, expert: str = "sql"):
    from osd_serve.disagg import Sampling, VerifyItem

    return VerifyItem(seq_id, [3, 4], draft, None, Sampling(), expert, draft_version=version)


def test_the_verifier_labels_the_draft_version_from_proposals_only(monkeypatch):
    """serving_version (/admin/experts) is the draft version of the latest proposal verified. A step
    with no draft (k = 0: the last token of a request, or num_speculative_tokens 0) carries version 0,
    the router's default for no proposal: it must not relabel the expert as served by version 0."""
    pytest.importorskip("ray.serve")
    v, verify, events = _verifier(monkeypatch, [0.0])

    async def main():
        await verify([_item("s1", [5], 2)])
        assert v.versions == {"sql": 2} and events == [("sql", 2)]
        await verify([_item("s1", [], 0), _item("s2", [5, 6], 2)])  # no draft: no label
        assert v.versions == {"sql": 2} and events == [("sql", 2)]
        await verify([_item("s2", [5], 3)])  # a swap reached the DraftPool
        assert v.versions == {"sql": 3} and events == [("sql", 2), ("sql", 3)]

    asyncio.run(main())


def _store(tmp_path, versions: int):
    """The shared store of expert sql with versions 0..versions-1 published, the last current."""
    from osd_serve.distill.versions import VersionStore

    store = VersionStore(tmp_path / "sql")
    for i in range(versions):
        store.publish({"w": torch.full((1,), float(i))})
    return store


def test_a_rollback_the_router_makes_is_one_row_and_shown_at_once(monkeypatch, tmp_path):
    """Disaggregated, a rollback wrote no rollback row (the colocated replica writes one), and
    serving_version and the version rows changed only when a proposal from the version came; proposals
    from replicas not yet swapped then flipped the row back and forth, and did again once a grace of 30 s
    had passed. A version is now logged only when it is the shared store's current one."""
    pytest.importorskip("ray.serve")
    import deployments.disagg as dd

    now, store = [0.0], _store(tmp_path, 4)
    v, verify, events = _verifier(monkeypatch, now, tmp_path)
    note = dd.Verifier.func_or_class.note_rollback

    async def main():
        await verify([_item("s1", [5], 3)])
        store.rollback(1, load=False)  # the Router's
        await note(v, "sql", 1)  # back to 1: no traffic needed
        assert v.versions == {"sql": 1} and events == [("sql", 3), ("sql", 1, 1)]
        await verify([_item("s1", [5], 3), _item("s2", [5], 1), _item("s3", [6], 2)])  # replicas swapping
        assert v.versions == {"sql": 1} and events == [("sql", 3), ("sql", 1, 1)]
        now[0] = 100.0  # long after: a replica still on 3 (its swap failed) is no version change either
        await verify([_item("s1", [5], 3)])
        assert v.versions == {"sql": 1} and len(events) == 2
        store.publish({"w": torch.zeros(1)})  # v4, trained on from 1
        now[0] = 100.5  # the store was read 0.5 s ago: v4 waits for the next read
        await verify([_item("s1", [5], 4)])
        assert v.versions == {"sql": 1}
        now[0] = 101.5
        await verify([_item("s2", [5], 1), _item("s1", [5], 4), _item("s3", [5], 1)])
        assert v.versions == {"sql": 4} and events[2:] == [("sql", 4)]

    asyncio.run(main())


def test_every_verifier_replica_logs_a_rollback_and_none_flips_on_a_publish(monkeypatch, tmp_path):
    """The Router tells one Verifier replica of a rollback; the others logged the version rolled back to as a
    plain version row, and after a publish, proposals from DraftPool replicas not yet swapped flipped every
    replica's row back to the old version and forward again."""
    pytest.importorskip("ray.serve")
    now, store = [0.0], _store(tmp_path, 3)
    v, verify, events = _verifier(monkeypatch, now, tmp_path)

    async def main():
        await verify([_item("s1", [5], 2)])
        store.publish({"w": torch.ones(1)})  # v3
        for t, version in [(2.0, 3), (2.1, 2), (2.2, 3), (2.3, 2), (4.0, 2), (4.1, 3)]:  # two DraftPool replicas
            now[0] = t
            await verify([_item("s1", [5], version)])
        assert v.versions == {"sql": 3} and events == [("sql", 2), ("sql", 3)]
        store.rollback(1, load=False)  # told to another Verifier replica
        for t, version in [(6.0, 3), (6.1, 1), (6.2, 3), (8.0, 1)]:
            now[0] = t
            await verify([_item("s1", [5], version)])
        assert v.versions == {"sql": 1} and events == [("sql", 2), ("sql", 3), ("sql", 1, 1)]

    asyncio.run(main())


def test_version_rows_without_a_store_a_cleared_one_or_distillation(monkeypatch, tmp_path):
    """Distillation off over a store an earlier deploy left (current 3): the proposals' version 0 was never
    logged, and serving_version stayed empty. A store cleared for a new draft numbers from 0 again: a drop
    to its version 0 is no rollback. The first version a replica sees is logged whatever the store says."""
    pytest.importorskip("ray.serve")
    from osd_serve.disagg import version_row

    now, store = [0.0], _store(tmp_path, 4)
    v, verify, events = _verifier(monkeypatch, now, tmp_path, distill=False)
    fresh, verify_fresh, fresh_events = _verifier(monkeypatch, now, tmp_path)

    async def main():
        for t in (0.0, 2.0):
            now[0] = t
            await verify([_item("s1", [5], 0)])
            await verify_fresh([_item("s1", [5], 2)])  # a DraftPool replica whose swap to 3 failed
        assert v.versions == {"sql": 0} and events == [("sql", 0)]
        assert fresh.versions == {"sql": 2} and fresh_events == [("sql", 2)]
        await verify_fresh([_item("s1", [5], 3)])
        store.clear()
        store.publish({"w": torch.zeros(1)}, draft="another draft")
        now[0] = 5.0
        await verify_fresh([_item("s1", [5], 0)])
        assert fresh_events == [("sql", 2), ("sql", 3), ("sql", 0)]  # no rollback mark

    asyncio.run(main())
    kept = {"current": 1, "versions": [0, 1, 3]}
    assert version_row(1, 3, kept) == {"version": 1, "rollback": 1} and version_row(3, 1, kept) is None
    assert version_row(1, 3, None) == {"version": 1} and version_row(0, None, kept) is None


def test_a_store_read_that_straddles_a_rollback_does_not_undo_it(monkeypatch, tmp_path):
    """A manifest read begun before the Router's rollback and ended after note_rollback stored the old
    current version as fresh: for a second, proposals from replicas not yet swapped back were rows again."""
    pytest.importorskip("ray.serve")
    import deployments.disagg as dd

    now, store = [0.0], _store(tmp_path, 4)
    v, verify, events = _verifier(monkeypatch, now, tmp_path)
    note, to_thread = dd.Verifier.func_or_class.note_rollback, asyncio.to_thread

    async def read_then_rollback(fn, *args):
        manifest = fn(*args)  # current 3
        store.rollback(1, load=False)  # the Router, meanwhile
        await note(v, "sql", 1)
        return manifest

    async def main():
        await verify([_item("s1", [5], 3)])
        now[0] = 2.0
        monkeypatch.setattr(dd.asyncio, "to_thread", read_then_rollback)
        await verify([_item("s2", [5], 2)])
        monkeypatch.setattr(dd.asyncio, "to_thread", to_thread)
        now[0] = 2.5
        await verify([_item("s3", [5], 3), _item("s4", [5], 1)])  # a replica not yet swapped back, one swapped
        assert v.versions == {"sql": 1} and events == [("sql", 3), ("sql", 1, 1)]

    asyncio.run(main())


def test_the_verifier_counts_live_sequences_by_their_latest_verify(monkeypatch):
    """live (the running counts of /admin/experts and the distill controller's heartbeat, which reads
    len(live) without forgetting anything) holds the sequences verified within IDLE_SEQUENCE_S, least
    recently verified first, and never a released one, even when a verify queued before its release
    comes after it. Unit tests only drove _forget_idle on a hand-made dict, so verify's part (the
    reordering, the forgetting, the released check) passed with any of it removed."""
    pytest.importorskip("ray.serve")
    import deployments.disagg as dd

    now = [0.0]
    v, verify, _ = _verifier(monkeypatch, now)

    async def main():
        await verify([_item("a", [5], 1), _item("b", [5], 1)])
        now[0] = 500.0
        await verify([_item("a", [5], 1)])  # a is recent again: it moves behind b
        assert list(v.live) == ["b", "a"]
        now[0] = 650.0
        await verify([_item("c", [5], 1)])  # b idle 650 s: forgotten here, not only when /admin/experts asks
        assert list(v.live) == ["a", "c"]
        await dd.Verifier.func_or_class.release(v, "c", "sql", 0.1, finish_reason="length")
        await verify([_item("c", [5], 1)])  # queued before the release
        assert list(v.live) == ["a"] and "c" in v.released

    asyncio.run(main())


def test_the_released_ids_a_verifier_remembers_are_bounded_newest_kept(monkeypatch):
    """A replica remembers RELEASED_KEPT released ids (so a verify queued before its release does not
    count the sequence live again), oldest out: the newest release is the one a queued call can still
    race. The bound (4096) is never reached in a test run, so it is lowered here."""
    pytest.importorskip("ray.serve")
    import deployments.disagg as dd

    monkeypatch.setattr(dd, "RELEASED_KEPT", 2)
    v, verify, _ = _verifier(monkeypatch, [0.0])

    async def main():
        for sid in ("s1", "s2", "s3"):
            await dd.Verifier.func_or_class.release(v, sid, "sql", 0.1, finish_reason="stop")
        await verify([_item("s3", [5], 1)])  # queued before its release

    asyncio.run(main())
    assert list(v.released) == ["s2", "s3"] and v.live == {}


def test_the_verifier_counts_released_sequences_by_how_they_ended(monkeypatch):
    """/admin/experts' "finished" (disaggregated): what the router reported at each release, a
    release with no finish_reason being a client that went away."""
    pytest.importorskip("ray.serve")
    import deployments.disagg as dd

    v, verify, _ = _verifier(monkeypatch, [0.0])

    async def main():
        await verify([_item("s1", [5], 2), _item("s3", [5], 2)])
        await dd.Verifier.func_or_class.release(v, "s1", "sql", 0.5, finish_reason="length")
        await dd.Verifier.func_or_class.release(v, "s2", "default", 0.1)  # its client went away
        return await dd.Verifier.func_or_class.running(v)

    assert asyncio.run(main()) == {
        "sql": {"running": 1, "serving_version": 2, "finished": {"stop": 0, "length": 1, "abort": 0, "error": 0}},
        "default": {"running": 0, "serving_version": None, "finished": {"stop": 0, "length": 0, "abort": 1, "error": 0}},
    }
