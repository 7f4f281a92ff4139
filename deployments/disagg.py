"""The disaggregated topology (`topology: disaggregated`): thin Ray Serve wrappers over osd_serve/disagg.py.

  DraftPool  the base draft, one DraftWorker per expert (its LoRA merged), loaded through Ray Serve
             model multiplexing (model id = expert, so an expert's calls go to replicas holding it);
             @serve.batch batches proposals across sequences (Serve splits batches by model id).
             After answering, it drafts ahead while the verifier works.
  Verifier   the target; @serve.batch verifies many sequences in one forward. Routed by Ray Serve's
             consistent-hash request router on session_id = sequence id, so a sequence returns to
             the replica holding its KV cache; if it does not (scale-up, failover), it is recomputed.
  The Router (deployments/app.py) drives each request: one propose and one verify call per step.

One executor thread per replica runs all torch work in order: a proposal queued behind a draft-ahead
waits for it, and the event loop stays free for Serve's batching and routing.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
import time
import uuid
import weakref
from collections import Counter, OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ray import serve

from osd_serve.config import SamplingParams
from osd_serve.disagg import DraftWorker, ProposeItem, Proposal, TargetVerifier, Verdict, VerifyItem, run_request, version_row
from osd_serve.distill.versions import VersionStore, read_manifest
from osd_serve.logprobs import delta_body
from osd_serve.output import Request, finish_counts, fit_max_tokens
from osd_serve.protocol import UnknownExpert
from osd_serve.serving import StallWatch

from .api import BackPressureError
from .app import Readiness
from .config import GRACEFUL_SHUTDOWN_S, AppConfig, check_gpu_reservation, replica_app, versions_root

IDLE_SEQUENCE_S = 600.0  # see Verifier._forget_idle
RELEASE_TRIES = 6  # a release refused by a full queue is sent again, 0.05 s later, then 0.1 s, ... (1.55 s in all)
RELEASED_KEPT = 4096  # released ids a replica remembers; a call queued before its release is seconds old
STORE_READ_S = 1.0  # how long a Verifier trusts the store's manifest it last read (Verifier._note_version)
NOTE_TIMEOUT_S = 5.0  # how long a rollback waits to tell the Verifier (its answer does not depend on it)


def _remember_release(released: OrderedDict[str, None], seq_id: str) -> None:
    """Released ids, newest last: a call for the sequence already queued when its release came (its
    client went away) must not bring it back."""
    released[seq_id] = None
    while len(released) > RELEASED_KEPT:
        released.popitem(last=False)


def _report_ahead(fut) -> None:
    """Drafting ahead is a guess: when it fails, the next step drafts as usual (BatchKV.forward cuts a
    failed forward's columns back), so it is logged, not raised."""
    if not fut.cancelled() and fut.exception() is not None:
        logging.getLogger(__name__).warning("drafting ahead failed; the next step drafts as usual: %r", fut.exception())


CONSISTENT_HASH = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


def _load(cfg: AppConfig, role: str):
    """(model of that role, vocab, max_model_len), the pair built first if it is the default."""
    from osd_serve.loading import check_same_vocab, check_vocab_rows, load_model, load_tokenizer, pack_target, pair_limits
    from osd_serve.service import model_config

    check_gpu_reservation(cfg, "Verifier" if role == "target" else "DraftPool")
    mc = model_config(cfg)
    # as load_pair does in the colocated topology: a replica with a mismatched pair never starts
    tok = load_tokenizer(mc.target)
    check_same_vocab(tok, load_tokenizer(mc.draft, "draft"))
    vocab, max_len = pair_limits(mc.target, mc.draft, cfg.max_model_len)
    dtype = mc.resolved_dtype() if role == "target" else mc.resolved_draft_dtype()
    model = load_model(mc.target if role == "target" else mc.draft, role, mc.resolved_device(), dtype)
    check_vocab_rows(model, tok.vocab_size, role)  # the base vocabulary, as load_pair
    if role == "target":
        pack_target(model, mc)
    return model, vocab, max_len


def _versions_dir(cfg: AppConfig) -> Path:
    return versions_root(cfg, replica_app())  # the controller's (distiller.connect), in every replica of the app


class _Batched:
    """Applies the config's batch size and wait to a replica's @serve.batch method, and runs its torch
    work on one thread whose calls the health check times."""

    def _configure(self, method, cfg: AppConfig) -> None:
        method.set_max_batch_size(cfg.max_batch_size)
        method.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="osd-torch")
        self.stall = StallWatch(cfg.stall_timeout_s)

    def _timed(self, fn, *args):  # on the torch thread
        with self.stall.running():
            return fn(*args)

    def _submit(self, fn, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.pool, self._timed, fn, *args)

    async def _run(self, fn, *args):
        return await self._submit(fn, *args)

    def _free_released(self, items, release) -> None:  # the torch thread, after a call that made rows
        for it in items:
            if it.seq_id in self.released:
                release(it.seq_id)

    async def check_health(self) -> None:
        # Serve's probe: a torch call hung past stall_timeout_s (the event loop stays free, so Serve's
        # own liveness ping passes) has the replica replaced; its requests' calls then fail, and the
        # router ends them with finish_reason "error" instead of leaving them waiting.
        why = self.stall.stalled()
        if why is not None:
            raise RuntimeError(why)


