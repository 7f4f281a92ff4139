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
    readiness = app.Readiness(["SpecServer"])
    # One event loop for all requests (a bare TestClient runs each on a loop of its own and cancels a
    # refresh still running when it ends: 1 run in 40 failed so), and the failed refresh waited for.
    with TestClient(make_app(_Backend(readiness.check), CFG)) as c:
        assert c.get("/health").status_code == 200  # the first answer
        c.get("/health")  # starts a refresh, which fails in the background
        deadline = time.monotonic() + 10
        while readiness._failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        r = c.get("/health")
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


@pytest.mark.parametrize("name", [".owner", ".lock", ".tmp-1", "..", "a" * 101])
def test_an_expert_name_that_cannot_be_its_directory_is_refused_at_serve_run(name):
    """Accepted, ".owner" (a slot's lock file beside the stores) and a 300-character name (Errno 36)
    failed each replica's start, where Serve retries and the app is left unable to serve."""
    from deployments.config import parse_config

    with pytest.raises(ValueError, match=r"experts\.0\.name"):
        parse_config({"experts": [{"name": name}], "default_expert": name})
    assert parse_config({"experts": [{"name": "a" * 100}], "default_expert": "a" * 100})  # the longest kept


def test_a_long_application_name_still_has_a_directory_of_its_own():
    from pathlib import Path

    from deployments.config import versions_root

    cfg = AppConfig(distill={"versions_dir": "/vs"})
    long_a, long_b = "a" * 300, "a" * 299 + "b"
    assert len(versions_root(cfg, long_a).name) < 120 and versions_root(cfg, long_a) != versions_root(cfg, long_b)
    assert versions_root(cfg, "a" * 255) == Path("/vs") / ("a" * 255)  # one that fits keeps its name as it is


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])  # with their BOMs: UTF-16-LE without one is UTF-8 with NULs
def test_a_body_must_be_utf8(encoding):
    """json.loads on bytes detected UTF-16 and UTF-32 itself, so such a body was served (RFC 8259 8.1:
    JSON between systems is UTF-8). A leading UTF-8 BOM is still let go."""
    from tests.test_http_edges import Scripted

    c = TestClient(make_app(Scripted(), CFG))
    auth = {"Authorization": "Bearer sk-test", "content-type": "application/json"}
    r = c.post("/v1/completions", headers=auth, content='{"prompt": "x"}'.encode(encoding))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body is not valid UTF-8"), r.text
    r = c.post("/v1/completions", headers=auth, content='{"prompt": "x"}'.encode("utf-8-sig"))
    assert r.status_code == 200, r.text
