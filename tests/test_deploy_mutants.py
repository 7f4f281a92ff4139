"""Gaps a mutation audit of deployments/config.py, app.py and distiller.py found, tested without a Ray
cluster: each test here failed on a mutant (a changed bound, default, branch or argument) that the
rest of the suite let pass. Ray's remote machinery is replaced by plain calls; the code under test is
the deployments' own (the classes behind @serve.deployment and @ray.remote)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.config import AppConfig, parse_config

pytest.importorskip("ray.serve")

import deployments.app as app  # noqa: E402
import deployments.distiller as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch):
    monkeypatch.delenv("OSD_API_KEY", raising=False)
    monkeypatch.delenv("OSD_ADMIN_KEY", raising=False)


# ---- config.py: documented defaults, bounds, keys ----------------------------------------------------

def test_defaults_are_the_ones_the_readme_documents():
    """README's "Serve config reference" table is the contract for a config that leaves a key out."""
    cfg = parse_config(None)  # build_app(args=None): no args at all is the all-defaults config
    d, w = cfg.distill, cfg.wandb
    assert (cfg.topology, cfg.draft_ahead, cfg.num_speculative_tokens, cfg.max_batch_size, cfg.max_model_len) == \
        ("colocated", "auto", 4, 8, 2048)
    assert (cfg.served_model_name, cfg.default_expert, [e.name for e in cfg.experts]) == ("osd-serve", "default", ["default"])
    assert (cfg.api_key, cfg.admin_key, cfg.batch_wait_timeout_s) == (None, None, 0.002)
    assert (d.enabled, d.backend, d.max_train_workers, d.mode, d.trigger_records, d.trigger_age_s, d.steps_per_update,
            d.lr, d.keep, d.record_topk, d.buffer_mb, d.versions_dir, d.keep_versions) == \
        (True, "local", 4, "lora", 8, 60.0, 16, 1e-3, "mismatch", 0, 256, "~/.cache/osd-serve/versions", 5)
    assert (w.mode, w.project, w.dir, w.log_every_s) == ("auto", "osd-serve", "~/.cache/osd-serve/wandb", 10.0)


@pytest.mark.parametrize("args, field", [
    ({"distill": {"max_train_workers": 0}}, r"distill\.max_train_workers"),  # a Train job of no workers
    ({"distill": {"trigger_age_s": 0}}, r"distill\.trigger_age_s"),  # due at every poll
    ({"distill": {"steps_per_update": 0}}, r"distill\.steps_per_update"),  # a job that trains nothing
    ({"distill": {"buffer_mb": 0}}, r"distill\.buffer_mb"),  # every record dropped
    ({"distill": {"keep_versions": 0}}, r"distill\.keep_versions"),  # would prune the serving version
    ({"wandb": {"log_every_s": 0}}, r"wandb\.log_every_s"),
    ({"max_prompt_chars": 0}, "max_prompt_chars"),  # read by `or` as unset: 32 x max_model_len
    ({"batch_wait_timeout_s": 1.001}, "batch_wait_timeout_s"),
    ({"experts": [{"name": "sql/v2"}]}, r"experts\.0\.name"),  # a name is one directory under versions_dir
])
def test_the_first_value_past_each_remaining_bound_is_refused(args, field):
    with pytest.raises(ValueError, match=field):
        parse_config(args)


def test_the_last_values_inside_those_bounds_are_accepted():
    cfg = parse_config({"batch_wait_timeout_s": 0, "max_prompt_chars": 1, "distill": {"record_topk": 0, "keep_versions": 1,
                        "max_train_workers": 1, "buffer_mb": 1}, "experts": [{"name": "default"}, {"name": ".a-b_c."}]})
    assert (cfg.batch_wait_timeout_s, cfg.prompt_char_limit, cfg.distill.keep_versions) == (0, 1, 1)
    assert parse_config({"batch_wait_timeout_s": 1}).batch_wait_timeout_s == 1
    assert parse_config({"distill": {"record_topk": 5}}).distill.record_topk == 5


