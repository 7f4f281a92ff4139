"""An asyncio front for SpecEngine: one engine loop thread per server, many awaiting callers.

Why a thread: an engine step is one long blocking torch call (tens of ms); run on the event loop it
would stall every other request's I/O. The loop thread owns the engines outright; callers talk to it
only through a thread-safe inbox (add, abort) and receive their deltas on their own asyncio.Queue,
so no engine state is ever touched from two threads.

Experts: one SpecEngine per draft expert, all sharing the one target model. The loop steps every
engine that has work, round-robin, so a busy expert cannot starve another.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass

from .config import EngineConfig, SamplingParams
from .engine import SpecEngine, StepStats
from .output import Prompt, StreamDelta
from .protocol import UnknownExpert, prepare_prompt


@dataclass
class _Add:
    expert: str
    prompt: object
    params: SamplingParams
    request_id: str
    sink: Callable[[StreamDelta], None]
    future: concurrent.futures.Future


class StallWatch:
    """How long the torch call now running on one thread has run. A hung device call (a CUDA hang, a
    collective waiting on a dead peer) raises nothing: without this a replica whose torch thread hung
    answered every health check while its requests waited until their clients left."""

    def __init__(self, limit_s: float | None):
        self.limit_s = limit_s  # None: never stalled
        self._since: float | None = None  # monotonic start of the call running now; one thread runs them

    @contextmanager
    def running(self):
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def stalled(self) -> str | None:
        """Why the thread counts as hung, or None."""
        since = self._since  # read once: the thread may clear it meanwhile
        if self.limit_s is None or since is None or time.monotonic() - since <= self.limit_s:
            return None
        return f"a torch call has run for {time.monotonic() - since:.0f} s (stall_timeout_s is {self.limit_s:g})"


class AsyncSpecServer:
    def __init__(self, target, tokenizer, drafts: dict[str, object], config: EngineConfig | None = None,
                 on_step: Callable[[str, StepStats], None] | None = None, stall_timeout_s: float | None = None):
        """drafts: expert name -> draft model (e.g. the base draft with that expert's adapter merged).
        stall_timeout_s: a step running longer makes the server unhealthy (``health``); None: never."""
        if not drafts:
            raise ValueError("at least one draft expert is needed")
        self.target, self.tokenizer, self.config = target, tokenizer, config or EngineConfig()
        self.engines: dict[str, SpecEngine] = {}
        for n, d in drafts.items():
            self.add_expert(n, d)
        self.on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[StreamDelta], None]] = {}
        self._owner: dict[str, str] = {}  # request id -> expert
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.broken: str | None = None  # why an engine could not be reset after a failed step (alive() is then False)
        self.stall = StallWatch(stall_timeout_s)
        # Held while checking _stop and putting an add, and while setting _stop: no add can land in
        # the inbox after the loop's last drain (its caller would wait forever).
        self._closing = threading.Lock()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="osd-engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) -------------------------------------------------------
    def add_expert(self, name: str, draft) -> None:
        """Register a new expert; safe while serving (the loop reads a snapshot of the dict). Experts are
        one base draft with different adapters: one forward costs each the same, so their engines share
        one calibration for num_speculative_tokens "auto" (each learns its own acceptance)."""
        first = next(iter(self.engines.values()), None)
        policy = first.policy.fork() if first is not None else None
        self.engines = {**self.engines, name: SpecEngine(self.target, draft, self.tokenizer, self.config, policy=policy)}

    async def prepare(self, prompt, params: SamplingParams, expert: str = "default") -> Prompt:
        """The prompt checked against ``expert``'s engine, tokenized in a worker thread: never on the
        event loop or the engine loop (a long prompt takes seconds, protocol.prepare_prompt)."""
        if expert not in self.engines:
            raise UnknownExpert(expert, self.engines)
        if isinstance(prompt, Prompt):
            return prompt
        eng = self.engines[expert]
        return await asyncio.to_thread(prepare_prompt, self.tokenizer, eng.vocab, eng.max_model_len, prompt, params)

    async def generate(self, prompt, params: SamplingParams, expert: str = "default") -> AsyncIterator[StreamDelta]:
        """Yield deltas as tokens are accepted. Raises ValueError for bad input before any output.
        prompt: text, token ids, chat messages or a Prompt from ``protocol.prepare_prompt``.
        Cancelling the iteration (a client that went away) aborts the request and frees its row."""
        prompt = await self.prepare(prompt, params, expert)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamDelta] = asyncio.Queue()
        rid = f"cmpl-{next(self._ids)}-{time.monotonic_ns()}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._closing:
            if self._stop.is_set():
                raise RuntimeError("the engine server is closed")
            self._inbox.put(_Add(expert, prompt, params, rid, lambda d: loop.call_soon_threadsafe(q.put_nowait, d), fut))
        self._wake.set()
        try:  # re-raises add_request's ValueError here
            # Shielded: cancelling this wait (a client gone while queued) must not cancel the future the
            # loop thread will complete; the abort below follows the add through the inbox instead.
            await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        finished = False
        try:
            while not finished:
                d = await q.get()
                finished = d.finished
                yield d
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def health(self) -> str | None:
        """Why the server cannot serve, or None: the loop thread runs, was not told to stop (no step's
        failure ends it), no engine failed its reset and no step has run past stall_timeout_s."""
        if not self._thread.is_alive() or self._stop.is_set():
            return "the engine loop is not running"
        return self.broken or self.stall.stalled()

    def alive(self) -> bool:
        return self.health() is None

    def close(self) -> None:
        """Stop the loop. Requests it still held end with finish_reason 'error' and queued adds fail
        (run by the loop thread as it exits), so no caller waits forever on a closed server."""
        with self._closing:
            self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- loop thread ------------------------------------------------------------------------------
    def _inbox_items(self):
        """What the inbox holds now, taken one at a time until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for item in self._inbox_items():
            if isinstance(item, tuple):  # ("abort", request_id): its caller has gone, so has its sink
                expert = self._owner.pop(item[1], None)
                self._sinks.pop(item[1], None)
                if expert is not None:
                    self.engines[expert].abort(item[1])
                continue
            if not item.future.set_running_or_notify_cancel():
                continue
            try:
                self.engines[item.expert].add_request(item.prompt, item.params, request_id=item.request_id, expert=item.expert)
            except (ValueError, TypeError) as e:
                item.future.set_exception(ValueError(str(e)))
                continue
            except Exception as e:  # noqa: BLE001  the caller gets the error; the loop must go on
                item.future.set_exception(e)
                continue
            self._sinks[item.request_id] = item.sink
            self._owner[item.request_id] = item.expert
            item.future.set_result(item.request_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception:  # noqa: BLE001  if this thread died, every caller would wait forever
                logging.getLogger(__name__).exception("engine loop iteration failed")
                self._stop.wait(0.1)  # a fault that repeats must not spin a core
        self._end_all()

    def _end_all(self) -> None:
        """On close: fail every add still queued and end every request still held."""
        for item in self._inbox_items():
            if isinstance(item, _Add) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(RuntimeError("the engine server is closed"))
        for rid, expert in list(self._owner.items()):
            self._deliver(StreamDelta(rid, "", [], True, "error"), self.engines[expert])
        self._owner.clear()
        self._sinks.clear()

    def _iterate(self) -> None:
        self._drain_inbox()
        busy = [(n, e) for n, e in self.engines.items() if e.has_unfinished()]
        if not busy:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            return
        for name, eng in busy:
            try:
                with self.stall.running():
                    deltas, stats = eng.step()
            except Exception as e:  # noqa: BLE001  a failed step must end its requests, never hang them
                self._fail(name, eng, e)
                continue
            for d in deltas:
                if d.token_ids or d.text or d.finished:
                    self._deliver(d, eng)
                if d.finished:
                    self._sinks.pop(d.request_id, None)
                    self._owner.pop(d.request_id, None)
            if stats is not None and self.on_step is not None:
                try:
                    self.on_step(name, stats)
                except Exception:  # noqa: BLE001  metrics must never stop serving
                    logging.getLogger(__name__).exception("on_step callback failed")

    def _deliver(self, d: StreamDelta, eng: SpecEngine) -> None:
        """Hand a delta to its caller's sink. A sink that raises (its caller's event loop has closed)
        loses its request, which is aborted; it must not cost the step's other requests their
        deltas, which they would wait for forever."""
        sink = self._sinks.get(d.request_id)
        if sink is None:
            return
        try:
            sink(d)
        except Exception:  # noqa: BLE001
            logging.getLogger(__name__).warning("request %s: its caller is gone (sink raised); aborting it", d.request_id)
            self._sinks.pop(d.request_id, None)
            self._owner.pop(d.request_id, None)
            eng.abort(d.request_id)

    def _fail(self, name: str, eng: SpecEngine, err: Exception) -> None:
        """End every request of a failed engine with finish_reason 'error' and reset it in place.
        Every request the server gave it, not only those in its queues: a step that failed while
        admitting had already taken some out of ``waiting``."""
        logging.getLogger(__name__).exception("engine step failed for expert %s", name, exc_info=err)
        try:
            with self.stall.running():  # right after a device fault, when a hang is likeliest
                eng.reset()  # first: a caller told of the failure finds the engine ready again
        except Exception as e:  # noqa: BLE001  (a sticky CUDA error fails every allocation, the reset's too)
            # The callers must still hear of it below, or they waited forever; and the server says it
            # is unhealthy (/health 503, Serve replaces the replica) rather than take more requests.
            logging.getLogger(__name__).exception("resetting expert %s after a failed step failed too", name)
            self.broken = f"expert {name!r} could not be reset after a failed step ({type(e).__name__})"
        for rid in [rid for rid, expert in self._owner.items() if expert == name]:
            del self._owner[rid]
            self._deliver(StreamDelta(rid, "", [], True, "error"), eng)
            self._sinks.pop(rid, None)
