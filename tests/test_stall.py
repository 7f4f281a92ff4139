"""A torch call that hangs (a CUDA hang raises nothing): past stall_timeout_s the colocated server
reports itself unhealthy, so /health reads 503 and Serve's check_health has the replica replaced.
(The disaggregated deployments' watch: tests/test_deploy_edges.py.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from deployments.config import AppConfig
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed
from tests.test_serving import _held_step, _run


def test_a_step_that_hangs_past_the_stall_timeout_makes_the_replica_unhealthy(tok):
    """A hung device call (a CUDA hang) raises nothing: the loop thread sat in its step while /health
    answered 200 and Serve's check_health passed, so the replica was never replaced and its requests
    waited until their clients left. Past stall_timeout_s the server reports itself unhealthy, and
    healthy again once the step returns."""
    target = llama(len(tok), seed=3)
    # 1.5 s, not less: "not yet stalled" is asserted after a thread's and a test client's start-up, which a
    # loaded 2-core runner can pause for a few hundred ms
    cfg = AppConfig(distill={"enabled": False}, wandb={"mode": "disabled"}, stall_timeout_s=1.5)
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    gate, entered = _held_step(svc.server.engines["default"])
    try:
        client = TestClient(make_app(svc, cfg))

        async def run():
            req = asyncio.ensure_future(_run(svc, "a = 1"))
            assert await asyncio.to_thread(entered.wait, 10)
            assert client.get("/health").status_code == 200  # a step may take a while: not yet stalled
            await asyncio.sleep(2.0)
            r = client.get("/health")
            assert r.status_code == 503 and "stall_timeout_s is 1.5" in r.json()["error"], r.text
            with pytest.raises(RuntimeError, match="a torch call has run for"):
                await svc.ready()
            gate.set()
            return await req

        deltas = asyncio.run(run())
        assert deltas[-1]["finish_reason"] in ("length", "stop")
        assert client.get("/health").status_code == 200 and svc.server.alive()
    finally:
        gate.set()
        svc.close()


def test_a_reset_that_hangs_after_a_failed_step_makes_the_replica_unhealthy(tok):
    """Only the step was timed: the reset after a failed step (new caches, right after a device fault,
    when a hang is likeliest) runs on the same thread, and a hang there kept /health at 200."""
    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"enabled": False}, wandb={"mode": "disabled"}, stall_timeout_s=0.3)
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    eng = svc.server.engines["default"]
    gate, entered = threading.Event(), threading.Event()

    def device_fault():
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    real_reset = eng.reset

    def hung_reset():
        entered.set()
        gate.wait(10)
        real_reset()  # then done: the engine holds no request, so the loop idles

    eng.step, eng.reset = device_fault, hung_reset
    try:
        async def run():
            req = asyncio.ensure_future(_run(svc, "a = 1", timeout=20))
            assert await asyncio.to_thread(entered.wait, 10)
            await asyncio.sleep(0.6)
            why = svc.server.health()
            gate.set()
            return why, await req

        why, deltas = asyncio.run(run())
        assert why is not None and "stall_timeout_s is 0.3" in why
        assert [d["finish_reason"] for d in deltas] == ["error"]
    finally:
        gate.set()
        svc.close()
