"""The Ray Train backend's actors across a restart, and a Train job whose workers cannot start. Tested
without a Ray cluster, as test_distiller_mutants.py does: the classes behind @ray.remote, remote calls
made plain. Ray restarts a dead actor (max_restarts) by re-running __init__ with its creation's
arguments, so what a redeploy changed since must come from somewhere else."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("ray.serve")

import deployments.distiller as dist  # noqa: E402
from tests.test_distiller_mutants import _cls, _polls, _rec, draft_dir, plain_ray  # noqa: E402, F401

CREATED = {"max_bytes": 4096 << 20, "trigger_records": 8, "trigger_age_s": 60.0}
CURRENT = {"max_bytes": 300, "trigger_records": 2, "trigger_age_s": 60.0}


def test_a_train_job_whose_workers_cannot_start_fails_instead_of_retrying_forever(monkeypatch, tmp_path):
    """The plan is made from the capacity idle at that moment; serving can take it before the workers
    start. Ray Train's default (controller_failure_limit -1) then retried the start forever: fit() never
    returned and the controller's one thread trained nothing else, ever. Ray's own failure policy, fed
    the run config the job passes, must give up, so the failure reaches the controller's back-off."""
    from ray.train import Checkpoint
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.failure_handling.factory import create_failure_policy
    from ray.train.v2.api.exceptions import ControllerError
    from safetensors.torch import save_file
    import ray.train.torch as rtt
    import torch

    seen = {}

    class Trainer:  # Ray Train's TorchTrainer, minus the cluster: it records the run config
        def __init__(self, fn, train_loop_config, scaling_config, run_config, torch_config):
            seen["run_config"], seen["torch_config"] = run_config, torch_config

        def fit(self):
            (d := tmp_path / "ck").mkdir(exist_ok=True)
            save_file({"w": torch.zeros(1)}, str(d / "draft.safetensors"))
            return types.SimpleNamespace(checkpoint=Checkpoint.from_directory(str(d)), metrics={"steps": 1})

    monkeypatch.setattr(rtt, "TorchTrainer", Trainer)
    dist.run_train_job({"num_workers": 2, "use_gpu": True}, [], "d", "s", {"time_limit_s": 90.5}, 1, str(tmp_path))
    policy = create_failure_policy(seen["run_config"].failure_config)
    decision = policy.make_decision(ControllerError(WorkerGroupStartupTimeoutError(2)))
    assert decision.value.upper() == "RAISE"
    # a collective waiting past the job's time limit (a hung worker) fails it, not after torch's 30 minutes
    assert seen["torch_config"].timeout_s == 300  # the floor: the first collective also waits out the workers' set-up
    dist.run_train_job({"num_workers": 2, "use_gpu": True}, [], "d", "s", {"time_limit_s": 900.5}, 1, str(tmp_path))
    assert seen["torch_config"].timeout_s == 901


def test_a_restarted_controller_keeps_the_settings_of_the_last_redeploy(plain_ray, tmp_path, draft_dir):
    """A redeploy moved versions_dir: its settings were saved there, and the restart read the creation's
    directory, so it trained the old draft and published where no replica watches, unsaid."""
    C = _cls(dist.DistillController)
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    ctrl = C(draft_dir, old, {"mode": "full"}, 3, poll_s=3600)
    ctrl.configure("org/new-draft", new, {"mode": "lora"}, 7, 2, 4, 9, buffer_cfg=CURRENT, pair=["t", "d"])
    restarted = C(draft_dir, old, {"mode": "full"}, 3, poll_s=3600)
    assert restarted.status()["settings"] == ctrl.status()["settings"]
    assert restarted.status()["settings"]["versions_dir"] == new and restarted.settings["buffer_cfg"] == CURRENT


@pytest.mark.parametrize("bad", [{"buffer_cfg": {"max_bytes": "lots"}}, {"buffer_cfg": {"size": 1}},
                                 {"buffer_cfg": {**CURRENT, "trigger_records": 0}}, {"pair": "t,d"}])
