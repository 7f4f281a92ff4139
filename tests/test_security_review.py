"""From a security and abuse review of the HTTP surface: /health (no key) never shows a remote
traceback, expert names that cannot be directories are refused at `serve run`, and a body must be
UTF-8 JSON. (Its stop-string finding is tested in test_output.py.)"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

pytest.importorskip("ray.serve")

import ray.exceptions  # noqa: E402

import deployments.app as app  # noqa: E402
from deployments.api import make_app  # noqa: E402
from deployments.config import AppConfig  # noqa: E402

CFG = AppConfig(api_key="sk-test", admin_key="admin-test", wandb={"mode": "disabled"})
TB = ('Traceback (most recent call last):\n  File "/home/svc/.venv/lib/python3.12/site-packages/ray/serve/_private/'
      'controller.py", line 812, in get_serve_instance_details\nKeyError: \'app-internal\'')


def _remote_error():
    """What a failed call to the Serve controller raises: its str() is the remote traceback."""
    return ray.exceptions.RayTaskError("ServeController.get_serve_instance_details", TB, KeyError("app-internal"),
                                       proctitle="ray::ServeController", pid=4242, ip="10.1.2.3").as_instanceof_cause()


class _Backend:
    def __init__(self, ready):
        self.ready = ready

    def experts(self):
        return ["default"]


def _leaks(text: str) -> bool:
    return any(s in text for s in ("pid=4242", "10.1.2.3", "/home/svc", "Traceback", "app-internal"))


def test_health_never_shows_the_controllers_traceback(monkeypatch, caplog):
    """Readiness kept the failed controller call's str() and /health answered it, to anyone, in the 503
    and, once the last answer was GRACE_S old, in the 200's warning. The log has it."""
    err = _remote_error()

    def down(deployments):
        raise err

    monkeypatch.setattr(app, "not_running", down)
    r = TestClient(make_app(_Backend(app.Readiness(["SpecServer"]).check), CFG)).get("/health")
    assert r.status_code == 503 and not _leaks(r.text), r.text
    assert r.json()["error"] == "RuntimeError: the Serve controller's status failed: RayTaskError(KeyError)"
    assert "pid=4242" in caplog.text  # the operator still sees it

    calls = []

    def flaky(deployments):  # answers once, then fails
        calls.append(1)
        if len(calls) > 1:
            raise err

    monkeypatch.setattr(app, "not_running", flaky)
    monkeypatch.setattr(app.Readiness, "REFRESH_S", 0.0)
    monkeypatch.setattr(app.Readiness, "GRACE_S", 0.0)
    c = TestClient(make_app(_Backend(app.Readiness(["SpecServer"]).check), CFG))
    for _ in range(3):
        r = c.get("/health")
        time.sleep(0.05)
    assert r.status_code == 200 and "warning" in r.json() and len(calls) > 1, r.text
    assert r.json()["warning"].endswith("(RayTaskError(KeyError))") and not _leaks(r.text), r.text


def test_health_answers_only_the_type_of_an_error_it_did_not_word(caplog):
    """A backend's readiness that raised something else (a RayTaskError from a replica) is answered by
    its type; the readiness checks' own RuntimeErrors keep their words."""
    async def raises_remote():
        raise _remote_error()

    r = TestClient(make_app(_Backend(raises_remote), CFG)).get("/health")
    assert r.status_code == 503 and r.json()["error"] == "RayTaskError(KeyError)" and not _leaks(r.text), r.text
    assert "pid=4242" in caplog.text

    async def own():
        raise RuntimeError("SpecServer has no running replica (UPDATING; `serve status` says why)")

    r = TestClient(make_app(_Backend(own), CFG)).get("/health")
    assert r.json()["error"] == "RuntimeError: SpecServer has no running replica (UPDATING; `serve status` says why)"
