"""Distillation across the cluster, one per Serve application: a replay buffer actor over Ray's object
store, and a controller that runs Ray Train jobs on capacity serving leaves idle (their rank-0 worker
guards the candidate there) and publishes draft versions.

    SpecServer replicas (colocated) or Verifier replicas (disaggregated)
        --record--> ReplayBufferActor: ray.put into the object store; keeps refs + sizes
    DistillController: buffer due? + spare capacity? -> TorchTrainer(N workers; rank 0 guards) -> VersionStore
    SpecServer / DraftPool replicas poll the VersionStore and hot-swap (osd_serve/distill/versions.py:VersionWatcher)

The buffer actor (records in the object store, and as files a restart reads back) is
deployments/replay_actor.py; the Train job itself (its worker count and its TorchTrainer run) is
deployments/train_job.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import threading
import time
import warnings
from pathlib import Path

import ray

from osd_serve.distill.joblog import JobLog, json_safe, replace_json
from osd_serve.distill.replay import Backoff, BufferConfig
from osd_serve.distill.spill import pair_of  # noqa: F401  the replicas' API (app.py)

from .replay_actor import RecordRef, ReplayBufferActor, _ReplayBufferActor  # noqa: F401  pickled by reference by name here

from .train_job import (free_orphaned_train_reservations, idle_per_node, plan_workers, remove_stale_runs,  # noqa: F401  the actors' API
                        run_train_job, stale_run_age_s)
# A controller made by an older osd-serve pickled deployments.distiller.train_loop_per_worker by reference:
# its Train workers, importing this file, look it up here
from .train_job import train_loop_per_worker  # noqa: F401,E402

logger = logging.getLogger("ray.serve")
BUFFER_NAME, CONTROLLER_NAME, NAMESPACE = "osd-replay-buffer", "osd-distill-controller", "osd-serve"


class _DistillController:
    """Watches the buffer's triggers and the spare capacity; trains, guards and publishes."""

    HEARTBEAT_TTL_S = 30.0  # a replica silent this long is gone (scaled down, dead): its load no longer counts
    MAX_EVENTS = 1000
    WAIT_WARN_S = 300.0  # a due expert waiting this long for idle capacity is warned of
    SWEEP_S = 30.0  # what killed jobs left (_free_orphans) is looked for at most this often
    REPORT_BUFFER_S = 2.0  # within controller_report's REPORT_TIMEOUT_S

    def __init__(self, draft_path: str, versions_dir: str, train_cfg: dict, steps: int, max_workers: int = 4,
                 heldout: int = 16, poll_s: float = 1.0, keep_versions: int = 5, buffer_name: str = BUFFER_NAME,
                 buffer_cfg: dict | None = None, pair: list[str] | None = None):
        # A restart (max_restarts) re-runs this with its creation's arguments: the last configure() saved
        # the current ones, read back here (a new controller gets connect()'s configure() at once anyway).
        # Always under the creation's versions_dir: that is the only place a restart knows to look, also
        # after a redeploy has moved versions_dir.
        self._settings_path = Path(os.path.expanduser(versions_dir)) / SETTINGS_FILE
        self.configure(draft_path, versions_dir, train_cfg, steps, max_workers, heldout, keep_versions, save=False,
                       buffer_cfg=buffer_cfg, pair=pair)
        self._load_settings()
        self.buffer = ray.get_actor(buffer_name, namespace=NAMESPACE)
        self.load: dict[str, tuple[float, float, float]] = {}  # replica -> (ongoing, capacity, time), from heartbeats
        # Read back after a restart, which now says so: a history that started empty hid the jobs before it.
        self.events = JobLog(self._settings_path.with_name(EVENTS_FILE), self.MAX_EVENTS)
        if _restarted():
            self.events.append({"restarted": "the controller's process died and Ray restarted it; a job it was "
                                             "running then is lost", "time": time.time()})
        self.state = "idle"
        self.waiting: dict[str, tuple[float, bool]] = {}  # a due expert no capacity fits -> (since, warned)
        self.backoff = Backoff()
        self._swept = -math.inf  # when _free_orphans last looked
        self._stop = threading.Event()
        threading.Thread(target=self._loop, args=(poll_s,), daemon=True).start()

    def configure(self, draft_path: str, versions_dir: str, train_cfg: dict, steps: int, max_workers: int = 4,
                  heldout: int = 16, keep_versions: int = 5, save: bool = True, buffer_cfg: dict | None = None,
                  pair: list[str] | None = None, train_time_limit_s: float | None = None) -> None:
        """The actor is detached and outlives the app: a redeploy brings its config here. One
        assignment, read once per job (``_update``), so a running job keeps the settings it started with.
        buffer_cfg, pair: the buffer's, handed to it at each poll (a restarted buffer has its creation's);
        checked here, as a bad one read back from controller.json would fail every poll."""
        if buffer_cfg is not None:
            BufferConfig(**buffer_cfg)  # TypeError/ValueError: _load_settings keeps the creation's settings
        if pair is not None and not (isinstance(pair, list) and all(isinstance(p, str) for p in pair)):
            raise TypeError(f"pair: a list of model paths, got {pair!r}")
        if train_time_limit_s is not None:  # its own keyword: an older controller refuses it (TypeError) in connect()
            train_cfg = {**train_cfg, "time_limit_s": train_time_limit_s}
        self.settings = {"draft_path": draft_path, "versions_dir": Path(os.path.expanduser(versions_dir)),
                         "train_cfg": train_cfg, "steps": steps, "max_workers": max_workers, "heldout": heldout,
                         "keep_versions": keep_versions, "buffer_cfg": buffer_cfg, "pair": pair}
        if save:
            self._save_settings()

    def _save_settings(self) -> None:
        try:  # what a restart (max_restarts) reads back, as __init__ then gets its creation's arguments
            self._settings_path.parent.mkdir(parents=True, exist_ok=True)
            replace_json(self._settings_path, self._plain_settings())
        except OSError as e:
            logger.warning("distill controller: its settings could not be saved for a restart (%s)", e)

    def _load_settings(self) -> None:
        path = self._settings_path
        if not path.exists():
            self._save_settings()
            return
        try:
            self.configure(**json.loads(path.read_text()), save=False)  # the file holds them already
        except (OSError, ValueError, TypeError) as e:  # unreadable, or another version's fields
            logger.warning("distill controller: %s unreadable (%s); its creation's settings stand", path, e)
            self._save_settings()

    def heartbeat(self, replica: str, ongoing: float, capacity: float) -> None:
        self.load[replica] = (ongoing, capacity, time.monotonic())

    def serve_load(self) -> float:
        now = time.monotonic()
        live = [(o, c) for o, c, t in list(self.load.values()) if now - t < self.HEARTBEAT_TTL_S]  # list(): a snapshot
        cap = sum(c for _, c in live)
        return sum(o for o, _ in live) / cap if cap else 0.0

    def history(self) -> list[dict]:
        return list(self.events)

    def status(self) -> dict:
        return {"state": self._state(), "serve_load": self.serve_load(), "updates": len(self.events),
                "settings": self._plain_settings()}

    def _plain_settings(self) -> dict:
        return {**self.settings, "versions_dir": str(self.settings["versions_dir"])}

    def report(self, jobs: int = 10) -> dict:
        """What /admin/experts shows of the controller: its state and its last jobs (published or refused,
        with the guard's reason and scores, or the error). Without it, a controller whose every job failed
        looked the same as an idle one. JSON-safe: a guard's NaN score is null. With the buffer's records per
        expert (``new``: toward the next trigger), or why not: a buffer restarting is waited for only so long."""
        try:
            buffer = ray.get(self.buffer.stats.remote(), timeout=self.REPORT_BUFFER_S)
        except Exception as e:  # noqa: BLE001
            buffer = {"error": f"the replay buffer did not answer ({type(e).__name__})"}
        return json_safe({"state": self._state(), "serve_load": self.serve_load(), "jobs": list(self.events)[-jobs:],
                          "buffer": buffer})

    def _loop(self, poll_s: float) -> None:
        backoff, rearmed = self.backoff, False
        while not self._stop.is_set():
            rearmed = rearmed or self._rearm_killed()  # before any take: once, with the buffer reachable
            self._free_orphans()  # due or not: a quiet server's idle capacity is freed too (rate-limited)
            settings = self.settings  # one deploy's: configure() may replace it from another thread
            try:
                try:
                    due = ray.get(self.buffer.due.remote(settings["buffer_cfg"], settings["pair"]))
                except TypeError:  # a buffer made by an older osd-serve (detached, it outlives an upgrade)
                    due = ray.get(self.buffer.due.remote())
            except Exception as e:  # noqa: BLE001  the buffer restarting: asked again next poll
                self.events.append({"error": repr(e), "time": time.time()})
                logger.warning("distill controller: %r", e)
                due = {}
            for expert, why in due.items():
                if not backoff.ready(expert):
                    continue  # its job failed lately; its trigger stays due (rearm)
                t0, plan = time.time(), None
                try:
                    # In the try: idle_per_node reads Ray's control store; one failed read ended this thread for good
                    plan = plan_workers(idle_per_node(), self.serve_load(), self.settings["max_workers"])
                    if plan is None:  # no spare capacity: the trigger stays due, retried next poll
                        self._no_capacity(expert, why)
                        continue
                    self.waiting.pop(expert, None)
                    self.state = f"training {expert} on {plan}"
                    self.events.append(self._update(expert, why, plan))
                    backoff.succeeded(expert)
                except Exception as e:  # noqa: BLE001  the controller outlives one failed job
                    # time: when it started, as a finished job's (a failed one was stamped when it failed)
                    self.events.append({"expert": expert, "trigger": why, "plan": plan, "error": repr(e), "time": t0,
                                        "seconds": time.time() - t0})
                    logger.warning("distill controller: %s: %r (retried in %.0f s)", expert, e, backoff.failed(expert))
                finally:
                    self.state = "idle"
            for expert in set(self.waiting) - set(due):  # trained, or no longer due
                del self.waiting[expert]
            self._stop.wait(poll_s)

    def _rearm_killed(self) -> bool:
        """Puts back the trigger windows of jobs killed with this controller's former process (due again at
        once, not a whole trigger later). False: the buffer did not answer, asked again at the next poll."""
        try:
            rearmed = ray.get(self.buffer.rearm_taken.remote())
        except AttributeError:  # a buffer made by an older osd-serve keeps no taken windows
            return True
        except Exception as e:  # noqa: BLE001  the buffer restarting (it then holds no records to rearm anyway)
            logger.debug("distill controller: rearming killed jobs' triggers failed: %r", e)
            return False
        if rearmed:
            logger.warning("distill controller: jobs killed with its former process are due again: %s", rearmed)
            self.events.append({"rearmed": rearmed, "time": time.time()})
        return True

    def _free_orphans(self) -> None:
        """What jobs killed with a former incarnation of this controller (a restart runs this loop again)
        left, at most every SWEEP_S, before any plan: their reservations (train_job.py), which held the
        idle capacity while it waited for capacity forever, and their run folders, a full draft each."""
        now = time.monotonic()
        if now - self._swept < self.SWEEP_S:
            return
        self._swept = now
        settings = self.settings
        try:
            remove_stale_runs(settings["versions_dir"] / "ray_train", stale_run_age_s(settings["train_cfg"]))
            freed = free_orphaned_train_reservations(ray.get_runtime_context().get_job_id())
        except Exception as e:  # noqa: BLE001  a Ray whose control-store records read otherwise: plan as before
            logger.debug("distill controller: looking for what killed jobs left failed: %r", e)
            return
        if freed:
            logger.warning("distill controller: freed %d Ray Train reservation(s) left by jobs whose Train controller "
                           "died (%s)", len(freed), ", ".join(freed))
            self.events.append({"freed_reservations": freed, "time": time.time()})

    def _no_capacity(self, expert: str, why: str) -> None:
        """A due expert no idle capacity can train: in the state, warned of once it has waited WAIT_WARN_S. Silent,
        a controller that could never plan (every CPU and GPU held by serving or another reservation) looked idle."""
        since, warned = self.waiting.setdefault(expert, (time.monotonic(), False))
        if not warned and time.monotonic() - since > self.WAIT_WARN_S:
            self.waiting[expert] = (since, True)
            logger.warning("distill controller: %s has been due (%s) for %.0f s with no idle capacity to train on: "
                           "serving holds every CPU and GPU, or another job's reservation does (`ray status`, "
                           "`ray list placement-groups`)", expert, why, time.monotonic() - since)

    def _state(self) -> str:
        if self.state != "idle" or not self.waiting:
            return self.state
        now = time.monotonic()
        return "waiting for idle capacity: " + ", ".join(f"{e} due for {now - t:.0f} s" for e, (t, _) in
                                                          sorted(list(self.waiting.items())))  # list(): a snapshot

    def _update(self, expert: str, why: str, plan: dict) -> dict:
        refs, flags, window = ray.get(self.buffer.take.remote(expert))
        try:
            event = self._job(expert, why, plan, refs, flags, window)
        except Exception:
            self.buffer.rearm.remote(expert, window)  # retried after the loop's back-off, not a whole trigger later
            raise
        if (finish := getattr(self.buffer, "finish", None)) is not None:  # None: a buffer made by an older osd-serve
            # its window is used up: a later restart (of either actor) does not put it back. A window of two
            # is a buffer's made before finish took it (Ray checks the call against this process's class, so
            # the older actor's TypeError would come back only to a ray.get, and this is fire and forget)
            finish.remote(expert, window) if len(window) >= 4 else finish.remote(expert)
        return event

    def _job(self, expert: str, why: str, plan: dict, refs: list, flags: list[bool], window: tuple = ()) -> dict:
        from osd_serve.distill.guard import GuardConfig, split_for_guard
        from osd_serve.distill.versions import VersionStore, draft_fingerprint

        t0 = time.time()
        cfg = self.settings
        draft_path, versions_dir = cfg["draft_path"], cfg["versions_dir"]
        guard_cfg = GuardConfig(max_heldout=cfg["heldout"])
        split = split_for_guard(flags, guard_cfg)
        if split is None:
            return {"expert": expert, "skipped": "too few records", "time": t0}
        train_refs, held_refs = [refs[i] for i in split[0]], [refs[i] for i in split[1]]
        store = VersionStore(versions_dir / expert, cfg["keep_versions"])
        # At most one worker per training record: a worker with none would skip the gradient
        # all-reduce the others wait in (a deadlock until the collective times out).
        plan = {**plan, "num_workers": min(plan["num_workers"], len(train_refs))}
        if store.refresh() is None:
            # Normally a replica published version 0 when it loaded the expert. Before one has (an expert whose
            # traffic never drafted), this is the base draft, marked as such: an expert with a LoRA adapter
            # serves base + adapter, so its replica clears these versions instead of serving the base's.
            # Only if still empty: a replica publishing meanwhile wins.
            from transformers import AutoModelForCausalLM

            initial = {n: t.clone() for n, t in AutoModelForCausalLM.from_pretrained(draft_path).state_dict().items()}
            store.publish(initial, {"reason": "initial draft"}, expect_current=None, draft=draft_fingerprint(initial))
            store.refresh()
        base, base_draft = store.current, store.manifest.get("draft")  # the version this job trains from, of which draft
        state_path = str(store.path(base) / "draft.safetensors")
        # Guarded by the job's rank 0 (train_job.guard_candidate), on the capacity planned for it: the guard
        # loads two drafts and runs their forwards, which here competed with serving for memory and CPUs
        state, metrics = run_train_job(plan, train_refs, draft_path, state_path, cfg["train_cfg"], cfg["steps"],
                                       str(versions_dir / "ray_train"), held_refs, dataclasses.asdict(guard_cfg))
        if metrics.get("time_limited"):
            logger.warning("distill controller: %s: the job stopped at its time limit after %s steps", expert,
                           metrics.get("steps"))
        verdict = metrics.get("verdict") or {"publish": False, "reason": "the job returned no guard verdict",
                                             "candidate": {}, "serving": {}}
        version, reason = None, verdict["reason"]
        if verdict["publish"]:  # only over the version it was trained from: a rollback meanwhile wins
            version = store.publish(state, {"trigger": why, "plan": plan, "candidate": verdict["candidate"],
                                            "serving": verdict["serving"]}, expect_current=base, expect_draft=base_draft)
            reason = reason if version is not None else f"version {base} is no longer current (rolled back or replaced)"
            if version is not None:  # refs in a list: Ray passes them through unresolved
                trained = [i for i in split[0] if flags[i]]
                # by number too (a window of 5): a buffer restarted since holds them under refs of its own
                by_seq = ([window[4][i] for i in trained], window) if len(window) >= 5 else ()
                try:
                    ray.get(self.buffer.retire.remote(expert, [refs[i] for i in trained], *by_seq))
                except Exception as e:  # noqa: BLE001  published: failing the job here rearmed its window, and the
                    # same records were trained again over the version that holds them
                    logger.warning("distill controller: %s: version %s published, retiring its guard samples failed: %r",
                                   expert, version, e)
        return {"expert": expert, "trigger": why, "plan": plan, "published": version is not None, "reason": reason,
                "version": version, "candidate": verdict["candidate"], "serving": verdict["serving"],
                "guarded_on": verdict.get("device"), "time": t0,
                "steps": metrics.get("steps"), "time_limited": metrics.get("time_limited"), "loss_first": metrics.get("loss_first"), "loss_last": metrics.get("loss_last"),
                "seconds": time.time() - t0}


