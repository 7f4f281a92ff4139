"""The cluster distillation pieces on a local Ray cluster with logical GPUs: the capacity decision,
the object-store replay buffer, a Ray Train job, and the controller publishing a guarded version."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

from deployments.replay_actor import _ReplayBufferActor  # noqa: E402
from deployments.distiller import BUFFER_NAME, NAMESPACE, DistillController, ReplayBufferActor, idle_per_node, plan_workers  # noqa: E402
from osd_serve.distill.guard import GuardConfig, evaluate, split_for_guard  # noqa: E402
from osd_serve.distill.versions import VersionStore  # noqa: E402
from tests.conftest import llama, perturbed  # noqa: E402
from tests.test_distill import _prompts, _records  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    # Two logical GPUs: Ray schedules by them, nothing touches CUDA, so this runs on any CPU box. A
    # cluster some earlier test started (a Ray call auto-initialises one) has none: named here, where
    # it showed as a missing "GPU" key and then a fixture waiting for GPUs until CI's time ran out.
    if ray.is_initialized():
        pytest.fail("an earlier test left Ray initialised (without this module's logical GPUs)")
    ray.init(num_cpus=2, num_gpus=2, namespace=NAMESPACE, include_dashboard=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@ray.remote(num_gpus=1, num_cpus=0)
class _Serving:
    """Stands in for a verifier replica holding one GPU."""

    def ready(self):
        return True


@pytest.fixture(scope="module")
def gpus_busy(cluster):
    """Serving holds both logical GPUs (so a Train job must not ask for one: nothing here has CUDA)."""
    holders = [_Serving.remote() for _ in range(2)]
    try:
        ray.get([h.ready.remote() for h in holders], timeout=120)  # GPUs some actor still holds: fail, not hang
        yield
    finally:  # also after a timeout: left pending, they took the GPUs later in the module
        for h in holders:
            ray.kill(h)


def _idle_once(gpus: float) -> list[dict]:
    """idle_per_node() once it shows ``gpus`` idle GPUs: the GCS updates its resource view a moment after
    an actor takes or frees one (on a loaded machine, after the ready() call has returned)."""
    deadline = time.time() + 30
    while (avail := idle_per_node()) and avail[0].get("GPU", 0) != gpus and time.time() < deadline:
        time.sleep(0.1)
    return avail


def test_capacity_decision_uses_idle_gpus_and_spares_busy_cpus(cluster):
    avail = _idle_once(2)
    assert [n["GPU"] for n in avail] == [2]
    assert plan_workers(avail, serve_load=0.9) == {"num_workers": 2, "use_gpu": True}
    assert plan_workers(avail, serve_load=0.1, max_workers=1) == {"num_workers": 1, "use_gpu": True}
    holders = [_Serving.remote()]
    try:  # killed whatever fails: left holding the GPUs, they left gpus_busy waiting for one until the timeout
        ray.get(holders[0].ready.remote())
        assert plan_workers(_idle_once(1), serve_load=0.9) == {"num_workers": 1, "use_gpu": True}
        holders.append(_Serving.remote())
        ray.get(holders[1].ready.remote())
        avail = _idle_once(0)
        assert avail[0].get("GPU", 0) == 0
        assert plan_workers(avail, serve_load=0.9) is None  # no GPU left and the CPUs are busy serving: wait
        assert plan_workers(avail, serve_load=0.2) == {"num_workers": 4, "use_gpu": False, "cpus_per_worker": 0.5}  # 2 CPUs / 0.5
    finally:
        for h in holders:
            ray.kill(h)


def test_capacity_is_counted_per_node():
    """A worker needs its GPU (or its CPU share) on one node: fractions left on different nodes do not add up."""
    halves = [{"GPU": 0.5, "CPU": 0.4}, {"GPU": 0.5, "CPU": 0.4}]
    assert plan_workers(halves, serve_load=0.9) is None  # summed: 1 GPU, a worker no node can place
    assert plan_workers(halves, serve_load=0.1) is None  # summed: 0.8 CPU, one 0.5-CPU worker no node can place
    assert plan_workers([{"GPU": 1.5}, {"GPU": 0.9}, {"GPU": 1.0}], serve_load=0.9) == {"num_workers": 2, "use_gpu": True}
    assert plan_workers([{"CPU": 0.75}, {"CPU": 1.0}], serve_load=0.1)["num_workers"] == 3


class TrainController:
    """Named as Ray Train's controller actor is: only its reservations count as a Train job's."""

    def reserve(self) -> str:
        from ray.util import placement_group

        self.pg = placement_group([{"CPU": 0.5}])
        ray.get(self.pg.ready(), timeout=60)
        return self.pg.id.hex()


class Serving(TrainController):
    pass


def test_a_dead_train_controllers_reservation_is_found_and_freed(cluster):
    """A Train job's reservation lives as long as the Ray job that made the detached distill controller:
    with the job's TrainController dead (the distill controller killed mid-job), it held its CPUs for
    good. Only those are freed: a live Train job's and a dead actor's of another kind stay."""
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup

    from deployments.train_job import free_orphaned_train_reservations, orphaned_train_reservations

    actors = [ray.remote(num_cpus=0)(c).remote() for c in (TrainController, TrainController, Serving)]
    dead, live, other = ray.get([a.reserve.remote() for a in actors], timeout=120)
    job, stand_in = ray.get_runtime_context().get_job_id(), (__name__, "TrainController")
    try:
        ray.kill(actors[0])
        ray.kill(actors[2])
        deadline = time.time() + 30  # the control store marks a creator dead a moment after it dies
        while not (found := orphaned_train_reservations(job, stand_in)) and time.time() < deadline:
            time.sleep(0.2)
        assert found == [dead]
        assert orphaned_train_reservations(job) == []  # Ray Train's own class only: this one's module is not ray.train
        assert orphaned_train_reservations("ffffffff", stand_in) == []  # another Ray job's: not this controller's
        assert free_orphaned_train_reservations(job, stand_in) == [dead]
        states = {k: v["state"] for k, v in placement_group_table().items()}
        assert (states[dead], states[live], states[other]) == ("REMOVED", "CREATED", "CREATED")
        assert orphaned_train_reservations(job, stand_in) == []
    finally:
        for pg in (live, other):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg))))
        ray.kill(actors[1])


@pytest.fixture(scope="module")
def data(tok, tmp_path_factory):
    target = llama(len(tok), seed=0)
    draft = perturbed(target, 0.2)
    d = tmp_path_factory.mktemp("draft")
    draft.save_pretrained(d)
    train, _ = _records(target, draft, tok, _prompts(len(tok), 24, 1))
    held, _ = _records(target, draft, tok, _prompts(len(tok), 12, 2))
    for recs, is_held in ((train, False), (held, True)):  # guard samples: the held set (the recorder marks every fourth request)
        for r in recs:
            r.heldout = is_held
    return draft, str(d), train, held, len(tok)


def test_buffer_actor_keeps_refs_bounded_by_bytes(cluster, data):
    _, _, train, _, _ = data
    cap = sum(r.nbytes for r in train[:5])
    buf = ReplayBufferActor.remote({"max_bytes": cap, "trigger_records": 3, "trigger_age_s": 3600})
    for r in train[:8]:
        ray.get(buf.add.remote("default", r, r.nbytes))
    st = ray.get(buf.stats.remote())["default"]
    assert st["bytes"] <= cap and st["seen"] == 8 and st["records"] < 8
    assert ray.get(buf.due.remote()) == {"default": "size"}
    refs, _, _ = ray.get(buf.take.remote("default"))
    got = ray.get(refs)
    assert [g.response_ids.tolist() for g in got] == [r.response_ids.tolist() for r in train[8 - len(got) : 8]]  # FIFO
    assert ray.get(buf.due.remote()) == {}


def test_controller_trains_guards_and_publishes(cluster, gpus_busy, data, tmp_path):
    """It trains from the store's current version and guards against it: here version 1, an earlier
    job's output, not the draft on disk (version 0), which a guard against it would also let through."""
    draft, path, train, held, vocab = data
    store = VersionStore(tmp_path / "versions" / "default")
    store.publish({n: t.clone() for n, t in draft.state_dict().items()}, {"reason": "initial draft"})
    current = perturbed(draft, 0.05, seed=7)  # stands in for version 1
    store.publish({n: t.clone() for n, t in current.state_dict().items()})
    _, idx = split_for_guard([False] * len(train) + [True] * len(held), GuardConfig(max_heldout=12))
    held_slice = [(train + held)[i] for i in idx]  # what the controller holds out of the buffer's records
    scores = [evaluate(m, held_slice, vocab)["expected_acceptance"] for m in (draft, current)]
    assert abs(scores[0] - scores[1]) > 1e-3  # the two are told apart
    buf = ReplayBufferActor.options(name=BUFFER_NAME, get_if_exists=True).remote(
        {"max_bytes": 1 << 30, "trigger_records": len(train) + len(held), "trigger_age_s": 3600})
    # with a time limit (the serve config's default has one), so the 2 workers agree on it at every step
    ctl = DistillController.remote(path, str(tmp_path / "versions"), {"lr": 3e-3, "time_limit_s": 600}, 40,
                                   max_workers=2, heldout=12)
    for r in train + held:  # held last: the newest records are the guard's slice
        ray.get(buf.add.remote("default", r, r.nbytes))
    deadline = time.time() + 480  # a Ray Train run: placement group, 2 workers, checkpoint
    events = []
    while time.time() < deadline and not events:
        events = [e for e in ray.get(ctl.history.remote()) if "published" in e or "error" in e]
        time.sleep(1)
    assert events and "error" not in events[0], events
    ev = events[0]
    assert ev["plan"]["use_gpu"] is False  # the GPUs are serving's
    assert ev["published"], ev
    # rank 0's metrics reach the event (single-batch losses: first against last would be noise)
    assert ev["steps"] > 0 and all(math.isfinite(ev[k]) for k in ("loss_first", "loss_last")), ev
    assert ev["steps"] == 40 and ev["time_limited"] is False, ev  # every step, within the limit
    assert ev["serving"]["expected_acceptance"] == pytest.approx(scores[1], abs=1e-5)  # guarded against version 1
    assert ev["guarded_on"] == "cpu"  # by the job's rank-0 worker, on its device (the controller loads no draft)
    # the Train job (2 CPU workers, gradients all-reduced) raised held-out alpha-hat over the serving draft
    assert store.refresh() == 2 and ev["candidate"]["expected_acceptance"] > ev["serving"]["expected_acceptance"] + 0.02
    assert torch.is_tensor(next(iter(store.load(2).values())))
    runs = tmp_path / "versions" / "ray_train"  # each run's checkpoint is a full draft: removed once loaded
    assert not runs.exists() or not any(p.name.startswith("distill-") for p in runs.iterdir())