def test_keys_come_from_the_environment_and_the_config_wins(monkeypatch):
    """OSD_ADMIN_KEY enables the admin routes as admin_key does; a key in the config beats the
    environment's; an empty variable counts as unset (README), an empty admin_key is refused."""
    with pytest.raises(ValueError, match="admin_key: Value error, empty"):  # not read as "admin off"
        parse_config({"admin_key": ""})
    monkeypatch.setenv("OSD_ADMIN_KEY", "adm-env")
    cfg = parse_config({})
    assert (cfg.api_key, cfg.admin_key) == (None, "adm-env")
    monkeypatch.setenv("OSD_API_KEY", "sk-env")
    cfg = parse_config({"api_key": "sk-cfg", "admin_key": "adm-cfg"})
    assert (cfg.api_key, cfg.admin_key) == ("sk-cfg", "adm-cfg")
    monkeypatch.setenv("OSD_API_KEY", "")
    monkeypatch.setenv("OSD_ADMIN_KEY", "")
    assert (parse_config({}).api_key, parse_config({}).admin_key) == (None, None)


def test_a_config_error_never_echoes_a_key():
    """The error lists field and reason only: pydantic's own text repeats the whole input, keys included."""
    with pytest.raises(ValueError) as e:
        parse_config({"api_key": "sk-secret-1", "admin_key": "adm-secret-2", "max_batch_size": 0})
    assert str(e.value).startswith("invalid serve_config.yaml args:\n  max_batch_size: ")
    assert "secret" not in str(e.value)


def test_model_paths_need_both_and_tilde_is_a_local_path(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="give both target and draft"):
        parse_config({"draft": "org/draft"})
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert parse_config({"target": "~/m", "draft": "~/m"}).target == "~/m"  # expanded where it is checked
    with pytest.raises(ValueError, match="target: '~/nope' is not a directory"):
        parse_config({"target": "~/nope", "draft": "~/m"})


# ---- app.py: what build_app deploys ------------------------------------------------------------------

def _build(monkeypatch, args):
    """build_app(args) with the model paths stubbed (no default pair built). Returns (application,
    the backend the Router's FastAPI app was made with, the model_paths calls)."""
    import osd_serve.service as service

    calls, made = [], []
    monkeypatch.setattr(service, "model_paths", lambda cfg: (calls.append(cfg), ("t", "d"))[1])
    make_app = app.make_app
    monkeypatch.setattr(app, "make_app", lambda backend, cfg: (made.append(backend), make_app(backend, cfg))[1])
    return app.build_app(args), made[0], calls


def _deployments(application) -> dict:
    """name -> Deployment for the ingress and every deployment bound to it."""
    router = application._bound_deployment
    return {router.name: router, **{a._bound_deployment.name: a._bound_deployment for a in router.init_args}}


@pytest.mark.parametrize("path", ["serve_config.yaml", "serve_config.disaggregated.yaml"])
def test_the_builder_makes_the_deployments_the_shipped_configs_configure(path, monkeypatch):
    """Serve applies a config's `deployments:` entries by name, so a renamed or missing deployment fails
    `serve run`; the builder's own per-replica limits are those the shipped configs set."""
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load((ROOT / path).read_text())["applications"][0]
    application, _, calls = _build(monkeypatch, spec["args"])
    built = _deployments(application)
    assert set(built) == {d["name"] for d in spec["deployments"]}
    for d in spec["deployments"]:
        assert built[d["name"]].max_ongoing_requests == d["max_ongoing_requests"], d["name"]
    assert len(calls) == 1  # the default pair is built in the build task, where `serve run` shows its progress
    for name, dep in built.items():
        if name != "Router":  # every model deployment gets the validated config
            assert dep.init_args == (parse_config(spec["args"]).model_dump(),)


def test_disaggregated_without_distillation_is_still_disaggregated(monkeypatch):
    """Distillation off, the backend is not asked for; the topology is DraftPool + Verifier all the same."""
    args = {"topology": "disaggregated", "distill": {"enabled": False}, "api_key": "sk"}
    assert parse_config(args).distill.backend == "local"
    assert set(_deployments(_build(monkeypatch, args)[0])) == {"Router", "DraftPool", "Verifier"}


def test_the_router_knows_every_configured_expert(monkeypatch):
    """The router refuses an expert its backend does not list: a backend listing only the default one
    would turn every request pinned to another expert into a 400."""
    _, backend, _ = _build(monkeypatch, {"experts": [{"name": "default"}, {"name": "sql"}], "api_key": "sk"})
    assert backend.experts() == ["default", "sql"]