SETTINGS_FILE = "controller.json"
EVENTS_FILE = "controller-jobs.jsonl"


def _restarted() -> bool:
    try:
        with warnings.catch_warnings():  # Ray's own property reads its deprecated actor_id: a warning at each start
            warnings.simplefilter("ignore", DeprecationWarning)
            return ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # noqa: BLE001  not in an actor (tests drive the class directly)
        return False


DistillController = ray.remote(num_cpus=0)(_DistillController)


async def controller_report(controller=None) -> dict:
    """The application's controller's report (looked up by name when not given, as a router holds no handle),
    or why there is none: an admin answer must not fail because the controller is gone."""
    try:
        if controller is None:
            from .config import replica_app

            name = actor_names(replica_app() or "default")[1]
            controller = await asyncio.to_thread(ray.get_actor, name, namespace=NAMESPACE)
        # bounded: a controller restarting (or pending resources) would hold /admin/experts for as long
        return await asyncio.wait_for(controller.report.remote(), REPORT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001
        return {"error": f"the distill controller did not answer ({type(e).__name__})"}


REPORT_TIMEOUT_S = 5.0


def actor_names(app: str) -> tuple[str, str]:
    """The buffer's and the controller's names for one Serve application. Each application distils
    its own pair: on names shared by the cluster, a second app's replicas reconfigured the first's
    controller (its draft and versions_dir), and both apps' records of an expert trained one draft."""
    return f"{BUFFER_NAME}.{app}", f"{CONTROLLER_NAME}.{app}"


def connect(cfg, app: str | None = None) -> tuple:
    """The application's buffer actor and controller (created by whichever of its replicas comes
    first, then found by name, and given this config: they are detached, so they outlive a redeploy
    that changes it); cfg: deployments.config.AppConfig with distill.backend ray_train; app: the Serve
    application (default: the calling replica's)."""
    from osd_serve.service import model_paths

    from .config import replica_app, versions_root

    d = cfg.distill
    app = app or replica_app()
    # versions where this process's watchers read them: outside a replica (a script, a test) that is
    # versions_dir itself, as SpecServer's and DraftPool's (deployments.config.versions_root)
    versions = versions_root(cfg, app)
    buffer_name, controller_name = actor_names(app or "default")  # outside a replica: the default application's
    # Restarted if they die (an OOM kill, a lost node): replicas keep their handles, and
    # fire-and-forget records and heartbeats to a dead actor were lost without a word. The controller reads its
    # last settings back; the buffer its records (replay_actor.py), and the settings at the controller's next poll.
    opts = {"namespace": NAMESPACE, "get_if_exists": True, "lifetime": "detached", "max_restarts": -1}
    buffer_cfg = {"max_bytes": d.buffer_mb << 20, "trigger_records": d.trigger_records, "trigger_age_s": d.trigger_age_s}
    pair = pair_of(cfg)
    # Its calls retried across a restart (3 times at most: not forever a call that kills it each time):
    # records sent while it restarts reach the new process, where they were lost (a kill during a burst
    # lost about 5 of 80). take, finish and rearm are safe to repeat; an add whose reply was lost keeps its
    # record twice, the smaller harm.
    buffer = ReplayBufferActor.options(name=buffer_name, max_task_retries=3, **opts).remote(
        buffer_cfg, str(versions / ".replay"))
    train = {"mode": d.mode, "lr": d.lr, "steps_per_update": d.steps_per_update}
    args = (model_paths(cfg)[1], str(versions), train, d.steps_per_update, d.max_train_workers)
    extra = {"keep_versions": d.keep_versions, "buffer_cfg": buffer_cfg, "pair": pair}
    controller = DistillController.options(name=controller_name, **opts).remote(*args, buffer_name=buffer_name, **extra)
    ray.get(buffer.configure.remote(buffer_cfg, pair))
    try:
        ray.get(controller.configure.remote(*args, train_time_limit_s=d.train_time_limit_s, **extra))
        return buffer, controller
    except TypeError:  # an older controller: its TrainConfig has no time_limit_s, and in train_cfg it failed every job
        logger.warning("%s was made by an older osd-serve: its jobs have no time limit; `ray kill` it (namespace %s) "
                       "to replace it", controller_name, NAMESPACE)
    try:
        ray.get(controller.configure.remote(*args, **extra))
    except TypeError:  # made by an older osd-serve (detached, it outlives an upgrade): no buffer settings
        logger.warning("%s was made by an older osd-serve: a restarted replay buffer gets its settings only from "
                       "the next replica start; `ray kill` it (namespace %s) to replace it", controller_name, NAMESPACE)
        ray.get(controller.configure.remote(*args, keep_versions=d.keep_versions))
    return buffer, controller


def send_record(buffer, record, pair: list[str] | None = None) -> None:
    if record is not None:
        buffer.add.remote(record.expert, record, record.nbytes, pair)  # fire and forget: serving never waits on it


def start_heartbeat(controller, tag: str, load, every_s: float = 2.0) -> None:
    """Tell the controller this replica's (ongoing, capacity) every few seconds, so it trains on CPUs
    only while serving is not busy."""

    def beat() -> None:
        while True:
            try:
                ongoing, capacity = load()
                controller.heartbeat.remote(tag, ongoing, capacity)
            except Exception as e:  # noqa: BLE001  a missed beat is harmless; a dead thread is not
                logger.warning("distill heartbeat from %s failed: %r", tag, e)
            time.sleep(every_s)

    threading.Thread(target=beat, name="osd-heartbeat", daemon=True).start()