@serve.deployment(name="DraftPool", max_ongoing_requests=256, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)
class DraftPool(_Batched):
    def __init__(self, cfg: dict):
        from osd_serve.distill.versions import VersionWatcher

        self.cfg = AppConfig.model_validate(cfg)
        self.base, self.vocab, _ = _load(self.cfg, "draft")
        self.adapters = {e.name: e.adapter for e in self.cfg.experts}
        self._configure(self.propose, self.cfg)
        # Weak: @serve.multiplexed's LRU cache owns the workers. When it evicts one past its cap it only
        # drops its reference (and calls __del__, which a DraftWorker has none of), so a strong dict here
        # kept every expert's draft copy and KV caches loaded and the cap freed nothing.
        self.workers: weakref.WeakValueDictionary[str, DraftWorker] = weakref.WeakValueDictionary()
        self.released: OrderedDict[str, None] = OrderedDict()  # _remember_release; read on the torch thread
        # Online distillation: the cluster distiller publishes versions; each loaded expert is hot-swapped
        # on the torch thread, between batches, so no request fails or waits for more than one swap.
        # loaded: an evicted expert's versions are not read (each a whole draft) until it loads again.
        self.watcher = VersionWatcher(_versions_dir(self.cfg), self._swap, loaded=self.workers.__contains__) \
            if self.cfg.distill.enabled else None

    def _swap(self, expert: str, state: dict, version: int) -> None:  # the watcher's thread
        worker = self.workers.get(expert)
        if worker is None:  # evicted since the watcher asked: loaded again, watch() gives it the current version
            return
        self.pool.submit(self._timed, worker.swap, state, version).result()

    @serve.multiplexed(max_num_models_per_replica=64)
    async def get_worker(self, expert: str) -> DraftWorker:
        if expert not in self.adapters:
            raise UnknownExpert(expert, self.adapters)
        return await self._run(self._new_worker, expert)

    def _new_worker(self, expert: str) -> DraftWorker:
        # On the torch thread, in one go: a swap the watcher queues meanwhile runs after this, in order.
        from osd_serve.service import expert_draft

        draft = expert_draft(self.base, self.adapters[expert], expert)
        ahead = self.cfg.draft_ahead
        if ahead == "auto":
            ahead = next(draft.parameters()).device.type == "cuda"
        worker = self.workers[expert] = DraftWorker(draft, self.vocab, ahead=ahead)
        if self.watcher is not None:
            version, state = self.watcher.watch(expert, draft.state_dict)
            if state is not None:
                worker.swap(state, version)
            worker.version = version
        return worker

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002)
    async def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        worker = await self.get_worker(serve.get_multiplexed_model_id())
        out = await self._run(self._propose, worker, items)
        ahead = self._submit(worker.draft_ahead)  # overlaps verification
        ahead.add_done_callback(_report_ahead)  # not awaited: its failure would otherwise go unseen
        return out

    def _propose(self, worker: DraftWorker, items: list[ProposeItem]) -> list[Proposal]:  # the torch thread
        out = worker.propose(items)
        # A release that came while this call waited (for its expert to load, or in the batch queue) found
        # no row to free, and the call has just made one: freed now, before drafting ahead for it. Else
        # it stayed until it idled out (IDLE_ROW_S), a long prompt's cache on the draft's device.
        self._free_released(items, worker.release)
        return out

    async def release(self, seq_id: str) -> None:
        _remember_release(self.released, seq_id)
        # Not get_worker: on a replica without this expert (evicted, or the release routed elsewhere) it
        # loaded a whole draft, evicting another expert, to free a sequence that was never here.
        worker = self.workers.get(serve.get_multiplexed_model_id())
        if worker is not None:
            await self._run(worker.release, seq_id)