def test_a_bad_buffer_setting_read_back_keeps_the_creations(plain_ray, tmp_path, draft_dir, bad):
    """buffer_cfg and pair go to the buffer at every poll: a bad one read back failed every poll."""
    C = _cls(dist.DistillController)
    ctrl = C(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600, buffer_cfg=CURRENT, pair=["t", "d"])
    path = tmp_path / dist.SETTINGS_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "steps": 99, **bad}))
    restarted = C(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600, buffer_cfg=CURRENT, pair=["t", "d"])
    assert restarted.settings == ctrl.settings  # the creation's, none of the file's (steps 99 too)
    assert json.loads(path.read_text())["steps"] == 3  # and saved over the bad file


def test_a_restarted_buffer_gets_the_current_config_at_the_controllers_next_poll(plain_ray, tmp_path, draft_dir):
    """A redeploy changed buffer_mb and the triggers; the buffer actor died and came back with its
    creation's bound and triggers, and no pair, until some replica started. The controller's poll
    hands it the current ones; a buffer that knows its pair keeps its own."""
    C = _cls(dist.DistillController)
    ctrl = C(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600, buffer_cfg=CURRENT, pair=["t", "d"])
    restarted = _cls(dist.ReplayBufferActor)(CREATED)  # what Ray runs on a restart
    plain_ray.__dict__.update(restarted.__dict__)  # the controller's handle now reaches the restarted one
    ctrl._update = lambda expert, trigger, settings: None  # a due trigger trains nothing here
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    for _ in range(5):
        plain_ray.add("default", _rec(), 100, ["t", "d"])
    assert plain_ray.buffer.cfg.max_bytes == 300 and plain_ray.stats()["default"]["bytes"] == 300
    assert plain_ray.due() == {"default": "size"}  # trigger_records 2, not the creation's 8
    assert not plain_ray.add("default", _rec(), 100, ["old", "pair"])  # its pair is known again
    plain_ray.due({**CURRENT, "max_bytes": 1000}, ["t", "d"])  # configured already: a poll changes nothing
    assert plain_ray.buffer.cfg.max_bytes == 300


def test_actors_made_by_an_older_osd_serve_still_connect_and_poll(plain_ray, monkeypatch, tmp_path, draft_dir):
    """The actors are detached: an upgrade meets the old ones. A controller that takes no buffer
    settings failed every replica's start with a TypeError; a buffer whose due() takes none failed
    every poll of a new controller, which then never trained."""
    from deployments.config import parse_config

    controller_cls, configured = _cls(dist.DistillController), []

    def old_configure(draft_path, versions_dir, train_cfg, steps, max_workers=4, heldout=16, keep_versions=5, save=True):
        configured.append(keep_versions)

    def handle(**methods):
        made = types.SimpleNamespace(**{n: types.SimpleNamespace(remote=f) for n, f in methods.items()})
        return types.SimpleNamespace(options=lambda **opts: types.SimpleNamespace(remote=lambda *a, **kw: made))

    monkeypatch.setattr(dist, "ReplayBufferActor", handle(configure=lambda cfg, pair: None))
    monkeypatch.setattr(dist, "DistillController", handle(configure=old_configure))
    cfg = parse_config({"target": "org/target", "draft": "org/draft",
                        "distill": {"backend": "ray_train", "keep_versions": 3, "versions_dir": str(tmp_path)}})
    dist.connect(cfg, app="osd")
    assert configured == [3]  # configured as it can be, with a warning to `ray kill` it

    ctrl = controller_cls(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600, buffer_cfg=CURRENT, pair=["t", "d"])
    due = plain_ray.due
    plain_ray.due = lambda: due()  # an older buffer: due() takes nothing
    ctrl.buffer = types.SimpleNamespace(due=types.SimpleNamespace(remote=plain_ray.due))
    for _ in range(4):
        plain_ray.add("default", _rec(), 100)
    trained = []
    ctrl._update = lambda expert, why, plan: trained.append(expert) or {"expert": expert}
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"CPU": 2.0}])
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    assert trained == ["default"]


class _Killed(BaseException):
    """The controller's process dying mid-job: no except clause of its runs (neither rearm nor finish)."""