def test_the_open_v1_warning_is_logged_only_without_an_api_key(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="deployments.app"):
        _build(monkeypatch, {"admin_key": "adm"})
        assert [r.message.startswith("no api_key") for r in caplog.records] == [True]
        caplog.clear()
        _build(monkeypatch, {"api_key": "sk-1"})
        assert caplog.records == []


# ---- app.py: SpecServer and the Router's backend, without a replica -----------------------------------

class _Service:
    """Stands in for osd_serve.service.SpecService: keeps how it was made, answers admin ops by name."""

    def __init__(self, cfg, replica_tag, record_sink, private_versions):
        self.tag, self.sink, self.private = replica_tag, record_sink, private_versions
        self.experts, self.load, self.close = lambda: [e.name for e in cfg.experts], lambda: (1, 8), lambda: None

    async def stream(self, expert, prompt, params):
        if prompt == "bad":
            raise ValueError("max_tokens must be >= 1")
        yield {"text": expert}

    def __getattr__(self, op):  # admin_experts, admin_metrics, admin_rollback, admin_update answer by name
        return lambda *args: asyncio.sleep(0, (op, *args))


def _spec_server(monkeypatch, **args):
    import osd_serve.service as service

    monkeypatch.setattr(service, "SpecService", _Service)
    cfg = AppConfig(experts=[{"name": "default"}, {"name": "sql"}], **args)
    return app.SpecServer.func_or_class(cfg.model_dump())


def test_a_replica_serves_its_own_versions_and_outside_one_shares_them(monkeypatch):
    """In a Ray Serve replica the local backend claims a versions slot its replacement resumes (by the
    replica's id, private_versions); outside one (tests, the CLI) versions live under versions_dir/local."""
    local = _spec_server(monkeypatch, distill={"enabled": False})
    assert (local.service.tag, local.service.private, local.service.sink) == ("local", False, None)
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="r7")))
    replica = _spec_server(monkeypatch, distill={"enabled": False})
    assert (replica.service.tag, replica.service.private) == ("r7", True)


def test_only_enabled_ray_train_distillation_connects_to_the_cluster(monkeypatch):
    """With distillation off a replica neither records nor beats; with ray_train each record goes to the
    cluster's buffer and the replica's load to the controller."""
    calls = []
    monkeypatch.setattr(dist, "connect", lambda cfg: (calls.append("connect"), ("buffer", "controller"))[1])
    monkeypatch.setattr(dist, "send_record", lambda buffer, record: calls.append(("send", buffer, record)))
    monkeypatch.setattr(dist, "start_heartbeat", lambda controller, tag, load: calls.append(("beat", controller, tag, load)))
    off = _spec_server(monkeypatch, distill={"enabled": False, "backend": "ray_train"})
    assert calls == [] and off.service.sink is None
    on = _spec_server(monkeypatch, distill={"backend": "ray_train"})
    on.service.sink("rec")
    assert calls == ["connect", ("beat", "controller", "local", on.service.load), ("send", "buffer", "rec")]


def test_a_replica_refuses_an_unknown_expert_and_sends_value_errors_as_data(monkeypatch):
    server = _spec_server(monkeypatch, distill={"enabled": False})

    async def run():
        with pytest.raises(ValueError, match="expert: unknown expert 'nope'"):
            await type(server).get_expert.__wrapped__(server, "nope")
        server.get_expert = lambda expert: asyncio.sleep(0, expert)  # Serve's multiplexing cache bypassed
        params = {"max_tokens": 4}
        ok = [d async for d in server.generate({"expert": "sql", "prompt": "x", "params": params})]
        bad = [d async for d in server.generate({"expert": "sql", "prompt": "bad", "params": params})]
        ops = [await server.admin("experts"), await server.admin("metrics"), await server.admin("rollback", "sql", 2),
               await server.admin("update", "sql")]
        return ok, bad, ops

    ok, bad, ops = asyncio.run(run())
    assert ok == [{"text": "sql"}] and bad == [{"error": "max_tokens must be >= 1"}]  # the router makes it a 400
    assert ops == [("admin_experts",), ("admin_metrics",), ("admin_rollback", "sql", 2), ("admin_update", "sql")]


class _Handle:
    """A DeploymentHandle stand-in: streams `deltas`, keeps the options and admin calls it was given."""

    def __init__(self, deltas):
        self.deltas, self.options_given, self.admin_calls = deltas, [], []
        self.admin = SimpleNamespace(remote=lambda *a: asyncio.sleep(0, self.admin_calls.append(a)))

    def options(self, **kw):
        self.options_given.append(kw)
        return SimpleNamespace(generate=SimpleNamespace(remote=lambda payload: _agen(self.deltas)))