def test_a_redeploy_reconfigures_the_detached_actors(cluster, gpus_busy, data, tmp_path):
    """The buffer and controller are detached and found by name: a redeploy with a changed config
    must reach them (they kept the first deploy's bounds and triggers)."""
    from deployments.config import AppConfig
    from deployments.distiller import actor_names, connect

    for name in actor_names("default"):  # whatever an earlier test left under these names
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass
    _, path, train, _, _ = data

    def cfg(**distill):
        return AppConfig(target=path, draft=path, distill={"backend": "ray_train", "versions_dir": str(tmp_path), **distill})

    buf, ctl = connect(cfg(trigger_records=1000, buffer_mb=64, max_train_workers=1))
    try:
        for r in train[:4]:
            ray.get(buf.add.remote("default", r, r.nbytes))
        assert ray.get(buf.due.remote()) == {}
        assert ray.get(ctl.status.remote())["settings"]["max_workers"] == 1
        ray.get(ctl.heartbeat.remote("replica", 1.0, 1.0))  # serving busy, GPUs held: the controller must not train (and take the records)
        buf2, ctl2 = connect(cfg(trigger_records=3, buffer_mb=64, max_train_workers=2, keep_versions=2, lr=0.01))
        assert ray.get(buf2.stats.remote())["default"]["records"] == 4  # the same actor, records kept
        assert ray.get(buf2.due.remote()) == {"default": "size"}  # the new trigger applies
        settings = ray.get(ctl2.status.remote())["settings"]
        assert (settings["max_workers"], settings["keep_versions"], settings["train_cfg"]["lr"]) == (2, 2, 0.01)
    finally:
        ray.kill(buf)
        ray.kill(ctl)