def test_a_job_killed_with_its_controller_is_due_again_when_the_controller_restarts(plain_ray, monkeypatch, tmp_path,
                                                                                    draft_dir):
    """take() closed the expert's trigger window. A job that failed put it back (rearm); one killed with its
    controller did not, and the records it took waited for a whole new trigger's worth (trigger_records
    more, or trigger_age_s) before the restarted controller trained on them."""
    C = _cls(dist.DistillController)
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"CPU": 2.0}])
    ctrl = C(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600)
    for _ in range(4):
        plain_ray.add("default", _rec(), 100)

    def killed(*args):
        raise _Killed

    ctrl._job = killed
    with pytest.raises(_Killed):
        ctrl._update("default", "size", {"num_workers": 1})
    assert plain_ray.due() == {}  # the window is taken
    restarted = C(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600)  # what Ray runs on a restart
    trained = []
    restarted._job = lambda expert, *rest: trained.append(expert) or {"expert": expert, "published": True}
    restarted._stop = _polls(1)
    restarted._loop(0)
    assert trained == ["default"]  # due again at its first poll: the same 4 records, no new ones
    assert [e["rearmed"] for e in restarted.history() if "rearmed" in e] == [{"default": 4}]
    # that job finished: a second restart puts nothing back, and nothing is due
    again = C(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600)
    again._update = lambda expert, why, plan: trained.append(expert) or {"expert": expert}
    again._stop = _polls(1)
    again._loop(0)
    assert trained == ["default"] and [e["rearmed"] for e in again.history() if "rearmed" in e] == [{"default": 4}]


def test_the_buffer_puts_back_only_windows_no_job_finished_or_rearmed(plain_ray):
    for _ in range(3):
        plain_ray.add("sql", _rec("sql"), 100)
    _, _, window = plain_ray.take("sql")
    plain_ray.rearm("sql", window)  # a failed job put it back itself: a restart must not count it twice
    assert plain_ray.rearm_taken() == {} and plain_ray.buffer.shard("sql").new_since_update == 3
    plain_ray.take("sql")
    plain_ray.add("sql", _rec("sql"), 100)
    plain_ray.take("sql")  # taken again before the first job's window came back (its rearm call failed)
    assert plain_ray.rearm_taken() == {"sql": 4}  # both jobs' records count toward the trigger
    assert plain_ray.due() == {"sql": "size"} and plain_ray.rearm_taken() == {}
    plain_ray.take("sql")
    plain_ray.finish("sql")
    assert plain_ray.rearm_taken() == {} and plain_ray.due() == {}


def test_a_successful_job_over_a_buffer_made_before_taken_windows_is_no_error(plain_ray, monkeypatch, tmp_path,
                                                                               draft_dir):
    """The actors are detached and outlive an upgrade; a handle has the methods its actor was made with. The
    new controller's finish() on an older buffer raised after the job had published: every published job
    showed as an error and backed off."""
    C = _cls(dist.DistillController)
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"CPU": 2.0}])
    ctrl = C(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600)
    old = ("due", "take", "rearm", "retire", "add", "configure", "stats")  # no finish, no rearm_taken
    ctrl.buffer = types.SimpleNamespace(**{n: types.SimpleNamespace(remote=getattr(plain_ray, n)) for n in old})
    for _ in range(4):
        plain_ray.add("default", _rec(), 100)
    ctrl._job = lambda expert, *rest: {"expert": expert, "published": True, "version": 1}
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    assert ctrl.history() == [{"expert": "default", "published": True, "version": 1}] and ctrl.backoff.ready("default")


def test_asking_whether_the_controller_restarted_warns_of_nothing(monkeypatch):
    """Ray 2.60's was_current_actor_reconstructed reads its own deprecated actor_id: a RayDeprecationWarning
    in the log at every controller start, for a call the operator cannot change."""
    import warnings

    from ray.util.annotations import RayDeprecationWarning

    class Context:
        @property
        def was_current_actor_reconstructed(self):
            warnings.warn("Use get_actor_id() instead", RayDeprecationWarning, stacklevel=2)
            return True

    monkeypatch.setattr(dist.ray, "get_runtime_context", Context)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert dist._restarted() is True
    assert seen == []