async def _agen(items):
    for d in items:
        yield d


def test_the_handle_backend_routes_by_expert_and_raises_a_replicas_error(monkeypatch):
    """The expert is the multiplexed model id (its traffic sticks to replicas holding its draft), a
    replica's {"error"} is the ValueError the API answers with a 400, and /health waits on SpecServer."""
    from osd_serve.config import SamplingParams

    monkeypatch.setattr(app.serve, "get_replica_context", lambda: SimpleNamespace(app_name="osd"))
    handles = {}
    monkeypatch.setattr(app.serve, "get_deployment_handle",
                        lambda name, app_name: handles.setdefault((name, app_name), _Handle([{"text": "a"}, {"error": "bad k"}])))
    asked = []
    monkeypatch.setattr(app, "Readiness", lambda deps: SimpleNamespace(check=lambda: asyncio.sleep(0, asked.append(deps))))
    backend = app._HandleBackend(["default", "sql"])

    async def run():
        got = []
        with pytest.raises(ValueError, match="^bad k$"):
            async for d in backend.stream("sql", "x", SamplingParams()):
                got.append(d)
        await backend.admin_rollback("sql", 3)
        await backend.ready()
        return got

    assert asyncio.run(run()) == [{"text": "a"}]
    handle = handles[("SpecServer", "osd")]
    assert handle.options_given == [{"stream": True, "multiplexed_model_id": "sql"}]
    assert handle.admin_calls == [("rollback", "sql", 3)] and asked == [["SpecServer"]]


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
    return actor.__ray_metadata__.modified_class  # the class behind @ray.remote


def _actor(obj):
    """An actor handle over a plain object: handle.method.remote(*args) is the call (ray.get: identity)."""
    return SimpleNamespace(**{n: SimpleNamespace(remote=getattr(obj, n)) for n in dir(obj) if not n.startswith("__")})


def _polls(n):
    """The controller's stop event, set after n polls: _loop runs n times on the test's thread."""
    left = iter([False] * n)
    return SimpleNamespace(is_set=lambda: next(left, True), wait=lambda s: None)


def _rec(expert="default", heldout=False):
    return SimpleNamespace(expert=expert, nbytes=100, heldout=heldout)


@pytest.fixture
def plain_ray(monkeypatch):
    """distiller's `ray` with no cluster: get and put are the identity, the buffer actor is a plain one;
    and no controller thread is started (each test drives _loop itself)."""
    buffer = _cls(dist.ReplayBufferActor)({"max_bytes": 1 << 20, "trigger_records": 4, "trigger_age_s": 60.0})
    monkeypatch.setattr(dist, "ray", SimpleNamespace(get=lambda x: x, put=lambda x: x,
                                                     get_actor=lambda name, namespace: _actor(buffer)))
    monkeypatch.setattr(dist, "threading", SimpleNamespace(Event=threading.Event,
                                                           Thread=lambda **kw: SimpleNamespace(start=lambda: None)))
    return buffer


def test_the_buffer_actor_hands_over_guard_flags_and_restarts_the_trigger(plain_ray):
    for i in range(4):
        plain_ray.add("sql", _rec("sql", heldout=i == 3), 100)
    assert plain_ray.due() == {"sql": "size"}
    refs, flags = plain_ray.take("sql")
    assert [r.heldout for r in refs] == flags == [False, False, False, True]
    assert plain_ray.due() == {}  # a new trigger window: the controller does not train the same records again at once
    assert plain_ray.stats() == {"sql": {"records": 4, "bytes": 400, "seen": 4}}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from tests.conftest import llama

    d = tmp_path_factory.mktemp("draft")
    llama(40, hidden=16, layers=1).save_pretrained(d)
    return str(d)


