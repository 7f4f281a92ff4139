"""The Ray Serve application: `serve run serve_config.yaml` calls ``build_app(args)``.

Two deployments, both thin:
  Router     FastAPI ingress (deployments/api.py): auth, validation, the expert classifier; it calls
             the engine with the expert as Ray Serve's multiplexed model id, so an expert's traffic
             sticks to the replicas that already hold its draft (and its replay buffer).
  SpecServer one osd_serve.service.SpecService per replica: target + per-expert drafts in one engine
             loop (the colocated topology), online distillation beside it, W&B + Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from ray import serve
from ray.serve.handle import DeploymentHandle

from osd_serve.config import SamplingParams
from osd_serve.protocol import UnknownExpert

from .api import make_app
from .config import GRACEFUL_SHUTDOWN_S, AppConfig, check_gpu_reservation, parse_config, replica_app, versions_root

logger = logging.getLogger(__name__)


@serve.deployment(name="SpecServer", max_ongoing_requests=64, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)
class SpecServer:
    def __init__(self, cfg: dict):
        from osd_serve.service import SpecService

        self.cfg = AppConfig.model_validate(cfg)
        check_gpu_reservation(self.cfg, "SpecServer")
        try:
            tag, private = serve.get_replica_context().replica_id.unique_id, True
        except Exception:  # noqa: BLE001  outside a replica (unit tests)
            tag, private = "local", False
        sink = None
        if self.cfg.distill.enabled and self.cfg.distill.backend == "ray_train":
            from .distiller import connect, pair_of, send_record, start_heartbeat

            self.buffer, self.controller = connect(self.cfg)
            pair = pair_of(self.cfg)
            sink = lambda record: send_record(self.buffer, record, pair)  # noqa: E731
        self.service = SpecService(self.cfg, replica_tag=tag, record_sink=sink, private_versions=private,
                                   versions_dir=versions_root(self.cfg, replica_app()))
        if sink is not None:
            start_heartbeat(self.controller, tag, self.service.load)

    @serve.multiplexed(max_num_models_per_replica=64)
    async def get_expert(self, expert: str) -> str:
        # Every configured expert is loaded at start; multiplexing is used for its routing: requests
        # for one expert go to replicas that already serve it, where its buffer and versions live.
        if expert not in self.service.experts():
            raise UnknownExpert(expert, self.service.experts())
        return expert

    async def generate(self, payload: dict):
        try:
            expert = await self.get_expert(serve.get_multiplexed_model_id() or payload["expert"])
            it = self.service.stream(expert, payload["prompt"], SamplingParams(**payload["params"])).__aiter__()
            first = await it.__anext__()
        except UnknownExpert as e:  # its own key: the router, which knows the expert, answers a 503 (retry)
            yield {"error": str(e), "unknown_expert": [e.expert, e.known]}
            return
        except ValueError as e:  # sent as data: the router turns it into a 400 naming the field
            yield {"error": str(e)}
            return
        yield first
        async for d in it:
            yield d

    def experts(self) -> list[str]:
        return self.service.experts()

    async def check_health(self) -> None:
        # Serve's own probe (every health_check_period_s): raising has the replica replaced. An engine
        # loop that stopped, or an engine that could not be reset after a failed step (a sticky CUDA
        # error fails every allocation), serves nothing again; the replica kept answering with errors.
        await self.service.ready()

    async def admin(self, op: str, expert: str | None = None, to: int | None = None) -> dict:
        if op == "experts":
            out = await self.service.admin_experts()
            if getattr(self, "controller", None) is not None:  # distill.backend ray_train
                from .distiller import controller_report

                out["distill_controller"] = await controller_report(self.controller)
            return out
        if op == "metrics":
            return await self.service.admin_metrics()
        if op == "rollback":
            return await self.service.admin_rollback(expert, to)
        return await self.service.admin_update(expert)

    def __del__(self):
        svc = getattr(self, "service", None)
        if svc is not None:
            svc.close()


def not_running(deployments: list[str]) -> str | None:
    """Why one of these deployments of this replica's app has no running replica, by the Serve
    controller's count, or None when each has one."""
    app = serve.get_replica_context().app_name
    status = serve.status().applications.get(app)
    for name in deployments:
        d = status.deployments.get(name) if status else None
        if d is None:
            return f"{name} has no running replica (not deployed)"
        if not d.replica_states.get("RUNNING"):
            state = getattr(d.status, "value", d.status)  # DeploymentStatus.UPDATING -> UPDATING
            # Not d.message: /health needs no key, and a failed start's message is the replica's traceback
            # (paths, model directories, node addresses). `serve status` shows it to the operator.
            return f"{name} has no running replica ({state}; `serve status` says why)"
    return None