def test_a_killed_buffer_comes_back_with_its_records(cluster, data, tmp_path):
    """End to end: records in the object store die with the actor that owns them; the restarted actor reads
    their files back and puts them again, so a job's ray.get of the refs it takes gets the same records."""
    _, _, train, held, _ = data
    cfg, pair, kept = {"max_bytes": 1 << 30, "trigger_records": 100, "trigger_age_s": 3600}, ["t", "d"], train[:5] + held[:2]
    buf = ReplayBufferActor.options(max_restarts=-1, max_task_retries=3).remote(cfg, str(tmp_path / ".replay"))  # connect()'s
    try:
        ray.get(buf.configure.remote(cfg, pair))
        for r in kept[:5]:
            ray.get(buf.add.remote("default", r, r.nbytes, pair))
        ray.get(buf.flush.remote())  # its files written (a kill loses the writes still queued)
        pid = ray.get(buf.__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(buf, no_restart=False)
        deadline = time.time() + 60
        while time.time() < deadline and os.path.exists(f"/proc/{pid}"):  # ray.kill returns before it dies
            time.sleep(0.05)
        for r in kept[5:]:  # sent while it restarts: retried onto the new process (max_task_retries), not lost
            buf.add.remote("default", r, r.nbytes, pair)
        # Only a restarted buffer takes the config a poll hands it (the old process, while it lives, keeps
        # its own): the first answer "due" is the restarted one's.
        deadline, due = time.time() + 120, {}
        while time.time() < deadline and not due:
            try:
                due = ray.get(buf.due.remote({**cfg, "trigger_records": 3}, pair), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)
        assert due == {"default": "size"}  # 7 records, none trained on: they count toward the trigger again
        refs, flags, _ = ray.get(buf.take.remote("default"))
        got = ray.get(refs, timeout=60)
        assert [g.response_ids.tolist() for g in got] == [r.response_ids.tolist() for r in kept]
        assert all(torch.equal(g.probs, r.probs) for g, r in zip(got, kept)) and flags == [False] * 5 + [True] * 2
    finally:
        ray.kill(buf)


@ray.remote(num_cpus=0)
class _SlowAdd(_ReplayBufferActor):
    """The first process's add() returns 60 s after its record's file is written: a kill then is a kill mid-call."""

    def add(self, *args):
        kept = super().add(*args)
        self.flush()
        if not self.restored:  # the restarted process read the file back: its retry returns at once
            time.sleep(60)
        return kept


def test_an_add_in_flight_when_the_buffer_dies_is_retried_and_kept_once(cluster, data, tmp_path):
    """Ray resubmits the call to the restarted process (max_task_retries), which has read the first call's
    file back: before ReplayRecord.rid it kept the record twice, trained on and counted toward the trigger twice."""
    _, _, train, _, _ = data
    cfg, pair, root = {"max_bytes": 1 << 30, "trigger_records": 100, "trigger_age_s": 3600}, ["t", "d"], tmp_path / ".replay"
    buf = _SlowAdd.options(max_restarts=-1, max_task_retries=3).remote(cfg, str(root))
    try:
        ray.get(buf.configure.remote(cfg, pair))
        pending = buf.add.remote("default", train[0], train[0].nbytes, pair)
        deadline = time.time() + 60
        while time.time() < deadline and not list(root.glob("default/*.safetensors")):
            time.sleep(0.05)
        ray.kill(buf, no_restart=False)
        assert ray.get(pending, timeout=120) is True  # answered by the restarted process
        st = ray.get(buf.stats.remote(), timeout=60)["default"]
        assert (st["records"], st["seen"], st["new"]) == (1, 1, 1)
        assert len(list(root.glob("default/*.safetensors"))) == 1
    finally:
        ray.kill(buf)


def test_a_controller_killed_mid_job_frees_its_reservation_once_restarted(cluster, gpus_busy, data, tmp_path):
    """End to end: the job's reservation outlived the killed controller (the dashboard is off here, so
    Ray Train's own cleaner cannot tell its controller died), and the restarted one, the same detached
    actor, frees it when it next plans, then trains the records the killed job took and publishes."""
    from ray.util import placement_group_table

    draft, path, train, held, vocab = data
    versions = tmp_path / "versions"
    try:  # an earlier test's, if it lives: it holds these same records, and a record's id keeps it once
        ray.kill(ray.get_actor(BUFFER_NAME, namespace=NAMESPACE))
    except ValueError:
        pass
    buf = ReplayBufferActor.options(name=BUFFER_NAME, get_if_exists=True).remote(
        {"max_bytes": 1 << 30, "trigger_records": len(train) + len(held), "trigger_age_s": 3600})
    ctl = DistillController.options(max_restarts=-1).remote(path, str(versions), {"lr": 3e-3, "time_limit_s": 600}, 10**6,
                                                            max_workers=1, heldout=12)

    def fill():
        for r in train + held:
            ray.get(buf.add.remote("default", r, r.nbytes))

    def reserved():
        return {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}

    try:
        fill()
        deadline = time.time() + 240
        while not (job := reserved()) and time.time() < deadline:  # the job's worker group, reserved
            time.sleep(0.2)
        assert job, "no Train job started"
        # Mid-job: the actor restarts, its job's Train controller dies with it. Ray Train 2.60's own cleaner
        # asks the dashboard's state API, off here, so only the restarted controller's sweep frees the group
        # (its freed_reservations entry, below).
        # A short job next, from settings saved now (the job running keeps its own): the restarted actor reads them
        # back and takes the rearmed window at its first poll, before any call of the test's could reach it.
        ray.get(ctl.configure.remote(path, str(versions), {"lr": 3e-3}, 4, max_workers=1, heldout=12), timeout=30)
        ray.kill(ctl, no_restart=False)
        # ray.kill returns before the process dies: a call may still reach it, or fail while the actor restarts
        # (ActorUnavailableError). The restarted one is the one whose history says so.
        deadline, events = time.time() + 120, []
        while time.time() < deadline and not any("restarted" in e for e in events):
            try:
                events = ray.get(ctl.history.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                time.sleep(1)
        assert ray.get(ctl.status.remote(), timeout=30)["settings"]["steps"] == 4  # read back from the saved settings
        # no new records: the killed job's trigger window is put back, so the expert is due again at once
        deadline = time.time() + 300
        # A sweep that ran before the control store marked the Train controller dead finds it at the next
        # (SWEEP_S later), which may come after the next job: wait for both. The rearmed job is due at the first
        # poll, maybe while the dead job's group still holds the CPUs: its workers may fail to start, and the
        # back-off retries it 5 s later (the window stays due), so wait for a job that ran
        while time.time() < deadline and not (any("published" in e for e in events)
                                              and any("freed_reservations" in e for e in events)):
            events = ray.get(ctl.history.remote())
            time.sleep(1)
        assert [e["freed_reservations"] for e in events if "freed_reservations" in e] == [sorted(job)], events
        assert [e for e in events if "restarted" in e], events  # the restart itself is in the history
        assert [e["rearmed"] for e in events if "rearmed" in e] == [{"default": len(train) + len(held)}], events
        jobs = [e for e in events if "published" in e]
        assert jobs and jobs[-1]["steps"] == 4, events  # it ran, with the settings saved before the kill
        assert not job & reserved()
    finally:
        ray.kill(ctl)
        ray.kill(buf)