@serve.deployment(name="Verifier", max_ongoing_requests=256, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
                  request_router_config={"request_router_class": CONSISTENT_HASH})
class Verifier(_Batched):
    def __init__(self, cfg: dict):
        from osd_serve.telemetry import Telemetry

        self.cfg = AppConfig.model_validate(cfg)
        self.recomputed = 0
        # Sequence id -> (expert, monotonic time of its latest verify), until released; least recently
        # verified first (each verify moves its sequence to the end), so idle ones are found at the front.
        self.live: dict[str, tuple[str, float]] = {}
        # _remember_release: a verify already queued must not count the sequence live again. (Its cache
        # row and record trace are bounded by the core's LRU caps.)
        self.released: OrderedDict[str, None] = OrderedDict()
        self.versions: dict[str, int] = {}  # expert -> the draft version of the latest proposal verified
        self.store_manifest: dict[str, tuple[dict | None, float]] = {}  # expert -> (its store's manifest, read when)
        # expert -> released sequences by finish_reason, as the router reports it (none: its client went
        # away, "abort"); /admin/experts' "finished", as the colocated engine counts them
        self.finished: defaultdict[str, Counter] = defaultdict(Counter)
        target, vocab, _ = _load(self.cfg, "target")
        recorder = None
        tag = serve.get_replica_context().replica_id.unique_id
        if self.cfg.distill.enabled:  # backend ray_train (config.py): records go to the application's buffer
            from osd_serve.distill.recorder import RecordConfig, Recorder

            from .distiller import connect, pair_of, start_heartbeat

            recorder = Recorder(RecordConfig(keep=self.cfg.distill.keep, topk=self.cfg.distill.record_topk), max_traces=1024)
            self.buffer, controller = connect(self.cfg)
            self.pair = pair_of(self.cfg)
            start_heartbeat(controller, tag, lambda: (len(self.live), self.cfg.max_batch_size))
        self.core = TargetVerifier(target, vocab, recorder=recorder)
        w = self.cfg.wandb
        self.telemetry = Telemetry(w.mode, w.project, w.dir, w.log_every_s,
                                   config=self.cfg.without_keys(), name=f"osd-verifier-{tag}")
        self._configure(self.verify, self.cfg)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002)
    async def verify(self, items: list[VerifyItem]) -> list[Verdict]:
        now = time.monotonic()
        for it in items:
            if it.seq_id not in self.released:
                self.live.pop(it.seq_id, None)
                self.live[it.seq_id] = (it.expert, now)
        self._forget_idle(now)
        verdicts, stats = await self._run(self._verify, items)
        self.recomputed += sum(v.recomputed for v in verdicts)
        for expert, st in stats.items():
            self.telemetry.on_step(expert, st)
        for it in items:
            if it.draft and it.draft_version != self.versions.get(it.expert):
                await self._note_version(it.expert, it.draft_version, now)
        return verdicts

    async def _note_version(self, expert: str, version: int, now: float) -> None:
        """A proposal from another version than the last one logged: a row if version_row says so, from the
        shared store's manifest, read at most once a second per expert, off the loop."""
        was, manifest = self.versions.get(expert), None
        if was is not None and self.cfg.distill.enabled:  # the first version seen is logged whatever it is
            entry = self.store_manifest.get(expert)
            manifest = entry[0] if entry else None
            if entry is None or now - entry[1] > STORE_READ_S:
                try:
                    manifest = await asyncio.to_thread(read_manifest, _versions_dir(self.cfg) / expert)
                except (OSError, ValueError) as e:  # a shared disk's hiccup (ESTALE): the last one read stands
                    logging.getLogger(__name__).debug("reading %s's versions failed: %r", expert, e)
                if self.store_manifest.get(expert) is not entry:
                    return  # note_rollback meanwhile: this read may predate it; the next proposal reads again
                self.store_manifest[expert] = manifest, now
        if (row := version_row(version, was, manifest)) is not None:
            self.versions[expert] = version
            self.telemetry.on_event(expert, **row)

    async def note_rollback(self, expert: str, version: int, newest: int | None = None) -> None:
        """A rollback to version (admin): its row and serving_version now, not at the next proposal; the
        store, which the Router has rolled back, is read again at the next. newest: from older Routers, unused."""
        self.store_manifest[expert] = None, float("-inf")  # a new entry: a read under way is dropped, the next reads
        self.versions[expert] = version
        self.telemetry.on_event(expert, version=version, rollback=1)

    def _verify(self, items: list[VerifyItem]):  # the torch thread
        out = self.core.verify(items)
        # As DraftPool._propose: a release that overtook this call in the batch queue found the row gone,
        # and the call has just rebuilt it (the whole history): freed now, not after IDLE_ROW_S. Its
        # recorder trace is left alone: this call may have been queued on this thread before the
        # release's own finish(), which makes the replay record from it (a late one goes by LRU).
        self._free_released(items, self.core.release)
        return out

    async def release(self, seq_id: str, expert: str, latency_s: float, *, finish_reason: str | None = None,
                      prompt_ids: list[int] | None = None, output_ids: list[int] | None = None) -> None:
        """The sequence is done: free its cache; with distillation on, send its replay record."""
        from .distiller import send_record

        self.telemetry.on_request(expert, latency_s, finish_reason)
        self.finished[expert][finish_reason or "abort"] += 1
        self.live.pop(seq_id, None)
        _remember_release(self.released, seq_id)
        await self._run(self.core.release, seq_id)
        if prompt_ids is not None:
            send_record(self.buffer, await self._run(self.core.finish, seq_id, prompt_ids, output_ids), self.pair)

    def _forget_idle(self, now: float) -> None:
        # A sequence is verified every step, so one idle for minutes lost its release (its Router
        # replica died): stop counting it as running, for /admin/experts and for the distill
        # controller, which trains on GPUs only while serving leaves them idle. Its cache goes by LRU.
        while self.live and now - next(iter(self.live.values()))[1] > IDLE_SEQUENCE_S:
            del self.live[next(iter(self.live))]

    def metrics(self) -> dict:
        self.telemetry.maybe_log(force=True)  # closes the window, as in SpecService.admin_metrics
        return {"history": self.telemetry.recent(), "recomputed_tokens": self.recomputed}

    async def running(self) -> dict:
        """Per expert: sequences holding a KV cache on this replica, the draft version serving it
        (that of the latest proposal verified here; None before any) and the sequences released here by
        finish_reason. Async, so it runs on the event loop like verify() and release(), which change
        what it reads: a plain method runs in Ray's thread pool."""
        self._forget_idle(time.monotonic())
        experts = {*self.versions, *self.finished, *(e for e, _ in self.live.values())}
        out = {e: {"running": 0, "serving_version": self.versions.get(e), "finished": finish_counts(self.finished.get(e, {}))}
               for e in experts}
        for e, _ in self.live.values():
            out[e]["running"] += 1
        return out

    def __del__(self):  # Ray Serve's shutdown hook for a replica, as SpecServer's: the W&B run gets its last row
        telemetry = getattr(self, "telemetry", None)
        if telemetry is not None:
            telemetry.close()


