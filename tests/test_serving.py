"""The asyncio front of the engine (osd_serve/serving.py) under failure: a client gone while its request
is queued, and an engine step that raises, end what they must and leave the server serving."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from deployments.config import AppConfig
from osd_serve.config import SamplingParams
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def service(tok):
    target = llama(len(tok), seed=3)
    cfg = AppConfig(num_speculative_tokens=3, distill={"enabled": False}, wandb={"mode": "disabled"}, api_key="sk")
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    yield svc, cfg
    svc.close()


async def _run(svc, prompt, params=GREEDY, timeout=30.0):
    async def consume():
        return [d async for d in svc.stream("default", prompt, params)]
    return await asyncio.wait_for(consume(), timeout)  # a hang fails here, not the whole suite


def _held_step(eng):
    """Make the engine's next step wait for a gate, so a test can act while the loop thread is busy."""
    gate, entered, step = threading.Event(), threading.Event(), eng.step

    def held():
        entered.set()
        gate.wait(10)
        del eng.step  # back to the class's method
        return step()

    eng.step = held
    return gate, entered


def test_a_request_cancelled_while_queued_leaves_the_loop_serving(service):
    """Cancelling the wait for admission used to cancel the future the loop thread then completed:
    InvalidStateError killed the loop thread, and every request after it hung. The cancelled request
    is aborted as the loop admits it (counted as an abort, never run to its end), and the loop keeps
    no sink for it. The test waits until its add is in the inbox: cancelled while its prompt was still
    being tokenized, it never reached the path under test (which passed with the abort removed)."""
    svc, _ = service
    eng = svc.server.engines["default"]
    before = dict(eng.finished)

    async def scenario():
        gate, entered = _held_step(eng)
        busy = asyncio.create_task(_run(svc, "def g(", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
        assert await asyncio.to_thread(entered.wait, 10)  # the loop thread is now inside busy's first step
        gone = asyncio.create_task(_run(svc, "x = ", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
        while svc.server._inbox.qsize() == 0:  # the held loop drains nothing: its add waits in the inbox
            await asyncio.sleep(0.005)
        gone.cancel()  # it is now awaiting admission, which the held loop cannot give
        await asyncio.gather(gone, return_exceptions=True)
        gate.set()
        await busy
        return await _run(svc, "import os", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))

    out = asyncio.run(scenario())
    assert out[-1]["finish_reason"] == "length"
    _settled(svc)
    assert svc.server._thread.is_alive() and not eng.running and not eng.waiting
    # busy and the last request ran out; the cancelled one was aborted from the queue, not run
    assert eng.finished["abort"] == before.get("abort", 0) + 1
    assert eng.finished["length"] == before.get("length", 0) + 2


def _settled(svc, timeout=5.0):
    """The loop thread forgets a request just after sending its last delta: wait for that."""
    deadline = time.monotonic() + timeout
    while (svc.server._sinks or svc.server._owner) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not svc.server._sinks and not svc.server._owner


def test_a_failed_step_ends_every_request_and_the_engine_serves_on(service, monkeypatch):
    """A step that raises while admitting (an OOM in prefill, say) had already taken its requests out
    of the queue: they must end too, not hang. The engine is reset in place, since distillers and
    version watchers hold it."""
    svc, _ = service
    eng = svc.server.engines["default"]
    admit = type(eng)._admit
    calls = {"n": 0}

    def failing_admit(self):
        calls["n"] += 1
        if calls["n"] == 1 and self.waiting:
            self.waiting.popleft()  # taken out of the queue, then the failure
            raise RuntimeError("simulated failure while admitting")
        return admit(self)

    monkeypatch.setattr(type(eng), "_admit", failing_admit)

    async def scenario():
        return await asyncio.gather(_run(svc, "a = 1"), _run(svc, "b = 2"))

    ends = [out[-1]["finish_reason"] for out in asyncio.run(scenario())]
    # The one taken out ends with an error instead of hanging (the other, if it was queued in time
    # behind it, too); none hangs.
    assert "error" in ends and set(ends) <= {"error", "stop", "length"}, ends
    _settled(svc)
    assert svc.server.engines["default"] is eng and not eng.running and not eng.waiting
    assert asyncio.run(_run(svc, "c = 3"))[-1]["finish_reason"] in ("stop", "length")


def test_a_step_that_fails_mid_request_resets_the_engine_before_the_caller_hears(service, monkeypatch):
    """A step that raises leaves the engine's rows and caches in whatever state it failed in: the
    engine is reset before the failure is delivered, so the caller told "error" finds it empty, and
    the row it was told about is not decoded on for no one (without the reset it ran on to its
    max_tokens and left as a "length", after the caller had its error)."""
    svc, _ = service
    eng = svc.server.engines["default"]
    before = dict(eng.finished)
    step, calls = type(eng).step, {"n": 0}

    def fails_second(self):
        calls["n"] += 1
        if calls["n"] == 2:  # the row is running: admitted and decoding since the first step
            raise RuntimeError("simulated failure mid-request")
        return step(self)

    monkeypatch.setattr(type(eng), "step", fails_second)

    async def scenario():
        seen = []
        async for d in svc.stream("default", "def g(", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)):
            if d["finished"]:  # told now, on the caller's side: the engine must already be empty
                seen.append((d["finish_reason"], len(eng.running), len(eng.waiting)))
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [("error", 0, 0)]
    deadline = time.monotonic() + 30
    while eng.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    _settled(svc)
    assert eng.finished["error"] == before.get("error", 0) + 1
    assert eng.finished["length"] == before.get("length", 0)


def test_http_reports_a_failed_engine_as_a_500_or_a_stream_error(service, monkeypatch):
    svc, cfg = service
    eng = svc.server.engines["default"]

    def broken(self):
        raise RuntimeError("simulated step failure")

    client = TestClient(make_app(svc, cfg))
    auth = {"Authorization": "Bearer sk"}
    monkeypatch.setattr(type(eng), "step", broken)
    r = client.post("/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    with client.stream("POST", "/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 4, "stream": True}) as s:
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert client.post("/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 4}).status_code == 200


class _ReplicaDies:
    """A backend whose call fails as a Ray handle's does when the engine replica dies (ActorDiedError
    is no ValueError): before the first chunk, or after ``after`` chunks."""

    def __init__(self, after: int):
        self.after = after

    def experts(self):
        return ["default"]

    async def stream(self, expert, prompt, params):
        for i in range(self.after):
            yield {"text": "ab"[i % 2], "token_ids": [5], "finished": False, "finish_reason": None, "prompt_tokens": 1}
        raise RuntimeError("The actor died unexpectedly before finishing this task.")

    async def ready(self):
        return None

    async def admin_update(self, expert):
        raise RuntimeError("CUDA out of memory (simulated)")


@pytest.mark.parametrize("after", [0, 2])
def test_a_backend_that_dies_mid_request_gives_the_apis_error_and_ends_the_stream(after):
    """A stream was cut after its last text chunk, with no error event and no [DONE] (a client saw a
    short completion with no finish_reason), and a whole completion was a text/plain 500."""
    client = TestClient(make_app(_ReplicaDies(after), AppConfig(wandb={"mode": "disabled"})), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}) as s:
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    # an admin update that fails (not refused: failed) was a text/plain 500 too
    admin = TestClient(make_app(_ReplicaDies(after), AppConfig(wandb={"mode": "disabled"}, admin_key="adm")),
                       raise_server_exceptions=False)
    r = admin.post("/admin/experts/default/update", headers={"Authorization": "Bearer adm"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "out of memory" in r.text, r.text
    if after == 0:  # nothing was sent yet: a plain 500, as for a whole completion
        assert s.status_code == 500 and not events
    else:
        assert s.status_code == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "ab"


class _Unready:
    """A backend whose engine never answers (no replica yet, or one failing to start) or fails to."""

    def __init__(self, fail: bool):
        self.fail = fail

    def experts(self):
        return ["default"]

    async def ready(self):
        if self.fail:
            raise RuntimeError("The actor died unexpectedly before finishing this task.")
        await asyncio.Event().wait()


@pytest.mark.parametrize("fail", [False, True])
def test_health_is_503_while_the_engine_cannot_serve(fail, monkeypatch):
    """/health answered 200 as soon as the router was up, also while the engine replica was loading or
    failing to start; a load balancer then sent traffic there that got 503s."""
    import deployments.api as api

    monkeypatch.setattr(api, "HEALTH_TIMEOUT_S", 0.2)
    client = TestClient(make_app(_Unready(fail), AppConfig(wandb={"mode": "disabled"}, api_key="sk")))
    for r in (client.get("/health"), client.head("/health")):
        assert r.status_code == 503, r.text
    body = client.get("/health").json()
    assert body["status"] == "unavailable"
    assert ("actor died" in body["error"]) if fail else ("did not finish within 0.2 s" in body["error"]), body


def test_health_follows_the_engine_loop(tok):
    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"enabled": False}, wandb={"mode": "disabled"})
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    client = TestClient(make_app(svc, cfg))
    assert client.get("/health").json() == {"status": "ok"}
    svc.close()
    r = client.get("/health")
    assert r.status_code == 503 and "engine loop is not running" in r.json()["error"], r.text


def test_a_caller_whose_loop_is_gone_does_not_stall_the_others(tok):
    """A sink that raises (its caller's event loop closed) broke off the step's delivery: the other
    requests of that step lost their deltas and waited forever. Now it alone is aborted: its row
    leaves as an abort, not after decoding to its max_tokens for no one (which, with both rows the
    same length, the test could not tell apart from an abort)."""
    import concurrent.futures

    from osd_serve.serving import AsyncSpecServer, _Add

    target = llama(len(tok), seed=0)
    server = AsyncSpecServer(target, tok, {"default": perturbed(target, 0.05)})
    try:
        def gone(d):
            raise RuntimeError("Event loop is closed")

        fut = concurrent.futures.Future()
        params = SamplingParams(max_tokens=12, num_speculative_tokens=3, ignore_eos=True)
        long = SamplingParams(max_tokens=200, num_speculative_tokens=3, ignore_eos=True)
        server._inbox.put(_Add("default", [5, 6, 7], long, "gone", gone, fut))  # as generate() does
        server._wake.set()
        fut.result(timeout=30)

        async def run():
            return [d async for d in server.generate([8, 9, 10], params)]

        deltas = asyncio.run(asyncio.wait_for(run(), 30))
        assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == 12
        eng = server.engines["default"]
        deadline = time.monotonic() + 30
        while eng.has_unfinished() and time.monotonic() < deadline:  # a gone row left running would end by length
            time.sleep(0.01)
        assert not eng.has_unfinished() and "gone" not in server._sinks and "gone" not in server._owner
        assert (eng.finished["abort"], eng.finished["length"]) == (1, 1), dict(eng.finished)
    finally:
        server.close()


def test_closing_the_server_ends_its_requests_and_refuses_new_ones(tok):
    """close() stopped the loop and left every caller waiting forever: a request it held never got a
    final delta, and a generate() after it queued an add no loop would read. An add already queued
    when close() is called (the loop busy in a step) fails too, rather than wait for a drain that
    never comes."""
    from osd_serve.serving import AsyncSpecServer

    target = llama(len(tok), seed=0)
    server = AsyncSpecServer(target, tok, {"default": perturbed(target, 0.05)})
    gate, entered = _held_step(server.engines["default"])
    params = SamplingParams(max_tokens=50, num_speculative_tokens=3, ignore_eos=True)

    async def run():
        async def consume():
            return [d async for d in server.generate([5, 6, 7], params)]
        task = asyncio.create_task(consume())
        await asyncio.to_thread(entered.wait, 10)  # the loop holds the request, inside a step
        queued = asyncio.create_task(anext(server.generate([8, 9], params)))
        while server._inbox.qsize() == 0:  # its add waits in the inbox: the held loop drains nothing
            await asyncio.sleep(0.005)
        closer = threading.Thread(target=server.close)
        closer.start()
        while not server._stop.is_set():
            await asyncio.sleep(0.005)
        gate.set()  # the step ends; the loop sees _stop and exits
        deltas = await asyncio.wait_for(task, 30)
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(queued, 10)
        await asyncio.to_thread(closer.join, 30)
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(anext(server.generate([8, 9], params)), 5)
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finished and deltas[-1].finish_reason == "error"
    assert sum(len(d.token_ids) for d in deltas) < 50


def test_experts_share_one_auto_calibration_and_serve_auto(tok):
    """Experts are one base draft with different adapters: each engine calibrating "auto" for itself
    stalled serving once per expert for the same costs."""
    from osd_serve.serving import AsyncSpecServer

    target = llama(len(tok), seed=0)
    server = AsyncSpecServer(target, tok, {"a": perturbed(target, 0.05), "b": perturbed(target, 0.05, seed=2)})
    server.add_expert("c", perturbed(target, 0.05, seed=3))
    try:
        a, b, c = (server.engines[n].policy for n in "abc")
        assert a.costs is b.costs is c.costs and a is not b  # one calibration, acceptance learned apart
        params = SamplingParams(max_tokens=10, num_speculative_tokens="auto", ignore_eos=True)

        async def run(expert):
            return [d async for d in server.generate([5, 6, 7], params, expert)]

        for expert in "ab":
            assert sum(len(d.token_ids) for d in asyncio.run(asyncio.wait_for(run(expert), 30))) == 10
        assert list(a.costs) == [1]  # calibrated once, by whichever expert met batch 1 first
    finally:
        server.close()


def test_load_and_admin_experts_count_running_and_waiting_apart(tok, monkeypatch):
    """load() is what the cluster distill controller weighs against training (its heartbeat), and
    /admin/experts reports the same rows by state: a request queued behind a full batch is load too,
    and it is waiting, not running. Secrets stay out of the config sent to W&B."""
    import osd_serve.service as service_mod

    configs = []
    real = service_mod.Telemetry
    monkeypatch.setattr(service_mod, "Telemetry", lambda *a, **k: (configs.append(k["config"]), real(*a, **k))[1])
    target = llama(len(tok), seed=3)
    cfg = AppConfig(max_batch_size=1, distill={"enabled": False}, wandb={"mode": "disabled"}, api_key="sk-secret-1",
                    admin_key="adm-secret-2")
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    assert configs and "sk-secret-1" not in repr(configs) and "adm-secret-2" not in repr(configs)
    eng = svc.server.engines["default"]
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    try:
        async def scenario():
            first = svc.stream("default", "def g(", long)
            await first.__anext__()  # admitted: the batch of 1 is full
            second = svc.stream("default", "x = ", long)
            pending = asyncio.ensure_future(second.__anext__())
            while not eng.waiting:  # queued behind the full batch
                await asyncio.sleep(0.005)
            gate, entered = _held_step(eng)  # hold the state still while it is read
            assert await asyncio.to_thread(entered.wait, 10)
            load, info = svc.load(), (await svc.admin_experts())["experts"]["default"]
            gate.set()
            await first.aclose()
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
            await second.aclose()
            return load, info

        load, info = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert load == (2, 1)
        assert (info["running"], info["waiting"]) == (1, 1), info
    finally:
        svc.close()


def test_admin_actions_without_a_distiller_are_a_409_not_a_404(service):
    """With distillation off there is nothing to update or roll back: a state that does not allow the
    action (409, saying why), not a missing version or expert (404, which names a field)."""
    svc, cfg = service
    client = TestClient(make_app(svc, cfg.model_copy(update={"admin_key": "adm"})))
    adm = {"Authorization": "Bearer adm"}
    for path in ("/admin/experts/default/update", "/admin/experts/default/rollback"):
        r = client.post(path, headers=adm)
        assert r.status_code == 409 and "distill.enabled is false" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] is None


