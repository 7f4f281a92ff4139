"""Acceptance trends for people (W&B) and for machines (Prometheus via ray.serve.metrics).

W&B runs offline by default: run files land under ``dir`` and can be synced later with
``wandb sync``; with WANDB_API_KEY set (mode auto) they stream online. Prometheus metrics take
vLLM's spec-decode names and meanings where one exists (Ray exports them with its ``ray_`` prefix,
vLLM with ``vllm:``, so a vLLM dashboard needs its prefix changed), and osd_ names for the rest.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
import warnings
from collections import defaultdict, deque


def _finite(v) -> bool:
    """A number a row may hold: the guard keeps a NaN acceptance as its verdict's reason, and a NaN in
    the history made every /admin/metrics answer a 500 (JSON has no NaN) until 500 rows pushed it out."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def _percentile(xs, q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]  # nearest rank: p50 of 1..4 is 2, p99 of 1..100 is 99


class _Prometheus:
    """Counters through ray.serve.metrics when running inside Ray Serve; no-ops elsewhere."""

    def __init__(self) -> None:
        try:
            import ray
            from ray.serve import metrics
        except ImportError:
            self.ok = False
            return
        if not ray.is_initialized():  # outside a Ray worker: do not start a cluster just for counters
            self.ok = False
            return
        self.ok = True
        tags = ("expert",)
        self.draft = metrics.Counter("spec_decode_num_draft_tokens", "draft tokens proposed", tag_keys=tags)
        self.accepted = metrics.Counter("spec_decode_num_accepted_tokens", "draft tokens accepted", tag_keys=tags)
        self.emitted = metrics.Counter("spec_decode_num_emitted_tokens", "tokens emitted", tag_keys=tags)
        # The gauges below hold their last window once traffic stops, and averaging ratios over replicas is
        # wrong: rate(accepted) / rate(tested) over any range and any replicas is α, from counters.
        self.tested = metrics.Counter("osd_tested_draft_tokens", "draft tokens tested (accepted or rejected)", tag_keys=tags)
        # vLLM's rate is accepted / proposed; alpha, what the speedup formula takes, is accepted / tested
        # (a draft token after a rejection is never tested).
        self.rate = metrics.Gauge("spec_decode_draft_acceptance_rate", "accepted / proposed, last window", tag_keys=tags)
        self.alpha = metrics.Gauge("osd_alpha", "accepted / tested draft tokens, last window", tag_keys=tags)
        self.version = metrics.Gauge("osd_draft_version", "draft version serving", tag_keys=tags)
        self.latency = metrics.Histogram("osd_request_latency_s", "request latency", boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300],
                                         tag_keys=tags)

    def step(self, expert: str, st) -> None:
        if self.ok:
            t = {"expert": expert}
            for counter, v in ((self.draft, st.proposed), (self.accepted, st.accepted), (self.emitted, st.emitted),
                               (self.tested, st.accepted + st.rejected)):
                if v > 0:  # Ray counters refuse inc(0)
                    counter.inc(v, tags=t)


HISTORY_ROWS = 500
UNSENT_ROWS = 10_000  # rows waiting for a stalled W&B service (events and windows: hours of them)
LATENCY_SAMPLE = 2000  # latencies a window keeps for its p50/p99
CLOSE_TIMEOUT_S = 30.0  # how long close() waits for W&B's last write and finish()
INIT_TIMEOUT_S = 20.0  # wandb's own default retries for minutes: a replica must not wait that long to serve


