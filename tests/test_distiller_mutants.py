"""Gaps a mutation audit of deployments/distiller.py found, tested without a Ray cluster: each test here
failed on a mutant (a changed bound, branch or argument) the rest of the suite let pass. Ray's remote
machinery is replaced by plain calls; the code under test is the classes behind @ray.remote."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from deployments.config import parse_config

pytest.importorskip("ray.serve")

import deployments.distiller as dist  # noqa: E402
import deployments.replay_actor as replay_actor  # noqa: E402

# ---- distiller.py: the capacity plan ------------------------------------------------------------------

def test_plan_workers_edges():
    """One idle GPU is worth a worker; the cap holds; at exactly busy_load the CPUs are left to serving;
    fractions on different nodes never add up to a worker; and a node's 0.3 CPU holds three 0.1-CPU
    workers although 0.3 / 0.1 is 2.9999999999999996 in floating point."""
    assert dist.plan_workers([{"GPU": 1.0}], serve_load=0.9) == {"num_workers": 1, "use_gpu": True}
    assert dist.plan_workers([{"GPU": 3.0}, {"GPU": 3.0}], serve_load=0.9, max_workers=4)["num_workers"] == 4
    assert dist.plan_workers([{"CPU": 8.0}], serve_load=0.75) is None
    assert dist.plan_workers([{"CPU": 8.0}], serve_load=0.74)["num_workers"] == 4
    assert dist.plan_workers([{"CPU": 0.3}, {"CPU": 0.3}, {"CPU": 0.3}], serve_load=0.0, cpus_per_worker=0.2) == \
        {"num_workers": 3, "use_gpu": False, "cpus_per_worker": 0.2}  # summed: 0.9 CPU, 4 workers
    assert dist.plan_workers([{"GPU": 0.5}, {"GPU": 0.5}], serve_load=0.9) is None
    assert dist.plan_workers([{"CPU": 0.3}], serve_load=0.0, cpus_per_worker=0.1)["num_workers"] == 3


# ---- distiller.py: the buffer actor and the controller, their remote calls made plain ------------------

def _cls(actor):
    return actor.__ray_metadata__.modified_class.__ray_actor_class__  # the class behind ray.remote


def _actor(obj):
    """An actor handle over a plain object: handle.method.remote(*args) is the call (ray.get: identity)."""
    return SimpleNamespace(**{n: SimpleNamespace(remote=getattr(obj, n)) for n in dir(obj) if not n.startswith("__")})


def _polls(n):
    """The controller's stop event, set after n polls: _loop runs n times on the test's thread."""
    left = iter([False] * n)
    return SimpleNamespace(is_set=lambda: next(left, True), wait=lambda s: None)


class _Rec(SimpleNamespace):
    __hash__, __eq__ = object.__hash__, object.__eq__  # put is the identity here: the record is its own ref


def _rec(expert="default", heldout=False):
    return _Rec(expert=expert, nbytes=100, heldout=heldout)


@pytest.fixture
def plain_ray(monkeypatch):
    """distiller's `ray` with no cluster: get and put are the identity, the buffer actor is a plain one;
    and no controller thread is started (each test drives _loop itself)."""
    buffer = _cls(dist.ReplayBufferActor)({"max_bytes": 1 << 20, "trigger_records": 4, "trigger_age_s": 60.0})
    fake = SimpleNamespace(get=lambda x: x, put=lambda x: x, get_actor=lambda name, namespace: _actor(buffer))
    for module in (dist, replay_actor):
        monkeypatch.setattr(module, "ray", fake)
    monkeypatch.setattr(dist, "threading", SimpleNamespace(Event=threading.Event,
                                                           Thread=lambda **kw: SimpleNamespace(start=lambda: None)))
    return buffer


def test_a_redeploy_onto_another_pair_empties_the_buffer_and_refuses_the_old_pairs_records(monkeypatch):
    """Records hold a pair's token ids and target distributions: kept across a redeploy that changed
    the pair, they trained the new draft to fit the old target, and the old pair's replicas, serving
    until the new ones are up, went on adding more."""
    monkeypatch.setattr(replay_actor, "ray", SimpleNamespace(put=lambda x: x))
    cfg = {"max_bytes": 1 << 20, "trigger_records": 4, "trigger_age_s": 60.0}
    old, new = ["t1", "d1"], ["t2", "d1"]
    buffer = _cls(dist.ReplayBufferActor)(cfg)
    buffer.configure(cfg, old)  # what connect() does at once
    for _ in range(3):
        assert buffer.add("default", _rec(), 100, old)
    buffer.configure(cfg, old)  # the same pair: a redeploy keeps its records
    assert buffer.stats()["default"]["records"] == 3
    buffer.configure({**cfg, "trigger_records": 2}, new)
    assert buffer.stats() == {} and buffer.buffer.cfg.trigger_records == 2
    assert not buffer.add("default", _rec(), 100, old)  # an old replica still serving
    assert buffer.add("default", _rec(), 100, new) and buffer.add("default", _rec(), 100)
    assert buffer.stats()["default"]["records"] == 2


def test_the_buffer_actor_hands_over_guard_flags_and_restarts_the_trigger(plain_ray):
    for i in range(4):
        plain_ray.add("sql", _rec("sql", heldout=i == 3), 100)
    assert plain_ray.due() == {"sql": "size"}
    refs, flags, window = plain_ray.take("sql")
    assert [r.heldout for r in refs] == flags == [False, False, False, True]
    assert plain_ray.due() == {}  # a new trigger window: the controller does not train the same records again at once
    plain_ray.rearm("sql", window)  # the job failed: the trigger is due again at once
    assert plain_ray.due() == {"sql": "size"}
    plain_ray.take("sql")
    assert plain_ray.stats() == {"sql": {"records": 4, "bytes": 400, "seen": 4, "new": 0}}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from tests.conftest import llama

    d = tmp_path_factory.mktemp("draft")
    llama(40, hidden=16, layers=1).save_pretrained(d)
    return str(d)


def _controller(plain_ray, monkeypatch, tmp_path, draft_dir, verdict=True, during=None, **kw):
    """A DistillController over a saved tiny draft, Ray Train (and its rank 0's guard) replaced: a "trained" state is
    its base + 0.01, the guard says `verdict`, during() runs mid-job. Returns (controller, Train calls, guard calls)."""
    from safetensors.torch import load_file

    trains, checks = [], []

    def train(plan, refs, draft_path, state_path, train_cfg, steps, storage, held=None, guard=None):
        trains.append(SimpleNamespace(plan=plan, refs=refs, draft_path=draft_path, train_cfg=train_cfg, steps=steps, storage=storage))
        during and during()
        checks.append(SimpleNamespace(held=held, guard=guard))
        return {n: t + 0.01 for n, t in load_file(state_path).items()}, {"steps": steps, "loss_first": 2.0, "loss_last": 1.0,
                "verdict": {"publish": verdict, "reason": "guard's reason", "candidate": {"expected_acceptance": 0.6},
                            "serving": {"expected_acceptance": 0.5}, "device": "cpu"}}

    monkeypatch.setattr(dist, "run_train_job", train)
    monkeypatch.setattr(dist, "idle_per_node", lambda: [{"GPU": 16.0}])
    kw = {"max_workers": 16, "heldout": 2, **kw}
    ctrl = _cls(dist.DistillController)(draft_dir, str(tmp_path / "versions"), {"mode": "full"}, 3, poll_s=3600, **kw)
    return ctrl, trains, checks


def _fill(buffer, n, heldout):
    for i in range(n):
        buffer.add("default", _rec(heldout=i >= n - heldout), 100)


def test_a_job_trains_on_what_the_guard_does_not_hold_out_and_publishes(plain_ray, monkeypatch, tmp_path, draft_dir):
    """The configured held-out count (not the guard's default), at most one Train worker per training
    record (an idle one deadlocks the all-reduce), an initial version to train from, and the controller
    back to idle with the job in its history."""
    from osd_serve.distill.versions import VersionStore

    ctrl, trains, checks = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    _fill(plain_ray, 12, heldout=4)
    states = []
    update = ctrl._update
    monkeypatch.setattr(ctrl, "_update", lambda *a: (states.append(ctrl.status()["state"]), update(*a))[1])
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    assert len(checks[0].held) == 2 and len(trains[0].refs) == 10 and trains[0].plan["num_workers"] == 10
    assert checks[0].guard["max_heldout"] == 2 and ctrl.history()[0]["guarded_on"] == "cpu"  # the job's rank 0 guarded
    assert (trains[0].draft_path, trains[0].train_cfg, trains[0].steps) == (draft_dir, {"mode": "full"}, 3)
    assert trains[0].storage == str(tmp_path / "versions" / "ray_train")
    assert states == ["training default on {'num_workers': 16, 'use_gpu': True}"] and ctrl.status()["state"] == "idle"
    [event] = ctrl.history()
    assert (event["published"], event["version"], event["reason"], event["trigger"]) == (True, 1, "guard's reason", "size")
    store = VersionStore(tmp_path / "versions" / "default")
    assert store.refresh() == 1 and store.versions == [0, 1] and store.meta(0)["reason"] == "initial draft"
    # the 2 older guard samples were trained into version 1: later jobs never hold them out
    assert [r.heldout for r in plain_ray.buffer.shard("default").records] == [False] * 10 + [True] * 2


def test_an_initial_version_the_controller_made_is_not_served_for_an_expert_with_an_adapter(plain_ray, monkeypatch,
                                                                                           tmp_path, draft_dir):
    """Before any replica has loaded an expert (its traffic never drafted), the controller's version 0 is
    the base draft. Unmarked, a replica that then loaded the expert took the store as its own and served
    the base draft's weights where its config merges a LoRA adapter. Marked with the base's fingerprint,
    the replica clears it and serves (and publishes) its own."""
    from pathlib import Path

    from safetensors.torch import load_file

    from osd_serve.distill.versions import VersionStore, VersionWatcher, draft_fingerprint

    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    _fill(plain_ray, 8, heldout=2)
    ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
    root = tmp_path / "versions"
    base = load_file(next(Path(draft_dir).glob("*.safetensors")))
    assert VersionStore(root / "default").manifest["draft"] == draft_fingerprint(base)
    merged = {n: t + 0.5 for n, t in base.items()}  # base + a LoRA adapter, merged, as the replica serves it
    watcher = VersionWatcher(root, apply=lambda *a: None)
    try:
        assert watcher.watch("default", lambda: merged) == (0, None)  # its own draft, not the controller's
    finally:
        watcher.close()
    store = VersionStore(root / "default")
    assert store.versions == [0] and store.manifest["draft"] == draft_fingerprint(merged)


def test_a_job_whose_store_a_replica_cleared_meanwhile_publishes_nothing(plain_ray, monkeypatch, tmp_path, draft_dir):
    """The replica loads the LoRA expert while the job trains from the controller's base version 0: it
    clears the store and publishes its own version 0. A clear restarts the numbering, so the job's
    expect_current=0 still held and its base-trained candidate became version 1, served to the expert."""
    from pathlib import Path

    from safetensors.torch import load_file

    from osd_serve.distill.versions import VersionStore, VersionWatcher, draft_fingerprint

    root = tmp_path / "versions"
    merged = {n: t + 0.5 for n, t in load_file(next(Path(draft_dir).glob("*.safetensors"))).items()}

    def replica_loads_the_expert():
        watcher = VersionWatcher(root, apply=lambda *a: None)
        try:
            watcher.watch("default", lambda: merged)
        finally:
            watcher.close()

    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir, during=replica_loads_the_expert)
    _fill(plain_ray, 8, heldout=2)
    event = ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
    assert (event["published"], event["version"]) == (False, None)
    store = VersionStore(root / "default")
    assert store.versions == [0] and store.manifest["draft"] == draft_fingerprint(merged)


def test_a_refused_candidate_or_a_rollback_meanwhile_publishes_nothing(plain_ray, monkeypatch, tmp_path, draft_dir):
    from osd_serve.distill.versions import VersionStore

    root = tmp_path / "versions" / "default"
    _fill(plain_ray, 8, heldout=2)
    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir, verdict=False)
    event = ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
    assert (event["published"], event["version"], event["reason"]) == (False, None, "guard's reason")
    assert VersionStore(root).versions == [0]
    assert [r.heldout for r in plain_ray.buffer.shard("default").records] == [False] * 6 + [True] * 2

    # another publisher (an admin rollback, a second controller) moves the store while the job trains
    other = lambda: VersionStore(root).publish(VersionStore(root).load(0), {"reason": "elsewhere"})  # noqa: E731
    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir, during=other)
    event = ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
    assert (event["published"], event["version"]) == (False, None)
    assert event["reason"] == "version 0 is no longer current (rolled back or replaced)"
    store = VersionStore(root)
    assert store.refresh() == 1 and store.meta(1)["reason"] == "elsewhere" and store.versions == [0, 1]
    assert [r.heldout for r in plain_ray.buffer.shard("default").records] == [False] * 6 + [True] * 2


def test_the_controller_keeps_the_configured_number_of_versions(plain_ray, monkeypatch, tmp_path, draft_dir):
    from osd_serve.distill.versions import VersionStore

    _fill(plain_ray, 8, heldout=2)
    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir, keep_versions=2)
    for _ in range(3):
        assert ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})["published"]
    # and version 0, the draft as configured: these full-weight versions pruned it, so rollback?to=0 was a 404
    assert VersionStore(tmp_path / "versions" / "default").versions == [0, 2, 3]


def test_a_failed_job_is_history_and_too_few_guard_samples_skip(plain_ray, monkeypatch, tmp_path, draft_dir):
    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    _fill(plain_ray, 4, heldout=1)  # one guard sample: nothing to judge a candidate on
    assert ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})["skipped"] == "too few records"
    assert trains == []
    monkeypatch.setattr(ctrl, "_update", lambda *a: 1 / 0)
    _fill(plain_ray, 4, heldout=0)
    ctrl._stop = _polls(1)
    ctrl._loop(0)  # the controller outlives one failed job: it is recorded, and the state is idle again
    assert [e["error"] for e in ctrl.history()] == ["ZeroDivisionError('division by zero')"]
    assert ctrl.status()["state"] == "idle"


def test_serve_load_counts_live_replicas_by_capacity(plain_ray, monkeypatch, tmp_path, draft_dir):
    monkeypatch.setenv("HOME", str(tmp_path))
    ctrl = _cls(dist.DistillController)(draft_dir, "~/v", {}, 1, poll_s=3600)
    assert ctrl.status()["settings"]["versions_dir"] == str(tmp_path / "v")  # a redeploy's "~" is the actor's home
    assert ctrl.serve_load() == 0.0
    ctrl.heartbeat("a", 4, 8)
    ctrl.heartbeat("b", 0, 8)
    assert ctrl.serve_load() == 0.25  # ongoing over capacity, not a mean of the replicas' counts
    ctrl.load["gone"] = (64, 64, time.monotonic() - ctrl.HEARTBEAT_TTL_S - 1)  # silent past the TTL: scaled down
    assert ctrl.serve_load() == 0.25


def test_connect_gives_the_actors_the_config(monkeypatch):
    """Both actors are detached and found by name, so each connect also reconfigures them: the byte
    bound in MiB, the triggers, the draft (not the target) and keep_versions on create and on configure."""
    made, configured = [], []

    def actor_class(kind):  # .options(**opts).remote(*args) makes a handle whose configure.remote(...) is kept
        handle = SimpleNamespace(configure=SimpleNamespace(remote=lambda *a, **kw: configured.append((kind, a, kw))))
        return SimpleNamespace(options=lambda **opts: SimpleNamespace(
            remote=lambda *a, **kw: (made.append((kind, opts, a, kw)), handle)[1]))

    monkeypatch.setattr(dist, "ReplayBufferActor", actor_class("buffer"))
    monkeypatch.setattr(dist, "DistillController", actor_class("controller"))
    monkeypatch.setattr(dist, "ray", SimpleNamespace(get=lambda x: x))
    cfg = parse_config({"target": "org/target", "draft": "org/draft", "distill": {
        "backend": "ray_train", "buffer_mb": 3, "trigger_records": 5, "trigger_age_s": 7.5, "keep_versions": 2,
        "max_train_workers": 6, "steps_per_update": 9, "lr": 0.01, "mode": "full", "versions_dir": "/vs",
        "train_time_limit_s": 45}})
    dist.connect(cfg, app="llama")
    buffer_cfg = {"max_bytes": 3 * 1024 * 1024, "trigger_records": 5, "trigger_age_s": 7.5}
    args = ("org/draft", "/vs/llama", {"mode": "full", "lr": 0.01, "steps_per_update": 9}, 9, 6)  # the app's own versions
    # restarted if they die: replicas keep handles to them, and records and heartbeats to a dead one were lost silently
    opts = {"namespace": dist.NAMESPACE, "get_if_exists": True, "lifetime": "detached", "max_restarts": -1}
    names = dist.actor_names("llama")
    pair = ["org/target", "org/draft"]
    extra = {"keep_versions": 2, "buffer_cfg": buffer_cfg, "pair": pair}  # the buffer's: a restarted one gets them
    assert made == [("buffer", {"name": names[0], "max_task_retries": 3, **opts}, (buffer_cfg, "/vs/llama/.replay"), {}),
                    ("controller", {"name": names[1], **opts}, args, {"buffer_name": names[0], **extra})]
    # the time limit as its own keyword: an older (detached) controller refuses it rather than failing every job
    assert configured == [("buffer", (buffer_cfg, pair), {}), ("controller", args, {"train_time_limit_s": 45.0, **extra})]
    # the pair as configured: the embedded default's paths differ from node to node
    assert dist.pair_of(parse_config({})) == ["embedded default", "embedded default"]
    # Each Serve application its own pair of actors; a caller outside any replica gets the default app's
    assert len({*names, *dist.actor_names("qwen")}) == 4
    made.clear()
    dist.connect(cfg)
    assert [m[1]["name"] for m in made] == list(dist.actor_names("default"))
    assert made[1][2][1] == "/vs"  # where a SpecServer or DraftPool outside a replica watches


def test_records_and_heartbeats_reach_the_actors(monkeypatch):
    """No record (a request with nothing to learn from) sends nothing; a heartbeat whose load() raised
    once is followed by the next one (the thread lives on)."""
    sent = []
    dist.send_record(_actor(SimpleNamespace(add=lambda *a: sent.append(a))), None)
    dist.send_record(_actor(SimpleNamespace(add=lambda *a: sent.append(a))), SimpleNamespace(expert="sql", nbytes=7), ["t", "d"])
    assert [(e, n, pair) for e, _, n, pair in sent] == [("sql", 7, ["t", "d"])]

    beats, calls, done = [], [], threading.Event()

    def load():
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("engine busy")  # any exception, not one kind, is a missed beat
        if len(calls) > 3:
            done.set()
            threading.Event().wait()  # parks the daemon thread for the rest of the run
        return (len(calls), 8)

    dist.start_heartbeat(_actor(SimpleNamespace(heartbeat=lambda *a: beats.append(a))), "r1", load, every_s=0.01)
    assert done.wait(10)
    assert beats == [("r1", 2, 8), ("r1", 3, 8)]


def test_a_failed_job_leaves_its_trigger_due_and_retries_back_off_per_expert(plain_ray, monkeypatch, tmp_path,
                                                                            draft_dir):
    """take() closed the trigger window before training: a job that failed (a worker OOM, the worker group
    not starting) was retried only after trigger_records new records, or never at low traffic. Now it stays
    due; retried every poll, a fault that repeats would train and fail on the cores serving needs, so its
    retries wait 5, 10, 20 ... s. Per expert: a failing expert must not starve or delay another."""
    from osd_serve.distill.replay import Backoff

    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    job, jobs, now = ctrl._job, [], [0.0]

    def fails_for_a(expert, *a):
        jobs.append((now[0], expert))
        if expert == "a":
            raise RuntimeError("worker OOM")
        return job(expert, *a)

    monkeypatch.setattr(ctrl, "_job", fails_for_a)
    ctrl.backoff = Backoff(clock=lambda: now[0])  # 5 s doubling to 300 s
    _fill(plain_ray, 4, heldout=0)  # no guard samples: b's job skips, "too few records", as a success
    for i in range(4):
        plain_ray.add("a", _rec("a", heldout=i > 1), 100)
        plain_ray.add("b", _rec("b", heldout=i > 1), 100)
    left = iter([False] * 40)
    ctrl._stop = SimpleNamespace(is_set=lambda: next(left, True), wait=lambda s: now.__setitem__(0, now[0] + 1.0))
    ctrl._loop(1.0)
    assert [t for t, e in jobs if e == "a"] == [0.0, 5.0, 15.0, 35.0]
    assert (0.0, "b") in jobs and "b" not in plain_ray.due()  # b trained at once, a's failure just before it
    assert "a" in plain_ray.due()  # a's trigger stays due
    assert [e["expert"] for e in ctrl.history() if "error" in e] == ["a"] * 4


def test_admin_experts_shows_the_controllers_jobs_json_safe(plain_ray, monkeypatch, tmp_path, draft_dir):
    """With distill.backend ray_train, /admin/experts showed updates 0 and last_error null whatever the
    controller did: a controller whose every job failed looked idle. Its report is the last jobs, with a
    guard's NaN score as null (JSON has none), and a controller that does not answer is said, not a 500."""
    import asyncio
    import json

    from deployments.app import SpecServer

    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    ctrl.events.extend([{"error": "RuntimeError('worker OOM')", "time": 1.0}] * 11)
    ctrl.events.append({"expert": "default", "published": False, "candidate": {"expected_acceptance": float("nan")}})
    report = ctrl.report()
    assert report["state"] == "idle" and len(report["jobs"]) == 10
    assert report["jobs"][-1]["candidate"] == {"expected_acceptance": None}
    json.dumps(report, allow_nan=False)

    async def answer():
        return ctrl.report()

    async def experts():
        return {"experts": {"default": {"updates": 0}}}

    server = object.__new__(SpecServer.func_or_class)
    server.service = SimpleNamespace(admin_experts=experts, close=lambda: None)  # __del__ closes it
    server.controller = SimpleNamespace(report=SimpleNamespace(remote=answer))
    out = asyncio.run(server.admin("experts"))
    assert out["distill_controller"] == report and out["experts"] == {"default": {"updates": 0}}

    async def gone():
        raise RuntimeError("The actor died unexpectedly before finishing this task.")

    server.controller = SimpleNamespace(report=SimpleNamespace(remote=gone))
    assert asyncio.run(server.admin("experts"))["distill_controller"] == {
        "error": "the distill controller did not answer (RuntimeError)"}


def test_a_restarted_actor_serves_the_current_config_not_its_creations(plain_ray, monkeypatch, tmp_path, draft_dir):
    """Restarted (max_restarts), an actor's __init__ gets its creation's arguments: a buffer created with a
    pair then refused every record of the pair a redeploy had moved to, and the controller trained with
    the old settings. The buffer now has no pair until configure(); the controller reads its last back."""
    buffer = _cls(dist.ReplayBufferActor)({"max_bytes": 1 << 20})
    assert buffer.add("default", _rec(), 100, ["t2", "d2"])  # whatever pair serves now is not refused
    buffer.configure({"max_bytes": 1 << 20}, ["t2", "d2"])  # the next replica's connect() names it again
    assert not buffer.add("default", _rec(), 100, ["t1", "d1"])

    versions = str(tmp_path / "versions")
    ctrl = _cls(dist.DistillController)(draft_dir, versions, {"mode": "full"}, 3, poll_s=3600)
    ctrl.configure("org/new-draft", versions, {"mode": "lora", "lr": 0.01}, 7, 2, 4, 9)  # a redeploy
    again = _cls(dist.DistillController)(draft_dir, versions, {"mode": "full"}, 3, poll_s=3600)  # the restart
    assert again.status()["settings"] == ctrl.status()["settings"]
    assert again.settings["draft_path"] == "org/new-draft" and again.settings["keep_versions"] == 9
    (tmp_path / "versions" / dist.SETTINGS_FILE).write_text("{not json")
    third = _cls(dist.DistillController)(draft_dir, versions, {"mode": "full"}, 3, poll_s=3600)
    assert third.settings["draft_path"] == draft_dir  # unreadable: its creation's settings stand


def test_a_controller_that_does_not_answer_does_not_hold_admin_experts(monkeypatch):
    """A restarting controller (max_restarts) or one pending resources held /admin/experts indefinitely."""
    import asyncio

    async def never():
        await asyncio.sleep(3600)

    monkeypatch.setattr(dist, "REPORT_TIMEOUT_S", 0.05)
    controller = SimpleNamespace(report=SimpleNamespace(remote=never))
    assert asyncio.run(dist.controller_report(controller)) == {"error": "the distill controller did not answer (TimeoutError)"}


def test_a_failed_capacity_read_costs_one_poll_not_the_loop(plain_ray, monkeypatch, tmp_path, draft_dir):
    """idle_per_node reads Ray's control store outside the loop's try: one failed read ended the loop thread
    for good, while the actor stayed up showing an idle controller with no error."""
    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    _fill(plain_ray, 12, heldout=4)
    reads = iter([ConnectionError("GCS unavailable (transient)")])

    def idle():
        if (e := next(reads, None)) is not None:
            raise e
        return [{"GPU": 16.0}]

    monkeypatch.setattr(dist, "idle_per_node", idle)
    monkeypatch.setattr(ctrl.backoff, "ready", lambda expert: True)  # the retry at the next poll, not 5 s later
    ctrl._stop = _polls(2)
    ctrl._loop(0)
    events = ctrl.history()
    assert "GCS unavailable" in events[0]["error"] and events[1]["published"] is True and len(trains) == 1
    assert ctrl.status()["state"] == "idle"


def test_a_published_job_whose_retire_fails_is_not_trained_again(plain_ray, monkeypatch, tmp_path, draft_dir):
    """The buffer restarting as a job retired its guard samples failed the job after it had published: the
    window was rearmed, so the same records were trained again over the version that holds them."""
    from osd_serve.distill.versions import VersionStore

    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    _fill(plain_ray, 12, heldout=4)

    def restarting(*a):
        raise ConnectionError("buffer actor restarting")

    monkeypatch.setattr(ctrl.buffer, "retire", type(ctrl.buffer.retire)(remote=restarting))
    ctrl._stop = _polls(2)
    ctrl._loop(0)
    assert VersionStore(tmp_path / "versions" / "default").versions == [0, 1]
    assert [e.get("published") for e in ctrl.history()] == [True] and len(trains) == 1
    assert plain_ray.due() == {}


def test_a_job_cut_at_its_time_limit_is_in_its_event_and_the_log(plain_ray, monkeypatch, tmp_path, draft_dir, caplog):
    ctrl, trains, checks = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    ran = dist.run_train_job
    monkeypatch.setattr(dist, "run_train_job", lambda *a: (r := ran(*a), (r[0], {**r[1], "steps": 2, "time_limited": True}))[1])
    _fill(plain_ray, 12, heldout=4)
    dist.logger.addHandler(caplog.handler)  # Ray's "ray.serve" logger does not propagate to the root's
    try:
        event = ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
    finally:
        dist.logger.removeHandler(caplog.handler)
    assert event["time_limited"] is True and event["steps"] == 2 and event["published"]
    assert "default: the job stopped at its time limit after 2 steps" in caplog.text