class DisaggBackend:
    """The api.py backend interface, driving requests across DraftPool and Verifier."""

    def __init__(self, cfg: AppConfig):
        self.cfg = cfg
        self._ready = False
        self._setup_task: asyncio.Future | None = None  # the one set-up; outlives a caller that gives up
        self._readiness: Readiness | None = None
        self._releasing: set[asyncio.Task] = set()

    async def _ensure_ready(self) -> None:
        # In the Router replica, on first use (this object is pickled with the FastAPI app). In a
        # thread: on a node without the default pair cached, model_paths builds it (minutes), and on the
        # event loop that would stall every route, /health included. One task sets up and every caller
        # waits on it (shielded: a caller cancelled or timed out leaves it going); a failed one reruns.
        if self._ready:
            return
        if self._setup_task is None or self._setup_task.done():
            self._setup_task = asyncio.ensure_future(self._set_up())
        await asyncio.shield(self._setup_task)

    async def _set_up(self) -> None:
        await asyncio.to_thread(self._load)
        app = serve.get_replica_context().app_name
        self.drafts = serve.get_deployment_handle("DraftPool", app)
        self.verifier = serve.get_deployment_handle("Verifier", app)
        self._ready = True

    def _load(self) -> None:
        from transformers import GenerationConfig

        from osd_serve.loading import expand, load_tokenizer, pair_limits
        from osd_serve.output import eos_token_ids
        from osd_serve.service import model_paths

        target, draft = model_paths(self.cfg)
        self.tokenizer = load_tokenizer(target)
        self.vocab, self.max_len = pair_limits(target, draft, self.cfg.max_model_len)
        try:
            gen = GenerationConfig.from_pretrained(expand(target))
        except OSError:
            gen = None
        self.eos = eos_token_ids(gen, self.tokenizer)

    def experts(self) -> list[str]:
        return [e.name for e in self.cfg.experts]

    async def _ensure_ready_as_server(self) -> None:
        """_ensure_ready, its failure as the server's: /health needs no key, and a completion's 400 would
        blame the client, while a load's message names model paths and hosts. The log keeps it."""
        try:
            await self._ensure_ready()
        except Exception as e:  # noqa: BLE001
            logging.getLogger(__name__).warning("router set-up failed: %r", e)
            raise RuntimeError(f"the router's set-up failed ({type(e).__name__}); its log says why") from None

    async def ready(self) -> str | None:
        await self._ensure_ready_as_server()  # /health sets up too: a load balancer sends nothing before it reads ready
        if self._readiness is None:  # made in the replica: a thread pool does not pickle
            self._readiness = Readiness(["DraftPool", "Verifier"])
        return await self._readiness.check()

    async def stream(self, expert: str, prompt, params: SamplingParams):
        from osd_serve.protocol import prepare_prompt

        if params.auto_k:  # before any setup: a 400 naming the field, as AppConfig refuses it for the server
            raise ValueError("num_speculative_tokens: 'auto' needs the colocated topology; give an integer")
        await self._ensure_ready_as_server()
        t0 = time.perf_counter()
        # in a thread: a long prompt takes seconds to encode, which would stall this router's event loop
        text, ids = await asyncio.to_thread(prepare_prompt, self.tokenizer, self.vocab, self.max_len, prompt, params)
        params = fit_max_tokens(params, len(ids), self.max_len)
        req = Request(f"seq-{uuid.uuid4().hex}", text, ids, params, None, expert=expert)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        drafts = self.drafts.options(multiplexed_model_id=expert)
        verifier = self.verifier.options(session_id=req.request_id)
        try:
            try:
                async for d in run_request(req, seed, self.tokenizer, self.eos, drafts.propose.remote, verifier.verify.remote):
                    yield delta_body(d, self.tokenizer, len(ids))
            except Exception as e:  # noqa: BLE001  a failed call (a replica died, a full queue): raised to the API
                # which answers as colocated: before the first token a 503 for a full queue, else a 500 (logged
                # there); after it, the stream's error event, or the whole completion's 503 or 500
                req.finish_reason = "error"  # as released: not "abort", which is a client gone away
                cause = getattr(e, "cause", None)  # a RayTaskError's: what the replica raised
                lacks = e if isinstance(e, UnknownExpert) else cause
                if isinstance(lacks, UnknownExpert):  # a DraftPool replica from before a redeploy
                    raise UnknownExpert(lacks.expert, lacks.known) from None  # the API's 503 naming expert, as colocated
                if isinstance(e, ValueError) and not isinstance(cause, BaseException):
                    raise RuntimeError(f"the request loop failed: {type(e).__name__}") from e  # never the client's 400
                raise
        finally:  # finished, failed or the client went away: free the sequence on both sides, without waiting
            record = {"prompt_ids": req.prompt_ids, "output_ids": req.output_ids} if self.cfg.distill.enabled else {}
            release = self._release(drafts, verifier, req.request_id, expert, time.perf_counter() - t0,
                                    req.finish_reason, record)
            # In a fresh context, so the calls are not children of this request: when a client goes away,
            # Ray Serve cancels the request's child calls still pending assignment (Replica._on_request_cancelled),
            # and a lost release would leave the sequence live on the Verifier. (create_task copies the context
            # it is called in; its context= keyword is Python 3.11's, and pyproject allows 3.10.)
            task = contextvars.Context().run(asyncio.get_running_loop().create_task, release)
            self._releasing.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._releasing.discard)

    @staticmethod
    async def _release(drafts, verifier, seq_id: str, expert: str, latency_s: float, finish: str | None,
                       record: dict) -> None:
        # keywords past the first three: a Verifier of another version (a rolling upgrade) never reads
        # the prompt ids as the finish reason
        calls = {"DraftPool": lambda: drafts.release.remote(seq_id), "Verifier": lambda: verifier.release.remote(
            seq_id, expert, latency_s, finish_reason=finish, **record)}
        for attempt in range(RELEASE_TRIES):
            results = await asyncio.gather(*(call() for call in calls.values()), return_exceptions=True)
            # refused by a full queue (max_queued_requests): never reached a replica, so sent again; a lost
            # release keeps the sequence running on the Verifier for IDLE_SEQUENCE_S and its rows for IDLE_ROW_S
            full = {where: call for (where, call), r in zip(calls.items(), results) if isinstance(r, BackPressureError)}
            for where, r in zip(calls, results):
                if isinstance(r, BaseException) and (where not in full or attempt == RELEASE_TRIES - 1):
                    logging.getLogger(__name__).warning("releasing %s on the %s failed: %r", seq_id, where, r)
            if not full or attempt == RELEASE_TRIES - 1:
                return
            calls = full
            await asyncio.sleep(0.05 * 2 ** attempt)

    async def admin_experts(self):
        # Verifier replicas are not addressable one by one through a handle; this asks one of them
        # (all of them when there is a single replica, the default).
        await self._ensure_ready()
        running = await self.verifier.running.remote()
        out = {}
        for e in self.experts():
            seen = running.get(e, {})
            # serving_version: what the verifier saw proposals come from, i.e. what DraftPool serves
            # (the store's current version reaches DraftPool at its next poll).
            out[e] = {"topology": "disaggregated", "running": seen.get("running", 0),
                      "serving_version": seen.get("serving_version"), "finished": seen.get("finished", finish_counts({}))}
            if self.cfg.distill.enabled:
                out[e]["versions"] = await asyncio.to_thread(self._versions, e)
        if not self.cfg.distill.enabled:
            return {"experts": out}
        from .distiller import controller_report

        return {"experts": out, "distill_controller": await controller_report()}

    def _versions(self, expert: str) -> list[int]:
        path = _versions_dir(self.cfg) / expert
        return VersionStore(path).versions if path.exists() else []

    async def admin_metrics(self):
        await self._ensure_ready()
        return await self.verifier.metrics.remote()

    async def admin_rollback(self, expert, to):
        # The store is shared by every DraftPool replica (and the controller trains from its current
        # version): rolling its manifest back is what they all pick up at their next poll.
        if not self.cfg.distill.enabled:
            raise ValueError("rollback: distill.enabled is false, so there are no draft versions")
        store = VersionStore(_versions_dir(self.cfg) / expert)
        version, _ = await asyncio.to_thread(store.rollback, to, False)  # the Router serves no draft: no load
        try:  # the event row and serving_version: the rollback itself is done whatever this does
            # Not through _ensure_ready: a Router whose set-up fails can still roll back
            verifier = getattr(self, "verifier", None) or serve.get_deployment_handle("Verifier", replica_app())
            # Bounded: with no Verifier replica running (a redeploy, a crash loop) Serve queues the call
            await asyncio.wait_for(verifier.note_rollback.remote(expert, version), NOTE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  (a Verifier redeployed without note_rollback, or gone)
            logging.getLogger(__name__).warning("rollback of %s to version %s: the Verifier was not told (%r)",
                                                expert, version, e)
        return {"expert": expert, "serving_version": version}

    async def admin_update(self, expert):
        raise ValueError("update: with distill.backend ray_train the cluster controller trains when the replay "
                         "buffer's trigger fires (distill.trigger_records, distill.trigger_age_s)")
