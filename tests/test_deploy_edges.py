"""Edges of the Ray Serve deployments (deployments/disagg.py) run without a Ray cluster: DraftPool's
expert workers under Ray Serve's own multiplexing cache (ray.serve.multiplex), whose metrics, replica
context and controller pushes are stubbed out; its load and LRU-eviction code is Ray's own."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from types import SimpleNamespace

import pytest

from tests.conftest import llama

pytest.importorskip("ray.serve")


class _Metric:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # inc, set, observe: no-ops here
        return lambda *args, **kwargs: None


class _Pusher:  # Ray's MetricsPusher pushes loaded model ids to a controller there is none of here
    def register_or_update_task(self, *args):
        pass

    def start(self):
        pass


def _pool(monkeypatch, cap: int, distill: dict | None = None, **args):
    """A DraftPool over a tiny draft, with experts a and b, whose multiplexing cache holds `cap` experts
    (distill: the config's section, off by default; args: other config keys). Returns (pool, the multiplexing cache, the experts' loads)."""
    import ray.serve.multiplex as mux

    import deployments.disagg as dd
    from deployments.config import AppConfig

    monkeypatch.setattr(mux, "_get_internal_replica_context",
                        lambda: SimpleNamespace(app_name="app", deployment="DraftPool", replica_id="r1"))
    monkeypatch.setattr(mux, "metrics", SimpleNamespace(Histogram=_Metric, Gauge=_Metric, Counter=_Metric))
    monkeypatch.setattr(mux, "MetricsPusher", _Pusher)
    monkeypatch.setattr(dd, "_load", lambda cfg, role: (llama(50, hidden=16, layers=1), 50, 256))
    cfg = AppConfig(distill=distill or {"enabled": False}, experts=[{"name": "a"}, {"name": "b"}], default_expert="a", **args)
    pool = dd.DraftPool.func_or_class(cfg.model_dump())
    loads = []
    new_worker = pool._new_worker
    pool._new_worker = lambda expert: (loads.append(expert), new_worker(expert))[1]
    # the cache get_worker makes on its first call, made here with a cap the test can reach
    cache = mux._ModelMultiplexWrapper(dd.DraftPool.func_or_class.get_worker.__wrapped__, pool, cap)
    setattr(pool, "__serve_multiplex_wrapper", cache)
    return pool, cache, loads


def _as_request_for(expert: str) -> None:
    """What a call made with .options(multiplexed_model_id=expert) sees as serve.get_multiplexed_model_id()."""
    from ray.serve import context

    context._serve_request_context.set(context._RequestContext(multiplexed_model_id=expert))


def test_an_expert_evicted_by_the_multiplexing_cap_frees_its_draft(monkeypatch):
    """Ray Serve evicts the least recently used expert past max_num_models_per_replica by dropping its
    reference (and calling __del__, which a DraftWorker has none of). DraftPool.workers kept a strong
    one, so every expert ever served stayed loaded, draft copy and KV caches, and the cap did nothing."""
    pool, cache, loads = _pool(monkeypatch, cap=1)

    async def run():
        a = await pool.get_worker("a")
        gone = weakref.ref(a)
        del a
        b = await pool.get_worker("b")  # past the cap: a is evicted
        assert list(cache.models) == ["b"]
        gc.collect()
        assert gone() is None, "the evicted expert's worker is still referenced"
        assert dict(pool.workers) == {"b": b}
        # a published version for the evicted expert is skipped, not an error on the watcher's thread
        pool._swap("a", {}, 3)
        assert await pool.get_worker("a") is pool.workers["a"] and loads == ["a", "b", "a"]

    asyncio.run(run())


def test_a_release_for_an_expert_not_loaded_here_loads_nothing(monkeypatch):
    """The release of a sequence whose expert this replica does not hold (evicted, or the release
    routed to another replica) went through get_worker: it built a whole draft, evicting another
    expert, to free nothing."""
    pool, cache, loads = _pool(monkeypatch, cap=1)
    from osd_serve.disagg import ProposeItem, Sampling

    async def run():
        _as_request_for("b")
        await pool.release("seq-1")
        assert loads == [] and list(cache.models) == []
        # where the expert is loaded, the release frees its sequence
        _as_request_for("a")
        worker = await pool.get_worker("a")
        worker.propose([ProposeItem("seq-2", [5, 6, 7], 2, Sampling())])
        assert "seq-2" in worker.caches.tokens
        await pool.release("seq-2")
        assert "seq-2" not in worker.caches.tokens and loads == ["a"]

    asyncio.run(run())


def test_a_release_while_its_expert_loads_is_not_lost(monkeypatch):
    """A client gone while its sequence's first proposal waits for the expert to load: the release found
    no worker and did nothing, then the proposal made the sequence's cache row, which stayed until it
    idled out (IDLE_ROW_S) or max_seqs pushed it out. The same when a release overtakes a proposal
    still in the batch queue."""
    pool, cache, loads = _pool(monkeypatch, cap=1)
    pool.cfg = pool.cfg.model_copy(update={"draft_ahead": True})  # on a CPU too: nothing drafted ahead for it either
    from osd_serve.disagg import ProposeItem, Sampling

    started, gate = threading.Event(), threading.Event()
    load = pool._new_worker
    pool._new_worker = lambda expert: (started.set(), gate.wait(10), load(expert))[2]
    propose = type(pool).propose.__wrapped__  # the batch body Serve calls with the batch's items

    async def run():
        _as_request_for("a")
        proposing = asyncio.ensure_future(propose(pool, [ProposeItem("seq-1", [5, 6, 7], 2, Sampling())]))
        assert await asyncio.to_thread(started.wait, 10)  # the expert is loading, the proposal waits on it
        await pool.release("seq-1")
        gate.set()
        await proposing
        await pool._run(lambda: None)  # after anything the proposal queued on the torch thread
        worker = pool.workers["a"]
        assert "seq-1" not in worker.caches.tokens and "seq-1" not in worker._ahead and loads == ["a"]

    asyncio.run(run())


def test_the_versions_of_an_evicted_expert_are_not_read(monkeypatch, tmp_path):
    """The version watcher polled every expert the replica had ever loaded: each version the cluster
    distiller published for one the multiplexing cap had evicted was read in full (a whole draft) and
    dropped by _swap. Loaded again, the expert serves the store's current version."""
    from osd_serve.distill import versions

    pool, cache, loads = _pool(monkeypatch, cap=1, distill={"backend": "ray_train", "versions_dir": str(tmp_path)})
    pool.watcher.poll_s = 3600  # polled by hand below
    reads = []
    load_file = versions.load_file
    monkeypatch.setattr(versions, "load_file", lambda path: (reads.append(path), load_file(path))[1])

    async def run():
        await pool.get_worker("a")
        await pool.get_worker("b")  # past the cap: a is evicted
        gc.collect()
        trained = {n: t + 1 for n, t in pool.base.state_dict().items()}
        assert versions.VersionStore(tmp_path / "a").publish(trained) == 1  # the cluster distiller
        pool.watcher.poll()
        assert reads == [], "an evicted expert's version was read"
        assert (await pool.get_worker("a")).version == 1 and len(reads) == 1 and loads == ["a", "b", "a"]
        pool.watcher.poll()
        assert len(reads) == 1

    asyncio.run(run())


