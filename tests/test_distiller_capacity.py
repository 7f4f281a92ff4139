"""A due expert that no idle capacity can train: the controller says so (its state, and a warning once
it has waited WAIT_WARN_S). It looked idle, with no job and no error, when a Train job's reservation
outlived a killed controller and held the only CPUs, so it never trained again, unsaid. Such a
reservation is now freed before the controller plans."""

from __future__ import annotations

import deployments.distiller as dist
from tests.test_distiller_mutants import _controller, _fill, _polls, draft_dir, plain_ray  # noqa: F401  fixtures


def _loop_logged(ctrl, polls: int, caplog) -> None:
    """Runs the controller's loop for polls polls, its log in caplog."""
    dist.logger.addHandler(caplog.handler)  # Ray's "ray.serve" logger does not propagate to the root's
    try:
        ctrl._stop = _polls(polls)
        ctrl._loop(0)
    finally:
        dist.logger.removeHandler(caplog.handler)


def _in_ray_job(monkeypatch, job_id: str = "02000000") -> None:
    """plain_ray's `ray` answers the controller's own Ray job id, as in an actor."""
    from types import SimpleNamespace

    monkeypatch.setattr(dist.ray, "get_runtime_context", lambda: SimpleNamespace(get_job_id=lambda: job_id), raising=False)


def test_a_due_expert_without_capacity_is_shown_and_warned_of(plain_ray, monkeypatch, tmp_path, draft_dir, caplog):
    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"CPU": 0.0}])  # every CPU held
    monkeypatch.setattr(ctrl, "WAIT_WARN_S", 0.0)
    _fill(plain_ray, 12, heldout=4)
    _loop_logged(ctrl, 3, caplog)
    assert trains == [] and ctrl.history() == []
    assert ctrl.status()["state"].startswith("waiting for idle capacity: default due for "), ctrl.status()
    assert ctrl.report()["state"].startswith("waiting for idle capacity: default due for ")  # /admin/experts' view
    assert caplog.text.count("default has been due (size)") == 1, caplog.text  # once per wait, not per poll
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"GPU": 16.0}])  # capacity back: it trains, no longer waiting
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    assert len(trains) == 1 and ctrl.waiting == {} and ctrl.status()["state"] == "idle"


def test_a_reservation_a_killed_job_left_is_freed_before_the_plan(plain_ray, monkeypatch, tmp_path, draft_dir, caplog):
    """Killed mid-job, a controller's Train reservation outlived it and held the only CPUs: restarted, it
    found no capacity and waited for good. It now frees reservations whose Train controller died (at
    most every SWEEP_S), says so, and trains on what they held."""
    import time

    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    orphans, asked = ["aa01"], []
    _in_ray_job(monkeypatch)

    def free(job_id):
        asked.append(job_id)  # only its own Ray job's reservations
        freed, orphans[:] = list(orphans), []
        return freed

    runs = tmp_path / "versions" / "ray_train"  # a killed job's run folder (a draft each), and a live one's
    old, young = f"distill-{time.time_ns() - 3 * 3600 * 10**9}", f"distill-{time.time_ns()}"
    for name in (old, young, "other"):
        (runs / name).mkdir(parents=True)

    monkeypatch.setattr(dist, "free_orphaned_train_reservations", free)
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"CPU": 0.0 if orphans else 2.0}])  # the orphan held both CPUs
    sweeps = []
    real = ctrl._free_orphans
    monkeypatch.setattr(ctrl, "_free_orphans", lambda: (sweeps.append(1), real()))
    _fill(plain_ray, 12, heldout=4)
    _loop_logged(ctrl, 1, caplog)
    assert len(trains) == 1 and ctrl.waiting == {} and asked == ["02000000"]
    assert sorted(p.name for p in runs.iterdir()) == sorted([young, "other"])  # 3 h old: a dead job's
    assert ctrl.history()[0]["freed_reservations"] == ["aa01"] and ctrl.history()[1]["published"]
    assert "freed 1 Ray Train reservation(s) left by jobs whose Train controller died (aa01)" in caplog.text
    orphans.append("bb02")  # another, within SWEEP_S of the last look: not looked for yet
    _fill(plain_ray, 12, heldout=4)
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    assert len(sweeps) == 2 and orphans == ["bb02"] and len(trains) == 1 and ctrl.waiting
    ctrl._swept -= ctrl.SWEEP_S
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    assert orphans == [] and len(trains) == 2


def test_reservations_are_freed_on_a_quiet_server_too(plain_ray, monkeypatch, tmp_path, draft_dir):
    """Run only before a plan, the sweep left a killed job's reservation holding idle capacity until traffic
    made an expert due again (the operator's run: 22 s, and on a quiet server until the next trigger)."""
    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    _in_ray_job(monkeypatch)
    monkeypatch.setattr(dist, "free_orphaned_train_reservations", lambda job_id: ["cc03"])
    ctrl._stop = _polls(1)
    ctrl._loop(0)  # nothing due
    assert trains == [] and ctrl.history() == [{"freed_reservations": ["cc03"], "time": ctrl.history()[0]["time"]}]
