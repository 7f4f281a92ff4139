"""The disaggregated topology's Ray Serve layer (deployments/disagg.py): the router backend's request
lifecycle and set-up, over stand-ins for deployment handles (the core's workers run in-process)."""

from __future__ import annotations

import asyncio
import time

import pytest

from osd_serve.config import SamplingParams
from osd_serve.disagg import DraftWorker, TargetVerifier
from tests.conftest import llama, perturbed


class _Handle:
    """A stand-in for a Ray Serve DeploymentHandle that notes which Serve request each call is a child of."""

    def __init__(self, **methods):
        self.methods, self.calls, self.options_given = methods, [], []

    def options(self, **kwargs):
        self.options_given.append(kwargs)
        return self

    def __getattr__(self, name):
        from ray.serve.context import _get_serve_request_context

        def remote(*args, **kwargs):
            self.calls.append((name, _get_serve_request_context()._internal_request_id))
            return asyncio.ensure_future(self.methods[name](*args, **kwargs))

        return type("Method", (), {"remote": staticmethod(remote)})


def _backend(tok, cfg, fail_verify_every: int = 0):
    """A DisaggBackend ready to serve, whose handles run one DraftWorker and one TargetVerifier here.
    Returns (backend, worker, verifier)."""
    from deployments.disagg import DisaggBackend

    target = llama(len(tok), seed=3)
    worker, verifier = DraftWorker(perturbed(target, 0.05), len(tok)), TargetVerifier(target, len(tok))
    verifier.ends = []  # (expert, finish_reason, record keys) of each release
    verifier.released_ids = []
    n = {"verify": 0}

    async def propose(item):
        return worker.propose([item])[0]

    async def verify(item):
        n["verify"] += 1
        if fail_verify_every and n["verify"] % fail_verify_every == 0:
            raise RuntimeError("verifier replica died (simulated)")
        return verifier.verify([item])[0][0]

    async def release_draft(seq_id):
        worker.release(seq_id)

    async def release_target(seq_id, expert, latency_s, *, finish_reason=None, **record):
        verifier.release(seq_id)
        verifier.released_ids.append(seq_id)
        verifier.ends.append((expert, finish_reason, sorted(record)))

    backend = DisaggBackend(cfg)
    backend.tokenizer, backend.vocab, backend.max_len, backend.eos, backend._ready = tok, len(tok), 512, set(), True
    backend.drafts = _Handle(propose=propose, release=release_draft)
    backend.verifier = _Handle(verify=verify, release=release_target)
    return backend, worker, verifier


