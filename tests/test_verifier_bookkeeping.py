"""The Verifier deployment's bookkeeping (deployments/disagg.py), over stand-ins for its core and
telemetry: which sequences count as live (the running counts of /admin/experts and the distill
controller's heartbeat), the draft version it reports, the released ids it remembers, and how the
sequences released on it ended."""

from __future__ import annotations

import asyncio
import time

import pytest


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


def _verifier(monkeypatch, now: list[float]):
    """A Verifier's bookkeeping over a core that accepts nothing, on a clock the test sets (now[0]).
    Returns (verifier, its verify batch body, its telemetry's version events)."""
    from collections import Counter, OrderedDict, defaultdict
    from types import SimpleNamespace

    import deployments.disagg as dd
    from osd_serve.disagg import Verdict

    cls, events = dd.Verifier.func_or_class, []
    monkeypatch.setattr(dd, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter))
    core = SimpleNamespace(verify=lambda items: ([Verdict([7], 0, 0) for _ in items], {}), release=lambda seq_id: None)
    telemetry = SimpleNamespace(on_step=lambda *a: None, on_request=lambda *a: None,
                                on_event=lambda expert, version, **kw: events.append((expert, version, *kw.values())))
    v = SimpleNamespace(live={}, released=OrderedDict(), versions={}, finished=defaultdict(Counter), recomputed=0,
                        core=core, telemetry=telemetry, rolled={})
    v._rolled_from = lambda it, t: cls._rolled_from(v, it, t)

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


def test_a_rollback_the_router_makes_is_one_row_and_shown_at_once(monkeypatch):
    """Disaggregated, a rollback wrote no rollback row (the colocated replica writes one), and
    serving_version and the version rows changed only when a proposal from the version came; proposals
    from replicas not yet swapped then flipped the row back and forth."""
    pytest.importorskip("ray.serve")
    import deployments.disagg as dd

    now = [0.0]
    v, verify, events = _verifier(monkeypatch, now)
    note = dd.Verifier.func_or_class.note_rollback

    async def main():
        await verify([_item("s1", [5], 3)])
        await note(v, "sql", 1, 3)  # back to 1 while 3 was the newest version kept
        assert v.versions == {"sql": 1} and events == [("sql", 3), ("sql", 1, 1)]  # no traffic needed
        await verify([_item("s1", [5], 3), _item("s2", [5], 1), _item("s3", [6], 2)])  # replicas swapping
        assert v.versions == {"sql": 1} and events == [("sql", 3), ("sql", 1, 1)]
        await verify([_item("s1", [5], 4)])  # a version published since the rollback
        assert v.versions == {"sql": 4} and events[-1] == ("sql", 4)
        now[0] = dd.ROLLBACK_GRACE_S + 1  # past the grace, any version change is a row again
        await verify([_item("s1", [5], 2)])
        assert v.versions == {"sql": 2} and events[-1] == ("sql", 2)

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