def test_a_failing_step_callback_costs_no_expert_its_turn(tok):
    """on_step (telemetry) must never stop serving. Raised out of the loop's round, it ended the round
    at the first busy expert: while that one stayed busy no other expert stepped, so a 4-token
    request on expert b finished only after a 200-token one on a had run out. Counted in steps, not
    time: each round steps every busy expert once, and a emits at most k + 1 tokens a step."""
    from osd_serve.serving import AsyncSpecServer

    def broken(name, stats):
        raise RuntimeError("telemetry backend gone")

    target = llama(len(tok), seed=0)
    server = AsyncSpecServer(target, tok, {"a": perturbed(target, 0.05), "b": perturbed(target, 0.05, seed=2)},
                             on_step=broken)
    a = server.engines["a"]
    try:
        async def run():
            long = server.generate([5, 6, 7], SamplingParams(max_tokens=200, num_speculative_tokens=3, ignore_eos=True), "a")
            await anext(long)  # a is running
            short = [d async for d in server.generate([8, 9], SamplingParams(max_tokens=4, ignore_eos=True), "b")]
            state = (a.has_unfinished(), a.finished["length"])  # a's state as b finishes
            await long.aclose()
            return short, state

        short, (a_busy, a_done) = asyncio.run(asyncio.wait_for(run(), 60))
        assert short[-1].finish_reason == "length" and sum(len(d.token_ids) for d in short) == 4
        assert a_busy and a_done == 0  # b was served while a ran, not after it
    finally:
        server.close()


def test_an_engine_that_cannot_be_reset_still_ends_its_requests_and_reports_unhealthy(tok, monkeypatch):
    """After a sticky CUDA error the failed step's reset fails too (every allocation does): the error
    deltas came after the reset, so its callers waited forever while /health said ok."""
    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"enabled": False}, wandb={"mode": "disabled"})
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    eng = svc.server.engines["default"]

    def device_lost(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    monkeypatch.setattr(type(eng), "step", device_lost)
    monkeypatch.setattr(type(eng), "reset", device_lost)
    try:
        client = TestClient(make_app(svc, cfg))
        assert client.get("/health").status_code == 200
        for prompt in ("a = 1", "b = 2"):  # the second: a request after the failed reset ends too
            assert [d["finish_reason"] for d in asyncio.run(_run(svc, prompt, timeout=20))] == ["error"]
        assert not svc.server.alive()
        r = client.get("/health")
        assert r.status_code == 503 and "'default' could not be reset after a failed step" in r.json()["error"], r.text
    finally:
        svc.close()