def test_a_torch_call_that_hangs_past_the_stall_timeout_fails_the_health_check(monkeypatch):
    """DraftPool and Verifier had no check_health: a torch call that hung (a CUDA hang) left the event
    loop free, so Serve's liveness ping passed, the replica was never replaced and every request
    whose step it held waited until its client left. Past stall_timeout_s the check raises."""
    pool, _, _ = _pool(monkeypatch, cap=2, stall_timeout_s=1.5)  # "not yet past" below must not flake on a paused runner
    from osd_serve.disagg import ProposeItem, Sampling

    gate, entered = threading.Event(), threading.Event()

    async def run():
        _as_request_for("a")
        worker = await pool.get_worker("a")
        propose = worker.propose

        def hung(items):
            entered.set()
            gate.wait(10)
            return propose(items)

        worker.propose = hung
        await pool.check_health()  # idle: healthy
        call = asyncio.ensure_future(pool._run(pool._propose, worker, [ProposeItem("s", [5, 6, 7], 2, Sampling())]))
        assert await asyncio.to_thread(entered.wait, 10)
        await pool.check_health()  # running, not yet past the limit
        await asyncio.sleep(2.0)
        with pytest.raises(RuntimeError, match=r"a torch call has run for \d+ s \(stall_timeout_s is 1.5\)"):
            await pool.check_health()
        gate.set()
        assert len((await call)[0].tokens) == 2
        await pool.check_health()  # it returned: healthy again

    try:
        asyncio.run(run())
    finally:
        gate.set()