class Readiness:
    """/health's answer: whether the deployments behind a router have a running replica, by the Serve
    controller's count, not by calling a replica (one at max_ongoing_requests would queue the call,
    and every router would read a loaded server as down at once).

    The controller is asked by one call at a time, on a thread of its own, at most every REFRESH_S;
    checks within REFRESH_S of an answer read it. Asked per check, on the replica's shared thread pool, a
    slow controller left a blocked thread behind every probe, which starved the disaggregated router's
    prompt encoding (its completions hung) and marked every router down at the same moment although
    serving goes on without the controller. So while a call is outstanding the last answer stands;
    past GRACE_S it comes with a warning (for monitoring), not a 503 that would take every router
    out of the load balancer while requests are still served."""

    REFRESH_S = 1.0
    GRACE_S = 30.0

    def __init__(self, deployments: list[str]):
        self.deployments = deployments
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="osd-readiness")
        self._pending: asyncio.Task | None = None  # the one outstanding controller call
        self._answer: str | None = None  # the last answer: None, or why not ready
        self._answered_at: float | None = None  # time.monotonic() of it
        self._failure: str | None = None  # the last call's error type, if it raised

    async def _refresh(self) -> None:
        # The state is settled here, before the task completes: whoever awaits it sees the answer.
        try:
            answer = await asyncio.get_running_loop().run_in_executor(self._pool, not_running, self.deployments)
        except Exception as e:  # noqa: BLE001  the controller's failure is reported, not raised into the loop
            # /health needs no key, so it gets the type only: a RayTaskError's text is the controller's
            # traceback (pids, addresses, paths). The log has it, once per new failure, not every second.
            if self._failure != type(e).__name__:  # None again after each answer
                logger.warning("/health: the Serve controller's status failed: %s", e)
            self._failure = type(e).__name__
        else:
            self._answer, self._answered_at, self._failure = answer, time.monotonic(), None
        finally:
            self._pending = None

    async def check(self) -> str | None:
        """Raises RuntimeError(why) unless ready, else returns None or a warning. An answer older than
        REFRESH_S is refreshed, and the check waits up to REFRESH_S for that (for the first answer, as
        long as the caller lets it), so a probe sees the controller's state at the probe, not at the
        probe before."""
        if self._pending is None and (self._answered_at is None or time.monotonic() - self._answered_at >= self.REFRESH_S):
            self._pending = asyncio.ensure_future(self._refresh())
        if self._pending is not None:  # not cancelled with this check: asyncio.wait leaves it running
            await asyncio.wait({self._pending}, timeout=None if self._answered_at is None else self.REFRESH_S)
        if self._answered_at is None:
            raise RuntimeError(f"the Serve controller's status failed: {self._failure}")
        if self._answer is not None:
            raise RuntimeError(self._answer)
        age = time.monotonic() - self._answered_at
        if age > self.GRACE_S:
            return f"the Serve controller has not answered for {age:.0f} s" + (f" ({self._failure})" if self._failure else "")
        return None


class _HandleBackend:
    """The api.py backend interface over a SpecServer deployment handle."""

    def __init__(self, experts: list[str]):
        self._experts = experts
        self._handle: DeploymentHandle | None = None
        self._readiness: Readiness | None = None

    @property
    def handle(self) -> DeploymentHandle:
        # Resolved in the Router replica, on first use: the app (and this object) is pickled apart
        # from the Router class, so the handle passed to Router.__init__ cannot reach it.
        if self._handle is None:
            self._handle = serve.get_deployment_handle("SpecServer", serve.get_replica_context().app_name)
        return self._handle

    def experts(self) -> list[str]:
        return self._experts

    async def ready(self) -> str | None:
        if self._readiness is None:  # made in the replica: a thread pool does not pickle
            self._readiness = Readiness(["SpecServer"])
        return await self._readiness.check()

    async def stream(self, expert: str, prompt, params: SamplingParams):
        payload = {"expert": expert, "prompt": prompt, "params": asdict(params)}
        gen = self.handle.options(stream=True, multiplexed_model_id=expert).generate.remote(payload)
        try:
            async for d in gen:
                if "unknown_expert" in d:
                    raise UnknownExpert(*d["unknown_expert"])
                if "error" in d:
                    raise ValueError(d["error"])
                yield d
        except (GeneratorExit, asyncio.CancelledError):  # the client went away: the engine aborts the request
            gen.cancel()
            raise

    async def admin_experts(self):
        return await self.handle.admin.remote("experts")

    async def admin_metrics(self):
        return await self.handle.admin.remote("metrics")

    async def admin_rollback(self, expert, to):
        return await self.handle.admin.remote("rollback", expert, to)

    async def admin_update(self, expert):
        return await self.handle.admin.remote("update", expert)


def build_app(args: dict | None = None):
    """The application builder named in serve_config.yaml (import_path: deployments.app:build_app)."""
    from osd_serve.service import model_paths

    cfg = parse_config(args)
    if cfg.api_key is None:  # allowed (a private network), but never silently: a key exported in the
        # shell that runs `serve run` is not seen here when the cluster was started elsewhere (ray start)
        logger.warning(
            "no api_key: /v1 is open to anyone who can reach it. Set api_key in the config, or OSD_API_KEY in "
            "the environment of the cluster (ray start, or runtime_env.env_vars)")
    # Build the embedded default pair here, in the application build task, so its progress shows in
    # `serve run`'s log; replicas then find it cached (or build it on another node's disk).
    model_paths(cfg)
    if cfg.topology == "disaggregated":
        from .disagg import DisaggBackend, DraftPool, Verifier

        backend, parts = DisaggBackend(cfg), (DraftPool.bind(cfg.without_keys()), Verifier.bind(cfg.without_keys()))
    else:
        backend, parts = _HandleBackend([e.name for e in cfg.experts]), (SpecServer.bind(cfg.without_keys()),)

    # The FastAPI app needs the config (auth, classifier) now; the backend finds its handles itself,
    # in the replica.
    @serve.deployment(name="Router", max_ongoing_requests=256, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)
    @serve.ingress(make_app(backend, cfg))
    class Router:
        def __init__(self, *deployments: DeploymentHandle):
            self.deployments = deployments  # binding them here is what deploys them with the app

    return Router.bind(*parts)
