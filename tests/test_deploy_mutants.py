"""Gaps a mutation audit of deployments/config.py and app.py found, tested without a Ray
cluster: each test here failed on a mutant (a changed bound, default, branch or argument) that the
rest of the suite let pass. Ray's remote machinery is replaced by plain calls; the code under test is
the deployments' own (the classes behind @serve.deployment). distiller.py's are in
test_distiller_mutants.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.config import AppConfig, parse_config

pytest.importorskip("ray.serve")

import deployments.app as app  # noqa: E402
import deployments.distiller as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("no_env_keys")


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
                        "max_train_workers": 1, "buffer_mb": 1}, "experts": [{"name": "default"}, {"name": "a-b_c."}]})
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
    # A replaced replica serves what it holds for 120 s, not Serve's 20 s (which cut a stream in
    # benchmarks/redeploy_drain.py), unless a config's entry sets its own
    from deployments.config import GRACEFUL_SHUTDOWN_S

    for name, dep in built.items():
        assert dep._deployment_config.graceful_shutdown_timeout_s == GRACEFUL_SHUTDOWN_S == 120, name
    assert len(calls) == 1  # the default pair is built in the build task, where `serve run` shows its progress
    for name, dep in built.items():
        if name != "Router":  # every model deployment gets the validated config, less the keys
            assert dep.init_args == (parse_config(spec["args"]).without_keys(),)


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_keys_reach_only_the_router(topology, monkeypatch):
    """Only the Router checks keys. A deployment's init args are kept by Serve's controller, and a
    config's repr reaches logs and tracebacks: neither shows a key."""
    args = {"topology": topology, "distill": {"enabled": False}, "api_key": "sk-only-the-router",
            "admin_key": "adm-only-the-router"}
    cfg = parse_config(args)
    assert "only-the-router" not in repr(cfg) and "only-the-router" not in str(cfg)
    application, _, _ = _build(monkeypatch, args)
    for name, dep in _deployments(application).items():
        if name != "Router":
            assert "only-the-router" not in repr(dep.init_args) and dep.init_args[0]["max_model_len"] == cfg.max_model_len
    assert (cfg.api_key, cfg.admin_key) == ("sk-only-the-router", "adm-only-the-router")  # still the Router's


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

    def __init__(self, cfg, replica_tag, record_sink, private_versions, versions_dir):
        self.tag, self.sink, self.private, self.versions_dir = replica_tag, record_sink, private_versions, versions_dir
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


def test_serve_replaces_a_replica_whose_engine_cannot_serve(monkeypatch):
    """SpecServer had no check_health: a replica whose engine loop stopped, or whose engine failed its
    reset (a sticky CUDA error), stayed in service answering every request with an error."""
    server = _spec_server(monkeypatch, distill={"enabled": False})
    asyncio.run(server.check_health())  # the stand-in's ready() answers by name: healthy

    async def broken():
        raise RuntimeError("expert 'default' could not be reset after a failed step (RuntimeError)")

    server.service.ready = broken
    with pytest.raises(RuntimeError, match="could not be reset"):
        asyncio.run(server.check_health())


def test_a_replica_serves_its_own_versions_and_outside_one_shares_them(monkeypatch):
    """In a Ray Serve replica the local backend claims a versions slot its replacement resumes (by the
    replica's id, private_versions); outside one (tests, the CLI) versions live under versions_dir/local."""
    local = _spec_server(monkeypatch, distill={"enabled": False, "versions_dir": "/vs"})
    assert (local.service.tag, local.service.private, local.service.sink) == ("local", False, None)
    assert local.service.versions_dir == Path("/vs")
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="r7"), app_name="llama")
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: context)
    monkeypatch.setattr("ray.serve.get_replica_context", lambda: context)
    replica = _spec_server(monkeypatch, distill={"enabled": False, "versions_dir": "/vs"})
    assert (replica.service.tag, replica.service.private) == ("r7", True)
    # its application's own directory: another application's slot (and its versions) is never taken over
    assert replica.service.versions_dir == Path("/vs/llama")


def test_each_application_has_its_own_versions_directory(monkeypatch):
    """Stores are per expert: two applications on one versions_dir published over each other's "default"."""
    from deployments.config import versions_root
    from deployments.disagg import _versions_dir

    cfg = AppConfig(distill={"versions_dir": "/vs"})
    assert versions_root(cfg, None) == Path("/vs") and versions_root(cfg, "osd") == Path("/vs/osd")
    assert versions_root(cfg, "a/../b").parent == Path("/vs") and versions_root(cfg, "..").parent == Path("/vs")
    assert versions_root(cfg, "a/../b").name.startswith("a_.._b-") and versions_root(cfg, "..").name.startswith("__-")
    # names that sanitise alike never share a directory; a safe name keeps its own as it is
    names = ["chat v2", "chat_v2", "chat/v2", "team/a", "team_a", ".", "..", "_", "__"]
    assert len({versions_root(cfg, n) for n in names}) == len(names)
    assert versions_root(cfg, "chat_v2") == Path("/vs/chat_v2") and versions_root(cfg, "x.y-z") == Path("/vs/x.y-z")
    assert versions_root(cfg, "chat v2") == versions_root(cfg, "chat v2")  # stable: the same one at every start
    assert _versions_dir(cfg) == Path("/vs")  # outside a replica
    monkeypatch.setattr("ray.serve.get_replica_context", lambda: SimpleNamespace(app_name="qwen"))
    assert _versions_dir(cfg) == Path("/vs/qwen")  # the disaggregated pool's watcher and the router's admin routes


def test_only_enabled_ray_train_distillation_connects_to_the_cluster(monkeypatch):
    """With distillation off a replica neither records nor beats; with ray_train each record goes to the
    cluster's buffer and the replica's load to the controller."""
    calls = []
    monkeypatch.setattr(dist, "connect", lambda cfg: (calls.append("connect"), ("buffer", "controller"))[1])
    monkeypatch.setattr(dist, "send_record", lambda buffer, record, pair: calls.append(("send", buffer, record, pair)))
    monkeypatch.setattr(dist, "pair_of", lambda cfg: ["target", "draft"])
    monkeypatch.setattr(dist, "start_heartbeat", lambda controller, tag, load: calls.append(("beat", controller, tag, load)))
    off = _spec_server(monkeypatch, distill={"enabled": False, "backend": "ray_train"})
    assert calls == [] and off.service.sink is None
    on = _spec_server(monkeypatch, distill={"backend": "ray_train"})
    on.service.sink("rec")
    # each record tagged with the replica's pair: after a redeploy onto another, the buffer drops the old one's
    assert calls == ["connect", ("beat", "controller", "local", on.service.load), ("send", "buffer", "rec", ["target", "draft"])]


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