@pytest.mark.parametrize("py310", [False, True])
def test_a_request_that_ends_early_still_releases_its_sequence(tok, py310):
    """Ray Serve cancels the child calls a cancelled request still has pending assignment
    (Replica._on_request_cancelled). A client that goes away cancels its request, so its releases
    must not be such children, or the sequence stays live on the Verifier (a flaky e2e failure once).
    py310: the loop's create_task as Python 3.10 has it, with no context keyword (pyproject allows
    3.10, where every release raised a TypeError)."""
    serve_context = pytest.importorskip("ray.serve.context")
    from deployments.config import AppConfig

    backend, worker, verifier = _backend(tok, AppConfig())

    async def run():
        if py310:
            loop = asyncio.get_running_loop()
            create_task = loop.create_task
            loop.create_task = lambda coro, *, name=None: create_task(coro, name=name)
        serve_context._serve_request_context.set(serve_context._RequestContext(_internal_request_id="parent"))
        stream = backend.stream("default", "def g(", SamplingParams(max_tokens=200, num_speculative_tokens=3, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # the client went away
        for _ in range(1000):  # the releases run in the background
            if sum(name == "release" for name, _ in backend.drafts.calls + backend.verifier.calls) == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)

    asyncio.run(run())
    calls = backend.drafts.calls + backend.verifier.calls
    assert {("propose", "parent"), ("verify", "parent")} <= set(calls)  # the steps are the request's own calls
    releases = [parent for name, parent in calls if name == "release"]
    assert len(releases) == 2 and "parent" not in releases
    assert not verifier.caches.tokens and not worker.caches.tokens  # both sides freed the sequence
    # unfinished (left out of latency), with its replay record as keywords (distillation is on)
    assert verifier.ends == [("default", None, ["output_ids", "prompt_ids"])]
    # Every call, releases included, goes through handles carrying the sequence's routing keys: the
    # expert (Serve's multiplexing: a call without it reaches a replica as expert '') and the sequence
    # id (the Verifier's consistent hashing: without it every step lands on any replica and recomputes
    # the whole history). The stand-in handles ignore both, so only this looks.
    assert backend.drafts.options_given == [{"multiplexed_model_id": "default"}]
    assert backend.verifier.options_given == [{"session_id": verifier.released_ids[0]}]


def test_the_router_sets_up_once_off_its_event_loop(monkeypatch):
    """The first request loads the tokenizer, and on a node without the default pair builds it
    (minutes): in a thread, once, while the event loop keeps answering (/health included)."""
    pytest.importorskip("ray.serve")
    import time
    from types import SimpleNamespace

    import deployments.disagg as dd
    from deployments.config import AppConfig

    loads = []
    monkeypatch.setattr(dd.DisaggBackend, "_load", lambda self: (loads.append(1), time.sleep(0.5)))
    monkeypatch.setattr(dd.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    monkeypatch.setattr(dd.serve, "get_deployment_handle", lambda name, app: (name, app))
    backend = dd.DisaggBackend(AppConfig())

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while not backend._ready:
                ticks += 1
                await asyncio.sleep(0.01)

        await asyncio.gather(backend._ensure_ready(), backend._ensure_ready(), ticker())
        return ticks

    assert asyncio.run(run()) > 10 and loads == [1]
    assert backend.drafts == ("DraftPool", "app") and backend.verifier == ("Verifier", "app")


def test_health_sets_the_router_up_and_needs_both_deployments_running(tok, monkeypatch):
    """/health is what a load balancer waits on before sending requests, so it sets up (a check that
    times out leaves the set-up running; a failed one runs again) and then needs a running DraftPool
    and Verifier replica."""
    pytest.importorskip("ray.serve")
    import time
    from types import SimpleNamespace

    import deployments.disagg as dd
    from deployments.config import AppConfig

    asked = []

    class Readiness:  # the controller's count, as asked for
        def __init__(self, deployments):
            self.deployments = deployments

        async def check(self):
            asked.append(self.deployments)

    monkeypatch.setattr(dd, "Readiness", Readiness)
    ready, _, _ = _backend(tok, AppConfig())
    asyncio.run(ready.ready())
    assert asked == [["DraftPool", "Verifier"]]

    loads = []

    def load(self):
        loads.append(1)
        time.sleep(0.3)
        if len(loads) == 1:
            raise OSError("no such model (simulated)")

    monkeypatch.setattr(dd.DisaggBackend, "_load", load)
    monkeypatch.setattr(dd.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    monkeypatch.setattr(dd.serve, "get_deployment_handle", lambda name, app: (name, app))
    backend = dd.DisaggBackend(AppConfig())

    async def run():
        # /health needs no key: the load's message (model paths, hosts) stays in the log
        with pytest.raises(RuntimeError, match=r"^the router's set-up failed \(OSError\); its log says why$"):
            await backend.ready()
        with pytest.raises(TimeoutError):  # the second set-up takes longer than this check waits
            await asyncio.wait_for(backend.ready(), 0.05)
        await backend.ready()  # the same set-up, finished: no third load

    asyncio.run(run())
    assert loads == [1, 1] and backend._ready and len(asked) == 2


def test_readiness_reads_the_controllers_replica_count_one_call_at_a_time(monkeypatch):
    """Not a call to a replica: one at max_ongoing_requests would queue it, and every router would
    report a merely loaded server as down. And not one controller call per probe on the replica's
    shared threads: with the controller slow, each probe left a blocked thread behind, the disaggregated
    router's prompt encoding starved (its completions hung) and every router read as down at once."""
    pytest.importorskip("ray.serve")
    import threading
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentStatus

    import deployments.app as app

    def status(**deps):
        d = {name: SimpleNamespace(status=st, message=msg, replica_states=states) for name, (st, msg, states) in deps.items()}
        return SimpleNamespace(applications={"osd": SimpleNamespace(deployments=d)})

    calls, now, gate = [], {}, threading.Event()
    gate.set()

    def serve_status():
        calls.append(threading.current_thread().name)
        gate.wait(30)  # bounded: a failing assertion leaves no thread blocked for the rest of the run
        return now["status"]

    # Readiness's clock is a fake one, stepped by the test: an answer's age is what the test says, not
    # what a loaded machine's scheduling makes it. REFRESH_S is also how long (real time) a check waits
    # for a refresh: long where the controller answers, so each refresh lands however slow the thread
    # is to run; short only where the controller is blocked, where the wait times out whatever the timing.
    clock = [1000.0]
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: SimpleNamespace(app_name="osd"))
    monkeypatch.setattr(app.serve, "status", serve_status)
    monkeypatch.setattr(app, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(app.Readiness, "REFRESH_S", 5.0)
    monkeypatch.setattr(app.Readiness, "GRACE_S", 30.0)
    failed = (DeploymentStatus.DEPLOY_FAILED, "replica failed to start: Traceback ... /home/u/models/secret", {"STARTING": 1})
    healthy = (DeploymentStatus.HEALTHY, "", {"RUNNING": 2})

    async def answers():
        r = app.Readiness(["SpecServer"])
        now["status"] = status(SpecServer=failed)
        with pytest.raises(RuntimeError, match=r"^SpecServer has no running replica \(DEPLOY_FAILED; `serve status` says why\)$"):
            await r.check()  # the first check waits for the controller's answer; /health needs no key: no traceback
        now["status"] = status(SpecServer=healthy)
        n = len(calls)
        for _ in range(10):  # within REFRESH_S of an answer: that answer, no new call
            clock[0] += 0.25
            with pytest.raises(RuntimeError, match="DEPLOY_FAILED"):
                await r.check()
        assert len(calls) == n
        clock[0] += 3  # 5.5 s after the answer: past REFRESH_S
        assert await r.check() is None  # a stale answer is refreshed, and this probe sees the new one
        assert len(calls) == n + 1
        now["status"] = status(SpecServer=(DeploymentStatus.UNHEALTHY, "", {}))
        clock[0] += 31  # probes further apart than GRACE_S, the controller fine: no warning
        with pytest.raises(RuntimeError, match=r"^SpecServer has no running replica \(UNHEALTHY; `serve status` says why\)$"):
            await r.check()

    asyncio.run(answers())

    def broken():
        raise ConnectionError("controller unreachable")

    async def first_call_fails():
        monkeypatch.setattr(app.serve, "status", broken)
        with pytest.raises(RuntimeError, match=r"^the Serve controller's status failed: ConnectionError$"):
            await app.Readiness(["SpecServer"]).check()
        monkeypatch.setattr(app.serve, "status", serve_status)

    asyncio.run(first_call_fails())

    async def slow_controller():
        r = app.Readiness(["DraftPool", "Verifier"])
        now["status"] = status(DraftPool=(DeploymentStatus.UPDATING, "", {"STARTING": 1, "RUNNING": 1}))
        with pytest.raises(RuntimeError, match=r"^Verifier has no running replica \(not deployed\)"):
            await r.check()
        now["status"] = status(DraftPool=(DeploymentStatus.HEALTHY, "", {"RUNNING": 1}),
                               Verifier=(DeploymentStatus.UPDATING, "", {"STARTING": 1, "RUNNING": 1}))
        clock[0] += 6
        assert await r.check() is None
        gate.clear()  # the controller stops answering
        monkeypatch.setattr(app.Readiness, "REFRESH_S", 0.1)  # each probe's wait times out: no answer can come
        clock[0] += 6
        n = len(calls)
        answers = await asyncio.gather(*(r.check() for _ in range(20)))  # a burst of probes, the answer stale
        assert answers == [None] * 20  # the last answer stands
        for _ in range(500):  # until the pool's thread has taken the call (no sleep of a guessed length)
            if len(calls) > n:
                break
            await asyncio.sleep(0.01)
        assert len(calls) == n + 1 and r._pool._work_queue.qsize() == 0  # one call outstanding, none queued
        clock[0] += 31
        # past GRACE_S: still the last answer (serving goes on without the controller), with a warning
        assert await r.check() == "the Serve controller has not answered for 37 s"
        monkeypatch.setattr(app.Readiness, "REFRESH_S", 5.0)  # the answer comes: this check waits for it
        gate.set()
        assert await r.check() is None
        assert len(calls) == n + 1 and set(calls) == {"osd-readiness_0"}  # its own thread, never the replica's shared pool

    asyncio.run(slow_controller())


def test_readiness_keeps_its_last_answer_through_a_failing_controller(monkeypatch):
    """A controller call that raises is not a 503: the last answer stands (serving goes on without the
    controller) and, past GRACE_S, comes with a warning that gives the failure; the next good answer
    clears it. The first check waits for the first answer however long it takes (there is none to
    stand). Readiness's clock is a fake one here, stepped by the test."""
    pytest.importorskip("ray.serve")
    import threading
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentStatus

    import deployments.app as app

    running = SimpleNamespace(status=DeploymentStatus.HEALTHY, message="", replica_states={"RUNNING": 1})
    healthy = SimpleNamespace(applications={"osd": SimpleNamespace(deployments={"SpecServer": running})})
    clock, gate, fail = [1000.0], threading.Event(), [False]

    def serve_status():
        gate.wait(10)  # closed: a controller slow to answer
        if fail[0]:
            raise ConnectionError("controller unreachable")
        return healthy

    monkeypatch.setattr(app.serve, "get_replica_context", lambda: SimpleNamespace(app_name="osd"))
    monkeypatch.setattr(app.serve, "status", serve_status)
    monkeypatch.setattr(app, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(app.Readiness, "GRACE_S", 30.0)

    async def run():
        r = app.Readiness(["SpecServer"])
        monkeypatch.setattr(app.Readiness, "REFRESH_S", 0.1)
        first = asyncio.ensure_future(r.check())
        await asyncio.sleep(0.5)
        assert not first.done()  # still waiting for the first answer, past REFRESH_S
        gate.set()
        assert await first is None
        # REFRESH_S of real time is how long a check waits for a refresh: long, so each lands
        monkeypatch.setattr(app.Readiness, "REFRESH_S", 5.0)
        fail[0], clock[0] = True, clock[0] + 6
        assert await r.check() is None  # the refresh raised: the last answer stands
        clock[0] += 40
        assert await r.check() == "the Serve controller has not answered for 46 s (ConnectionError)"
        fail[0], clock[0] = False, clock[0] + 6
        assert await r.check() is None  # answered again
        monkeypatch.setattr(app.Readiness, "REFRESH_S", 0.1)
        gate.clear()  # slow now, not failing: the earlier failure is not this warning's cause
        clock[0] += 40
        assert await r.check() == "the Serve controller has not answered for 40 s"
        gate.set()

    asyncio.run(run())


def test_a_failed_step_ends_the_request_with_the_apis_error(tok):
    """A verify call that raised (a replica died, a batch failed) escaped the backend: a bare text 500,
    or a stream cut off with no error event and no [DONE]. Now it ends as a colocated failure does."""
    pytest.importorskip("ray.serve")
    from fastapi.testclient import TestClient

    from deployments.api import make_app
    from deployments.config import AppConfig

    cfg = AppConfig(distill={"enabled": False})
    backend, _, verifier = _backend(tok, cfg, fail_verify_every=3)
    client = TestClient(make_app(backend, cfg))
    body = {"prompt": "def g(", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    events = client.post("/v1/completions", json=body | {"stream": True}).text.strip().split("\n\n")
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
    for _ in range(1000):  # the releases run in the background, after the response
        if len(verifier.ends) == 2:
            break
        time.sleep(0.01)
    # released as failed, not as a client gone away ("abort" in /admin/experts' finished counts)
    assert [finish for _, finish, _ in verifier.ends] == ["error", "error"]


def test_chat_without_a_limit_runs_to_the_end_of_the_context_disaggregated(tok):
    """max_tokens unset (chat's default) is resolved where the router tokenizes the prompt: the rest of
    max_model_len, as colocated (test_http), not an unbounded request the Verifier would run past."""
    pytest.importorskip("ray.serve")
    from fastapi.testclient import TestClient

    from deployments.api import make_app
    from deployments.config import AppConfig

    cfg = AppConfig(distill={"enabled": False})
    backend, _, verifier = _backend(tok, cfg)
    backend.max_len = 40
    client = TestClient(make_app(backend, cfg))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert r.json()["usage"]["total_tokens"] == 40 and r.json()["usage"]["completion_tokens"] > 16
    # the release tells the Verifier how the request ended (latency counts stop/length only)
    for _ in range(1000):  # the release runs in the background, after the response
        if verifier.ends:
            break
        time.sleep(0.01)
    assert verifier.ends == [("default", "length", [])]


def test_a_verifier_replica_finishes_its_wandb_run_when_serve_stops_it():
    """Ray Serve calls a replica's __del__ at shutdown. SpecServer closed its telemetry there and the
    Verifier did not, so its last window never reached W&B and the run was left unfinished."""
    from types import SimpleNamespace

    from deployments.disagg import Verifier

    cls = Verifier.func_or_class
    replica, closed = object.__new__(cls), []
    replica.telemetry = SimpleNamespace(close=lambda: closed.append(True))
    cls.__del__(replica)
    assert closed == [True]
    cls.__del__(object.__new__(cls))  # a replica whose __init__ failed before its telemetry: nothing to close
