"""Online distillation beside serving: records -> buffer -> trainer -> guard -> version -> hot swap.

The engine's thread only records (a softmax and a copy per step) and, between steps, applies a
published swap. Everything else runs in a background thread on the trainer's private copy of the
draft, so generation never waits for training. The guard compares against its own private copy of
the serving weights, so it never reads parameters the serving thread may be swapping.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .guard import GuardConfig, check, retire_guard_samples, split_for_guard
from .recorder import Recorder, RecordConfig
from .replay import Backoff, ReplayBuffer
from .siblings import learned_at
from .trainer import DistillTrainer
from .versions import VersionStore, draft_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class UpdateResult:
    expert: str
    trigger: str
    published: bool
    reason: str
    version: int | None
    train_records: int
    heldout_records: int
    losses: list[float] = field(default_factory=list)
    candidate: dict = field(default_factory=dict)
    serving: dict = field(default_factory=dict)
    seconds: float = 0.0
    time_limited: bool = False  # stopped taking steps at the trainer's time_limit_s


class OnlineDistiller:
    MAX_UPDATES_KEPT = 1000

    def __init__(self, engine, trainer: DistillTrainer, buffer: ReplayBuffer, store: VersionStore,
                 guard: GuardConfig | None = None, record: RecordConfig | None = None, on_trace=None, files=None,
                 inherit=None):
        """files: a spill.ReplicaSpill the buffer's records are also written to (its on_drop removes them), so
        that a replica restarted on the same slot resumes with them. inherit(draft fingerprint, learned_at(store))
        -> (state, meta) or None: a version chosen later than the store's current, made current as the one to start
        from (siblings.newest_sibling: another replica's; state None: version 0, which a sibling's rollback chose)."""
        self.engine, self.trainer, self.buffer, self.store = engine, trainer, buffer, store
        self.files = files
        self.guard = guard or GuardConfig()
        self.on_trace = on_trace  # called with each finished request's RequestTrace
        self.on_update = None  # called with each UpdateResult (telemetry)
        self.vocab = engine.vocab
        self.serving = copy.deepcopy(engine.draft).eval()  # the guard's copy of what serves now
        # The newest results (for tests and a look from the REPL): a replica runs for weeks, an update
        # every few seconds under load. n_updates counts all of them; on_update sees each.
        self.updates: deque[UpdateResult] = deque(maxlen=self.MAX_UPDATES_KEPT)
        self.n_updates = 0
        self.training = threading.Event()  # set while an update runs (for throughput accounting)
        self._lock = threading.Lock()  # guards the buffer (the serving thread adds to it)
        self._update_lock = threading.Lock()  # one update (or rollback) at a time: they share the trainer
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.backoff = Backoff()  # per expert, for the background loop's retries
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # the last failed update's exception, for /admin/experts
        base = draft_fingerprint(engine.draft.state_dict())
        if store.current is not None and store.manifest.get("draft", base) != base:
            # Versions of another draft (a redeploy changed it, or an adapter): same shapes would load
            # without complaint and serve the wrong model's weights. They are no use to this one.
            if store.clear(unless_draft=base):  # under the store's lock: unless it holds this draft's by now
                logger.warning("versions under %s belonged to another draft (or this one loaded in float16, whose "
                               "rounding differs); starting from version 0", store.root)
        fresh = store.current is None
        if fresh:  # version 0: the draft we started from, so rollback can reach it
            store.publish(trainer.serving_state(), {"reason": "initial draft"}, draft=base)
            self._adapter_base = store.current
        elif "draft" not in store.manifest:  # a store from before fingerprints: it is this draft's from now on
            store.set_draft(base)
        state = None
        if inherit is not None and (found := inherit(base, learned_at(store))) is not None:  # a sibling's, chosen later
            state = self._inherit(store, base, *found)
        if state is not None or not fresh or store.current != 0:  # distilled into before (a restart), or inherited
            state = store.load(store.current) if state is None else state
            engine.swap_draft(state, store.current)  # refuses a store of another draft's shapes
            self.serving.load_state_dict(state, strict=False)
            trainer.reset_to(state)
            self._adapter_base = store.current  # LoRA mode: the adapters from here on apply over this version
        engine.draft_version = store.current
        engine.recorder = Recorder(record, on_finish=self._on_finish)

    @staticmethod
    def _inherit(store: VersionStore, base: str, state: dict | None, meta: dict) -> dict | None:
        """A sibling's version made this store's current (siblings.newest_sibling); its weights, or None if
        nothing changed. state None: the sibling's rollback to version 0, the configured draft."""
        if state is None:  # unless this store has no version 0 (pruned by an osd-serve from before it was kept)
            return None if store.current == 0 or 0 not in store.versions else store.rollback(to=0)[1]
        return state if store.publish(state, meta, expect_current=store.current, expect_draft=base) is not None else None

    # ---- serving thread side ------------------------------------------------------------------------
    def _on_finish(self, record, trace) -> None:
        if record is not None:
            with self._lock:
                if self.buffer.add(record) and self.files is not None:
                    self.files.kept(record)
            self._wake.set()
        if self.on_trace is not None:
            self.on_trace(trace)

    # ---- one update -----------------------------------------------------------------------------------
    def due(self) -> dict[str, str]:
        with self._lock:
            return self.buffer.due()

    def update(self, expert: str = "default", trigger: str = "manual") -> UpdateResult | None:
        """Train on the expert's shard, guard, and publish (or refuse). None if too few records.

        An update that raises (an admin call as well as the background loop's) leaves the student at
        the last published weights and is recorded in ``error`` and ``updates``, then re-raises."""
        with self._update_lock:
            with self._lock:
                shard = self.buffer.shard(expert)
                records, window = list(shard.records), shard.mark_updated()
                mark = self.files.mark() if self.files is not None else None
            try:
                res = self._update(expert, trigger, records)
            except Exception as e:
                with self._lock:
                    shard.rearm(window)
                self._failed(expert, trigger, e)
                raise
            if self.files is not None:  # so also after a restart: a window closed here is not counted again
                with self._lock:
                    self.files.finished(expert, mark, shard.seen)
            return res

    def _update(self, expert: str, trigger: str, records: list) -> UpdateResult | None:
        t0 = time.perf_counter()
        split = split_for_guard([r.heldout for r in records], self.guard)
        if split is None:
            return None
        train, heldout = [records[i] for i in split[0]], [records[i] for i in split[1]]
        self.training.set()
        try:
            losses = self.trainer.train(train)
            if self.trainer.time_limited:  # a draft too big for this device's steps, or a device shared with serving
                logger.warning("distill %s: the update stopped at its time limit (%g s) after %d steps",
                               expert, self.trainer.cfg.time_limit_s, len(losses))
            state = self.trainer.serving_state()
            # Scored as it would serve: the published state in the serving draft's dtype. The student
            # itself (float32 masters under a bfloat16 draft) moved the guard's alpha by the dtype alone,
            # publishing near no-op versions and refusing others. (The Ray job's rank 0 guards it so: train_job.guard_candidate.)
            candidate = copy.deepcopy(self.serving)
            candidate.load_state_dict(state, strict=False)
            verdict = check(candidate, self.serving, heldout, self.vocab, self.guard, candidate_state=state,
                            steps_taken=len(losses))
            version = None
            if verdict.publish:
                meta = {"trigger": trigger, "expert": expert, "candidate": verdict.candidate,
                        "serving": verdict.serving, "loss_last": losses[-1] if losses else None,
                        **({"pair": self.files.pair} if self.files is not None else {})}  # what it learned from (siblings.py)
                writer = None
                if self.trainer.cfg.mode == "lora":  # the adapter is a delta over the version the LoRA was put on
                    writer, meta["adapter_base_version"] = self.trainer.save_adapter, self._adapter_base
                version = self.store.publish(state, meta, adapter_writer=writer)
                self.serving = candidate  # it holds the published state already
                self.trainer.commit()
                self.engine.swap_draft(state, version)
                with self._lock:  # what serves now has learnt them: no later guard may score on them
                    if self.files is not None:
                        self.files.retired(train)
                    retire_guard_samples(train)
            else:
                self.trainer.revert()
        finally:
            self.training.clear()
        res = UpdateResult(expert, trigger, verdict.publish, verdict.reason, version, len(train), len(heldout), losses,
                           verdict.candidate, verdict.serving, time.perf_counter() - t0, self.trainer.time_limited)
        self._done(res)
        return res

    def _done(self, res: UpdateResult) -> None:
        self.updates.append(res)
        self.n_updates += 1
        if self.on_update is not None:
            self.on_update(res)

    def rollback(self, to: int | None = None) -> int:
        with self._update_lock:
            return self._rollback(to)

    def _rollback(self, to: int | None) -> int:
        # What can fail comes before the manifest moves: reading the version, and the new student (a copy
        # of the draft, an upcast, peft; out of memory on a GPU). Failing after the move, it left the
        # store and the guard's copy on the old version while the engine and the trainer kept the newer.
        version, was = self.store.rollback_target(to)
        state = self.store.load(version)
        student = self.trainer.build_student(state)
        self.store.make_current(version, expect_current=was)
        self.serving.load_state_dict(state, strict=False)
        self.trainer.adopt(student)
        self._adapter_base = version
        self.engine.swap_draft(state, version)
        return version

    # ---- background thread -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="osd-distill", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        backoff = self.backoff
        while not self._stop.is_set():
            self._wake.wait(timeout=0.5)  # the timeout lets age triggers fire without traffic
            self._wake.clear()
            for expert, why in self.due().items():
                if not backoff.ready(expert):
                    continue
                try:
                    self.update(expert, why)
                    backoff.succeeded(expert)
                except Exception:  # noqa: BLE001  one failed update (OOM, full disk) must not end distillation;
                    backoff.failed(expert)  # update() recorded it and left the trigger due

    def _failed(self, expert: str, trigger: str, e: Exception) -> None:
        """Serving goes on with the last good draft; the student restarts from it, not from a
        half-trained state (steps taken before the fault, and their AdamW moments). Under _update_lock."""
        logger.error("online distillation of %s failed: %r", expert, e, exc_info=e)
        self.error = repr(e)
        self.training.clear()
        self.trainer.revert()
        res = UpdateResult(expert, trigger, False, f"error: {e!r}", None, 0, 0)
        self._done(res)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