def test_the_report_shows_the_buffers_records_or_why_not(plain_ray, monkeypatch, tmp_path, draft_dir):
    """/admin/experts' distill_controller: with ray_train, the buffer's records were seen only from a driver."""
    ctrl = _cls(dist.DistillController)(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600)
    asked = []
    monkeypatch.setattr(dist.ray, "get", lambda x, timeout=None: asked.append(timeout) or x)
    for _ in range(3):
        plain_ray.add("sql", _rec("sql"), 100)
    assert ctrl.report()["buffer"] == {"sql": {"records": 3, "bytes": 300, "seen": 3, "new": 3}}
    assert asked == [ctrl.REPORT_BUFFER_S] and ctrl.REPORT_BUFFER_S < dist.REPORT_TIMEOUT_S  # the admin call's own bound

    def restarting(x, timeout=None):
        raise TimeoutError

    monkeypatch.setattr(dist.ray, "get", restarting)
    assert ctrl.report()["buffer"] == {"error": "the replay buffer did not answer (TimeoutError)"}


def test_finish_is_called_as_the_buffer_that_took_the_window_takes_it(plain_ray, monkeypatch, tmp_path, draft_dir):
    """Ray checks a call against the class in the caller's process, pickled by reference: the new one. An
    older buffer's TypeError would come back only to a ray.get, and finish is fire and forget: its window
    stayed taken, and a restart trained the records again. Its take's window has two items."""
    ctrl = _cls(dist.DistillController)(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600)
    for _ in range(4):
        plain_ray.add("default", _rec(), 100)
    calls = []
    older = lambda expert: (lambda r: (r[0], r[1], r[2][:2]))(plain_ray.take(expert))  # noqa: E731
    for take in (older, plain_ray.take):
        ctrl.buffer = types.SimpleNamespace(take=types.SimpleNamespace(remote=take),
                                            finish=types.SimpleNamespace(remote=lambda *a: calls.append(a)))
        ctrl._job = lambda expert, *rest: {"expert": expert, "published": True}
        ctrl._update("default", "size", {"num_workers": 1})
    assert calls[0] == ("default",) and calls[1][0] == "default" and len(calls[1][1]) == 5


def test_a_failed_jobs_entry_says_when_it_started_and_what_it_was(plain_ray, monkeypatch, tmp_path, draft_dir):
    """The README says each job's `time` is when it started: a failed one was stamped when it failed (18 s later
    in the operator check, a job whose records' owner died), and had no trigger or plan beside the error."""
    ctrl = _cls(dist.DistillController)(draft_dir, str(tmp_path), {"mode": "full"}, 3, poll_s=3600)
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"CPU": 2.0}])
    for _ in range(4):
        plain_ray.add("default", _rec(), 100)
    clock = iter([100.0, 118.0])
    monkeypatch.setattr(dist.time, "time", lambda: next(clock, 118.0))

    def fails(*args):
        raise RuntimeError("The object's owner has exited")

    ctrl._job, ctrl._stop = fails, _polls(1)
    ctrl._loop(0)
    [entry] = ctrl.history()
    assert entry["time"] == 100.0 and entry["seconds"] == 18.0 and entry["trigger"] == "size"
    assert entry["plan"] == dist.plan_workers([{"CPU": 2.0}], 0.0, 4) and "owner has exited" in entry["error"]


def test_a_published_job_names_its_guard_samples_by_number_too(plain_ray, monkeypatch, tmp_path, draft_dir):
    """By ref alone, a buffer restarted mid-job (its records read back under refs of its own) retired none of
    them: they stayed guard samples. The numbers let it find them (test_replay_spill.py); a buffer made
    before take() gave them (a window of 4) is asked as before."""
    from tests.test_distiller_mutants import _controller

    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    calls, retire = [], ctrl.buffer.retire.remote
    monkeypatch.setattr(ctrl.buffer, "retire", types.SimpleNamespace(remote=lambda *a: calls.append(a) or retire(*a)))
    for take in (plain_ray.take, lambda expert: (lambda r: (r[0], r[1], r[2][:4]))(plain_ray.take(expert))):
        for i in range(12):
            plain_ray.add("default", _rec(heldout=i % 2 == 0), 100)
        monkeypatch.setattr(ctrl.buffer, "take", types.SimpleNamespace(remote=take))
        assert ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})["published"]
    (expert, refs, seqs, window), older = calls
    # 6 guard samples, the newest 2 held out (heldout: 2): the job trained on those numbered 0, 2, 4 and 6
    assert expert == "default" and seqs == [0, 2, 4, 6] and len(window) == 5 and window[2] == plain_ray.incarnation
    assert [r.seq for r in plain_ray.buffer.shard("default").records if r.ref[0] in set(refs)] == seqs
    assert len(older) == 2 and len(trains) == 2