def _controller(plain_ray, monkeypatch, tmp_path, draft_dir, verdict=True, during=None, **kw):
    """A DistillController over a saved tiny draft, Ray Train and the guard replaced: a "trained" state is
    its base + 0.01, the guard says `verdict`, during() runs mid-job. Returns (controller, Train calls, guard calls)."""
    import osd_serve.distill.guard as guard
    from safetensors.torch import load_file

    trains, checks = [], []

    def train(plan, refs, draft_path, state_path, train_cfg, steps, storage):
        trains.append(SimpleNamespace(plan=plan, refs=refs, draft_path=draft_path, train_cfg=train_cfg, steps=steps, storage=storage))
        during and during()
        return {n: t + 0.01 for n, t in load_file(state_path).items()}, {"steps": steps, "loss_first": 2.0, "loss_last": 1.0}

    def check(candidate, serving, held, vocab, cfg, candidate_state=None, steps_taken=None):
        checks.append(SimpleNamespace(held=held, vocab=vocab, steps=steps_taken))
        return guard.Verdict(verdict, "guard's reason", {"expected_acceptance": 0.6}, {"expected_acceptance": 0.5})

    monkeypatch.setattr(dist, "run_train_job", train)
    monkeypatch.setattr(guard, "check", check)
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
    assert (trains[0].draft_path, trains[0].train_cfg, trains[0].steps) == (draft_dir, {"mode": "full"}, 3)
    assert trains[0].storage == str(tmp_path / "versions" / "ray_train")
    assert states == ["training default on {'num_workers': 16, 'use_gpu': True}"] and ctrl.status()["state"] == "idle"
    [event] = ctrl.history()
    assert (event["published"], event["version"], event["reason"], event["trigger"]) == (True, 1, "guard's reason", "size")
    store = VersionStore(tmp_path / "versions" / "default")
    assert store.refresh() == 1 and store.versions == [0, 1] and store.meta(0)["reason"] == "initial draft"


def test_a_refused_candidate_or_a_rollback_meanwhile_publishes_nothing(plain_ray, monkeypatch, tmp_path, draft_dir):
    from osd_serve.distill.versions import VersionStore

    root = tmp_path / "versions" / "default"
    _fill(plain_ray, 8, heldout=2)
    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir, verdict=False)
    event = ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
    assert (event["published"], event["version"], event["reason"]) == (False, None, "guard's reason")
    assert VersionStore(root).versions == [0]

    # another publisher (an admin rollback, a second controller) moves the store while the job trains
    other = lambda: VersionStore(root).publish(VersionStore(root).load(0), {"reason": "elsewhere"})  # noqa: E731
    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir, during=other)
    event = ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
    assert (event["published"], event["version"]) == (False, None)
    assert event["reason"] == "version 0 is no longer current (rolled back or replaced)"
    store = VersionStore(root)
    assert store.refresh() == 1 and store.meta(1)["reason"] == "elsewhere" and store.versions == [0, 1]


def test_the_controller_keeps_the_configured_number_of_versions(plain_ray, monkeypatch, tmp_path, draft_dir):
    from osd_serve.distill.versions import VersionStore

    _fill(plain_ray, 8, heldout=2)
    ctrl, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir, keep_versions=2)
    for _ in range(3):
        assert ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})["published"]
    assert VersionStore(tmp_path / "versions" / "default").versions == [2, 3]


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
        "max_train_workers": 6, "steps_per_update": 9, "lr": 0.01, "mode": "full", "versions_dir": "/vs"}})
    dist.connect(cfg)
    buffer_cfg = {"max_bytes": 3 * 1024 * 1024, "trigger_records": 5, "trigger_age_s": 7.5}
    args = ("org/draft", "/vs", {"mode": "full", "lr": 0.01, "steps_per_update": 9}, 9, 6)
    opts = {"namespace": dist.NAMESPACE, "get_if_exists": True, "lifetime": "detached"}
    assert made == [("buffer", {"name": dist.BUFFER_NAME, **opts}, (buffer_cfg,), {}),
                    ("controller", {"name": dist.CONTROLLER_NAME, **opts}, args, {"keep_versions": 2})]
    assert configured == [("buffer", (buffer_cfg,), {}), ("controller", args, {"keep_versions": 2})]


def test_records_and_heartbeats_reach_the_actors(monkeypatch):
    """No record (a request with nothing to learn from) sends nothing; a heartbeat whose load() raised
    once is followed by the next one (the thread lives on)."""
    sent = []
    dist.send_record(_actor(SimpleNamespace(add=lambda *a: sent.append(a))), None)
    dist.send_record(_actor(SimpleNamespace(add=lambda *a: sent.append(a))), SimpleNamespace(expert="sql", nbytes=7))
    assert [(e, n) for e, _, n in sent] == [("sql", 7)]

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