def _auto_mode() -> str:
    """W&B's own switches first (WANDB_MODE, WANDB_DISABLED, as set on air-gapped clusters), then
    online with an API key and offline without one."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes") or env == "disabled":
        return "disabled"
    if env in ("online", "offline"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _init_wandb(mode: str, explicit: bool, **kw):
    """A W&B run, or None. Telemetry never stops serving: an unreachable server falls back to an offline
    run, and an unwritable directory (or, in auto mode, no wandb installed) to none; each with a warning.
    Prometheus and the admin history keep working either way."""
    try:
        import wandb
    except ImportError:
        if explicit:
            raise ImportError(f"wandb.mode {mode!r} needs wandb: pip install 'osd-serve[serve]'") from None
        warnings.warn("wandb is not installed: W&B logging is off (pip install 'osd-serve[serve]')", stacklevel=3)
        return None
    try:
        os.makedirs(kw["dir"], exist_ok=True)
    except OSError as e:
        warnings.warn(f"W&B logging is off: cannot create its directory {kw['dir']!r}: {e}", stacklevel=3)
        return None
    for m in (mode, "offline") if mode == "online" else (mode,):
        try:
            return wandb.init(mode=m, reinit="create_new", settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S), **kw)
        except Exception as e:  # CommError after the timeout, a PermissionError in the run directory
            warnings.warn(f"W&B {m} run could not start ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          + ("; logging offline instead" if m == "online" else "; W&B logging is off"), stacklevel=3)
    return None


class Telemetry:
    def __init__(self, mode: str = "auto", project: str = "osd-serve", directory: str = "~/.cache/osd-serve/wandb",
                 log_every_s: float = 10.0, config: dict | None = None, name: str | None = None):
        self.log_every_s = log_every_s
        self._lock = threading.Lock()
        self._win = defaultdict(lambda: defaultdict(float))  # expert -> sums since the last log
        self._pos = defaultdict(lambda: [[0, 0] for _ in range(16)])  # expert -> [accepted, tested] per position
        self._lat: list[float] = []  # this window's latencies: a uniform sample of at most LATENCY_SAMPLE (on_request)
        self._n_lat = 0  # requests this window, sampled or not
        self._rng = random.Random(0)
        # Rows built but not yet written to W&B, oldest first: only the timer writes them (and close()),
        # so no caller on an event loop waits on a W&B call. Bounded: W&B stalled for hours keeps the newest.
        self._unsent: deque[dict] = deque(maxlen=UNSENT_ROWS)
        self._events: list[dict] = []
        self._last = time.monotonic()
        # the latest rows logged, also kept here (admin routes, tests): bounded, as a replica runs for weeks
        self.history: deque[dict] = deque(maxlen=HISTORY_ROWS)
        self.prom = _Prometheus()
        self.run = None
        explicit = mode != "auto"
        if not explicit:
            mode = _auto_mode()
        if mode != "disabled":
            self.run = _init_wandb(mode, explicit, project=project, dir=os.path.expanduser(directory), config=config or {},
                                   name=name)
        # Rows were written only when the engine stepped: once traffic stopped, a version published by
        # the distiller's age trigger, or a rollback, waited for the next request. With a W&B run, a
        # timer writes each window on time (at most once a second); without one the rows feed only
        # /admin/metrics, which writes the window when it is read.
        self._stop = threading.Event()
        # One writer at a time, so rows reach W&B in the order they were built: the timer, then close()
        # once the timer is gone. Nothing else waits on it: /admin/metrics runs on the replica's event
        # loop, and a W&B call that hung while holding it froze every stream there.
        self._write = threading.Lock()
        self._kick = threading.Event()  # wakes the timer: a forced window's rows reach W&B now, not in log_every_s
        self._timer: threading.Thread | None = None
        if self.run is not None:
            self._timer = threading.Thread(target=self._tick, name="osd-telemetry", daemon=True)
            self._timer.start()

    def _tick(self) -> None:
        while True:
            self._kick.wait(max(self.log_every_s, 1.0))  # a window due, or a forced one to write now
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                self.maybe_log()
                self._send()
            except Exception:  # noqa: BLE001  W&B must never take a replica down
                logging.getLogger(__name__).exception("telemetry: writing a row failed")

    def on_step(self, expert: str, st) -> None:
        self.prom.step(expert, st)
        with self._lock:
            w = self._win[expert]
            w["steps"] += 1
            w["proposed"] += st.proposed
            w["accepted"] += st.accepted
            w["tested"] += st.accepted + st.rejected
            w["emitted"] += st.emitted
            w["rows"] += st.batch_size
            if (k := getattr(st, "auto_k", None)) is not None:  # the k "auto" chose (the disaggregated steps have none)
                w["auto_steps"] += 1
                w["auto_k"] += k
            for j, (a, t) in enumerate(zip(st.accepted_per_position, st.tested_per_position)):
                self._pos[expert][j][0] += a
                self._pos[expert][j][1] += t
        if self.run is None:  # with a run the timer writes: a slow W&B service must not stall the engine's steps
            self.maybe_log()

    def on_request(self, expert: str, latency_s: float, finish_reason: str | None) -> None:
        """A request's end. Latency counts only those that ran to their end (stop or length), in both
        topologies: an aborted one's time (its client went away) or a failed one's says nothing of how
        fast requests are served."""
        if finish_reason not in ("stop", "length"):
            return
        with self._lock:
            self._n_lat += 1
            # Reservoir sampling (Algorithm R): past LATENCY_SAMPLE a window's percentiles come from a
            # uniform sample of all its requests. A tail of the latest ones dropped a busy window's early
            # slow requests from p99 (1000 at 10 s then 2000 at 1 s read p99 1.0).
            if len(self._lat) < LATENCY_SAMPLE:
                self._lat.append(latency_s)
            elif (j := self._rng.randrange(self._n_lat)) < LATENCY_SAMPLE:
                self._lat[j] = latency_s
        if self.prom.ok:
            self.prom.latency.observe(latency_s, tags={"expert": expert})

    def on_event(self, expert: str, **fields) -> None:
        """Version published/refused, rollbacks, buffer size, losses."""
        with self._lock:
            self._events.append({"expert": expert, "time": time.time(), **fields})
        if self.prom.ok and fields.get("version") is not None:
            self.prom.version.set(fields["version"], tags={"expert": expert})

    def maybe_log(self, force: bool = False) -> dict | None:
        """Close the window if it is due (or forced): its rows go to the history, and with a W&B run to
        the queue the timer writes. Returns the window's row, or None when none was due."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last < self.log_every_s:
                return None
            row: dict = {"time": time.time()}
            for e, w in self._win.items():
                if w["tested"]:
                    row[f"alpha/{e}"] = w["accepted"] / w["tested"]
                    if self.prom.ok:
                        self.prom.alpha.set(row[f"alpha/{e}"], tags={"expert": e})
                        self.prom.rate.set(w["accepted"] / w["proposed"], tags={"expert": e})
                if w["rows"]:
                    row[f"tokens_per_step/{e}"] = w["emitted"] / w["rows"]
                    row[f"batch_size/{e}"] = w["rows"] / w["steps"]
                if w["auto_steps"]:
                    row[f"auto_k/{e}"] = w["auto_k"] / w["auto_steps"]
                for j, (a, t) in enumerate(self._pos[e]):  # α at position j: accepted over tested there
                    if t:
                        row[f"alpha_pos/{e}/{j}"] = a / t
            lat = list(self._lat)
            if lat:
                row["latency_p50_s"], row["latency_p99_s"] = _percentile(lat, 0.5), _percentile(lat, 0.99)
            # One row per event, before the window's row: merged into one row, a rollback to 0 and a
            # publish of 2 in the same window logged only version 2. A row with nothing but its time (an
            # idle window: every log_every_s, and each /admin/metrics call) is not kept: such rows pushed
            # the last real ones out of the bounded history within hours, and were empty W&B steps.
            rows = [{"time": ev["time"]} | {f"{k}/{ev['expert']}": v for k, v in ev.items()
                                           if k not in ("expert", "time") and _finite(v)}
                    for ev in self._events] + [row]
            rows = [r for r in rows if len(r) > 1]
            self._win.clear()
            self._pos.clear()
            self._lat.clear()
            self._n_lat = 0
            self._events.clear()
            self._last = now
            self.history.extend(rows)
            if self.run is not None:
                self._unsent.extend(rows)
                if force:
                    self._kick.set()
        return row

    def _send(self) -> None:
        """Write the queued rows to W&B, oldest first (the timer's thread, and close())."""
        with self._write:
            while self.run is not None:
                with self._lock:
                    if not self._unsent:
                        return
                    r = self._unsent.popleft()
                try:
                    self.run.log(r)
                except Exception as e:  # noqa: BLE001
                    # wandb's service process gone (OOM-killed, crashed): every later log raised
                    # ConnectionResetError. W&B goes off; the rows stay in the history.
                    logging.getLogger(__name__).warning("W&B logging is off: writing a row failed (%s: %s)", type(e).__name__, e)
                    self.run = None
                    self._stop.set()  # without a run the timer has nothing to write
                    with self._lock:
                        self._unsent.clear()

    def recent(self) -> list[dict]:
        """The latest rows logged, oldest first (copied under the lock: the engine thread appends)."""
        with self._lock:
            return list(self.history)

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=CLOSE_TIMEOUT_S)  # a row it is writing goes before the last one, and before finish()
            if self._timer.is_alive():  # stuck in a W&B call: the replica's shutdown must not wait on it
                logging.getLogger(__name__).warning("W&B is not answering: its run is left unfinished")
                return
        self.maybe_log(force=True)
        if self.run is None:
            return
        # The last rows and finish() in a thread of their own, as the timer's writes: a W&B call that
        # hangs here held the replica's shutdown (SpecService.close, a failed start's clean-up) forever.
        last = threading.Thread(target=self._finish, name="osd-telemetry-finish", daemon=True)
        last.start()
        last.join(timeout=CLOSE_TIMEOUT_S)
        if last.is_alive():
            logging.getLogger(__name__).warning("W&B is not answering: its run is left unfinished")

    def _finish(self) -> None:
        self._send()
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001  a dead wandb service must not stop the replica's shutdown
                logging.getLogger(__name__).warning("W&B run could not finish (%s: %s)", type(e).__name__, e)
