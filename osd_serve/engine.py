"""The speculative decoding engine: continuous batching around ``spec.speculative_step``.

Requests wait in a queue; between steps, finished rows leave the batch and waiting ones are prefilled
and join it. Every row keeps all of its own accepted tokens.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from .auto_k import RowView, SpeculationPolicy, calibrate
from .config import EngineConfig, SamplingParams
from .kv import BatchKV, make_hole_safe, pad_right
from .loading import max_positions
from .logprobs import step_logprobs
from .output import Completion, Prompt, Request, StreamDelta, check_prompt, eos_token_ids, fit_max_tokens
from .prefill import Partial, group_size
from .sampling import seeded_generator
from .spec import RowState, broken_rows, speculative_step

_log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one engine step did, as data (never parse logs for this)."""

    batch_size: int
    proposed: int  # draft tokens proposed, summed over rows
    accepted: int  # draft tokens accepted, summed over rows
    rejected: int  # rows whose draft was rejected at some position (the rest accepted all k_i)
    accepted_per_position: list[int]  # [k] rows whose j-th draft token was accepted
    proposed_per_position: list[int]  # [k] rows that proposed a j-th draft token
    emitted: int  # tokens added to outputs (accepted + one target token per row, less any cut by a stop)
    draft_time: float  # seconds in draft forwards
    target_time: float  # seconds in the target forward and verification
    prefill_time: float  # seconds prefilling before this step (and in the steps since the last stats)
    auto_k: int | None = None  # the k chosen for this step's "auto" rows (None: no row asked for it)
    # [k] rows whose j-th draft token was tested: proposed and every earlier one accepted. A draft after
    # a rejection is proposed but never tested, so accepted/proposed at j is P(first j+1 accepted), not α_j.
    tested_per_position: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float | None:
        """Per-position acceptance (the α of S(α,k,c)): accepted over positions that were tested.
        accepted/proposed would also count drafts after a rejection, which are never tested."""
        tested = self.accepted + self.rejected
        return self.accepted / tested if tested else None


def check_state_fits(draft, state: dict[str, torch.Tensor], who: str) -> None:
    """Refuse draft weights the draft cannot take, before any is loaded: load_state_dict copies every
    tensor that fits before it raises on one that does not, leaving a mix of two versions."""
    own = draft.state_dict()
    unknown = set(state) - set(own)
    if unknown:
        raise ValueError(f"{who}: state has names the draft does not: {sorted(unknown)[:3]}")
    wrong = [n for n, t in state.items() if t.shape != own[n].shape]
    if wrong:
        raise ValueError(f"{who}: {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the draft's is "
                         f"{tuple(own[wrong[0]].shape)} (a version of another draft?)")


class SpecEngine:
    """Continuous-batching speculative decoding over one target/draft pair.

    One thread drives it (step(), or generate()/stream(), which step until the engine is empty and
    see every row's output). add_request(), abort(), reset() and swap_draft() may be called from any
    other thread meanwhile. To serve many callers each with its own stream, use
    serving.AsyncSpecServer, which routes every row's output to its own caller."""

    def __init__(self, target, draft, tokenizer, config: EngineConfig | None = None, recorder=None,
                 policy: SpeculationPolicy | None = None):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        for m in (target, draft):
            make_hole_safe(m)
        # Online distillation hooks: a Recorder (distill/recorder.py) sees every step and finished
        # request; swap_draft() publishes new draft weights, applied between steps.
        self.recorder = recorder
        self.draft_version = 0
        self._swap_lock = threading.Lock()
        # Held by step() and by every change to the queue (add_request, abort, reset), so they can be
        # called from several threads: one from another thread waits for the running step. Without it
        # an abort landing while _admit moved a request from the queue into the batch found it in
        # neither, and the request ran to the end. Re-entrant: a step's own callbacks may abort.
        # (The server never contends for it: AsyncSpecServer drives each engine from one thread.)
        self._lock = threading.RLock()
        self._pending_swap: tuple[dict, int] | None = None
        self.config = config or EngineConfig()
        self.device = next(target.parameters()).device
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.eos_ids = eos_token_ids(target, tokenizer)
        self.max_model_len = min(self.config.max_model_len, max_positions(target.config), max_positions(draft.config))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests that have left, by finish_reason (output.FINISH_REASONS): /admin/experts reports them,
        # and "abort" is what shows that a client that went away stopped its row rather than ran it out.
        self.finished: Counter[str] = Counter()
        self._target_kv = BatchKV(target, 0, self.device)
        self._draft_kv = BatchKV(draft, 0, self.device)
        self._rows: RowState | None = None
        self._partial: Partial | None = None  # the queue's head, a prompt over the step budget, being prefilled
        # The queue's first len(_ahead) requests, prefilled with others that joined (see _prefill), and
        # their one-row caches: they join as slots free, without a forward of their own
        self._ahead: deque[tuple[Request, BatchKV, BatchKV]] = deque()
        self._prefill_unreported = 0.0  # seconds of prefill in steps that returned no stats
        self._ids = itertools.count()
        # Chooses k for "auto" requests; calibrates each batch size on first use (auto_k.py). Shared
        # with another engine on the same pair (bench) through policy.fork().
        self.policy = policy or SpeculationPolicy(self.config.auto_k_max, self._calibrate, self.config.max_batch_size)
        self._auto_failed = False

    def _calibrate(self, batch: int):
        # context + the widest verification within the pair's positions (GPT-2's are learned: no room
        # past them); a model too short for k_max + 1 columns gets fewer, and Costs extends them
        k_max, n = self.config.auto_k_max, self.max_model_len
        context = max(1, min(64, n - k_max - 2))
        return calibrate(self.target, self.draft, batch, max(1, min(k_max + 1, n - context - 1)), self.vocab, context)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self, prompt: str | Sequence[int] | Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        expert: str = "default",
    ) -> str:
        return self._queue(prompt, params, request_id, expert).request_id

    def _queue(self, prompt, params: SamplingParams | None, request_id: str | None, expert: str) -> Request:
        params = params or SamplingParams()
        if isinstance(prompt, Prompt):  # checked against this engine's limits already (AsyncSpecServer.generate)
            params.validate()
            text, ids = prompt
        else:
            text, ids = check_prompt(self.tokenizer, self.vocab, self.max_model_len, prompt, params)
        params = fit_max_tokens(params, len(ids), self.max_model_len)
        if params.auto_k and not params.greedy and params.seed is not None:  # see EngineConfig.auto_seeded_k
            params = replace(params, num_speculative_tokens=self.config.auto_seeded_k)
        rid = request_id or f"req-{next(self._ids)}"
        gen = None
        if not params.greedy:
            gen = seeded_generator(params.seed if params.seed is not None else secrets.randbits(63))
        req = Request(rid, text, ids, params, gen, expert=expert)
        with self._lock:
            self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client disconnected); its row leaves the batch at the next step."""
        self._abort_all(r for r in itertools.chain(self.waiting, self.running) if r.request_id == request_id)

    def _abort_all(self, requests) -> None:
        with self._lock:  # ``requests`` may be lazy over the queue and batch: read under the lock
            for r in list(requests):
                if not r.finished:
                    r.finish_reason = "abort"
            left = [r for r in self.waiting if r.finished]  # queued ones leave now; running rows at the next step
            if self._partial is not None and self._partial.request.finished:
                self._partial = None  # its caches go now: an idle engine takes no next step to drop them
            self._ahead = deque(a for a in self._ahead if not a[0].finished)
            if left:
                self.finished.update(r.finish_reason for r in left)
                self.waiting = deque(r for r in self.waiting if not r.finished)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset(self) -> None:
        """Forget every request and cache, e.g. after a step raised (the caller ends the requests).
        In place, not a new engine: distillers and version watchers hold this object."""
        with self._lock:
            for r in itertools.chain(self.waiting, self.running):  # the caller ends them with an error
                self.finished["abort" if r.finish_reason == "abort" else "error"] += 1
            self.waiting, self._partial = deque(), None
            self._ahead.clear()
            self._empty_batch()
            if self.recorder is not None:  # their traces would wait for a finish that never comes
                self.recorder.drop()

    def _empty_batch(self) -> None:
        self.running, self._rows = [], None
        self._target_kv = BatchKV(self.target, 0, self.device)
        self._draft_kv = BatchKV(self.draft, 0, self.device)

    # ---- one step ---------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Prefill what this step's budget allows (prefill.py): the prompts at the head of the queue
        that fit together, or the next chunk of one too long for it; those prefilled join the batch.
        Prompts prefilled ahead by an earlier step join first, without a forward."""
        budget = self.config.prefill_chunk_tokens  # (an abort or reset drops self._partial with its request)
        room = self.config.max_batch_size - len(self.running)
        if room <= 0 or not self.waiting:
            return
        if self._ahead:
            ready = [self._ahead.popleft() for _ in range(min(room, len(self._ahead)))]
            for _ in ready:
                self.waiting.popleft()  # the queue's head is the requests of _ahead, in order
            self._join([r for r, _, _ in ready], BatchKV.merge(self.target, self.device, [t for _, t, _ in ready]),
                       BatchKV.merge(self.draft, self.device, [d for _, _, d in ready]))
            room -= len(ready)
            if room == 0 or not self.waiting:
                return
        if self._partial is None:
            # Candidates: a batch's worth, not just the free slots (_prefill holds back the rest)
            n = self.config.max_batch_size if self.config.prefill_ahead else room
            head = [len(self.waiting[i].prompt_ids) - 1 for i in range(min(n, len(self.waiting)))]
            if budget is None or head[0] <= budget:
                self._prefill([self.waiting[i] for i in range(group_size(head, budget))], room)
                return
            r = self.waiting[0]
            self._partial = Partial(r, BatchKV(self.target, 1, self.device), BatchKV(self.draft, 1, self.device),
                                    r.params.num_speculative_tokens != 0)
        if self._partial.feed(budget):
            p, self._partial = self._partial, None
            self.waiting.popleft()
            self._join([p.request], p.target, p.draft)

    def _prefill(self, new: list[Request], room: int) -> None:
        """Prefill ``new``, the queue's head, in one right-padded forward of each model. The first ``room``
        join the batch; the rest stay queued, prefilled (``_ahead``), and join as slots free. Why ahead: a
        forward's fixed cost made a prompt prefilled alone cost 1.8x its share of a group of 4 and 2x of 8
        (default pair, bf16, 2 CPU cores), and rows free a few at a time. Held: at most a batch's rows."""
        dev, b = self.device, len(new)
        # Prefill all but the last prompt token: it is the first "last" token of the speculative loop.
        ids, valid = pad_right([r.prompt_ids[:-1] for r in new])
        ids, valid = ids.to(dev), valid.to(dev)
        tkv, dkv = BatchKV(self.target, b, dev), BatchKV(self.draft, b, dev)
        if ids.shape[1]:  # keep=1: a prefill reads none of its logits (kv.BatchKV.forward)
            tkv.forward(ids, valid, keep=1)
            if any(r.params.num_speculative_tokens != 0 for r in new):  # k=0 rows never read the draft
                dkv.forward(ids, valid, keep=1)
        join = min(room, b)
        for _ in range(join):
            self.waiting.popleft()
        if join < b:  # one-row views first: select() below replaces the group's tensors
            self._ahead.extend(list(zip(new, tkv.split(), dkv.split()))[join:])
            idx = torch.arange(join, device=dev)
            tkv.select(idx, self.config.compact_hole_fraction)
            dkv.select(idx, self.config.compact_hole_fraction)
        self._join(new[:join], tkv, dkv)

    def _join(self, new: list[Request], tkv: BatchKV, dkv: BatchKV) -> None:
        """Prefilled requests join the running batch, with their caches."""
        dev, b = self.device, len(new)
        last = torch.tensor([r.prompt_ids[-1] for r in new], device=dev)
        rows = RowState(
            last=last,
            pending=torch.stack([last, last], 1),
            pending_n=torch.ones(b, dtype=torch.long, device=dev),
            k=torch.zeros(b, dtype=torch.long, device=dev),  # set by each step (step_k)
            temperature=torch.tensor([r.params.temperature for r in new], dtype=torch.float32, device=dev),
            top_k=torch.tensor([r.params.top_k for r in new], device=dev),
            top_p=torch.tensor([r.params.top_p for r in new], dtype=torch.float32, device=dev),
        )
        self._target_kv.extend(tkv)
        self._draft_kv.extend(dkv)
        if self._rows is None:
            self._rows = rows
        else:
            self._rows.extend(rows)
        self.running.extend(new)

    def _uniforms(self, k_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row uniforms from each request's own generator: u_draft [B, k], u_verify [B, k+1],
        k = max(k_rows). A row draws only the 2·k_i + 1 it uses (its k_i proposals, k_i accept tests
        and the final sample, which the accept rule takes from column k), so a seeded request's
        output does not depend on which requests share its batch. Greedy rows get constants (with
        one-hot p and q the accept rule never looks at them), and so do the columns a row does not
        use (its proposals past k_i are never verified)."""
        k = max(k_rows)
        # float64: a float32 torch.rand returns multiples of 2**-24 only, so inverse-CDF sampling from
        # them rounds every token's chance to that grid (1.5e-3 total variation from p at V = 152k)
        u_draft = torch.full((len(self.running), k), 0.5, dtype=torch.float64)
        u_verify = torch.full((len(self.running), k + 1), 0.5, dtype=torch.float64)
        for i, (r, ki) in enumerate(zip(self.running, k_rows)):
            if r.generator is not None:
                d = torch.rand(2 * ki + 1, generator=r.generator, dtype=torch.float64)  # [2·k_i + 1]
                u_draft[i, :ki], u_verify[i, :ki], u_verify[i, k] = d[:ki], d[ki:2 * ki], d[2 * ki]
        return u_draft.to(self.device), u_verify.to(self.device)

    def step(self) -> tuple[list[StreamDelta], StepStats | None]:
        """Admit waiting requests, run one speculative step, return the new output of every row."""
        with self._lock:
            return self._step()

    def _step(self) -> tuple[list[StreamDelta], StepStats | None]:
        t0 = time.perf_counter()
        self._drop_finished()
        self._apply_swap()
        self._admit()
        # A step that only fed a prompt's chunk has no stats: its time goes into the next step's, so
        # prefill_time still sums to all prefill (bench.py splits an engine's time by it)
        prefill, self._prefill_unreported = self._prefill_unreported + time.perf_counter() - t0, 0.0
        if not self.running:
            self._prefill_unreported = prefill
            return [], None
        rows = self._rows
        t_loop, calibrating = time.perf_counter(), self.policy.calibration_seconds
        auto_k = self._choose_k()
        # Capped at max_tokens (Request.step_k): the last step then runs fewer draft forwards and, at
        # batch 1, a narrower verification.
        k_rows = [r.step_k(auto_k=auto_k) for r in self.running]
        rows.k = torch.tensor(k_rows, device=self.device)  # [B]
        k = max(k_rows)
        u_draft, u_verify = self._uniforms(k_rows)
        out = speculative_step(self._target_kv, self._draft_kv, rows, self.vocab, u_draft, u_verify)
        tokens, n_acc = out.tokens.tolist(), out.num_accepted.tolist()
        broken = broken_rows(out.target_logits, out.num_accepted).tolist()  # [B]
        logprobs = step_logprobs(out.target_logits, out.tokens, n_acc, [r.params.logprobs for r in self.running])
        if self.recorder is not None:
            before = [len(r.output_ids) for r in self.running]
            self.recorder.observe(self.running, out, n_acc, k_rows, before, self.draft_version)
        acc_pos, prop_pos, tst_pos = [0] * k, [0] * k, [0] * k
        emitted, counted = 0, []  # counted: (accepted, proposed) of the rows the statistics describe
        for r, toks, a, kr, bad, lps in zip(self.running, tokens, n_acc, k_rows, broken, logprobs):
            if r.finished:  # aborted mid-step
                continue
            if bad:  # its tokens came from NaN logits, not from the target's choice: none is emitted
                _log.warning("request %s ended: the target's logits were NaN (a retry of it may well meet them again)",
                             r.request_id)
                r.finish_reason = "error"
                continue
            counted.append((a, kr))
            r.proposed += kr
            r.accepted += a
            r.rejected += a < kr
            r.steps += 1
            before = len(r.output_ids)
            r.append(toks[: a + 1], self.tokenizer, self.eos_ids, lps)
            emitted += len(r.output_ids) - before
            for j in range(kr):
                prop_pos[j] += 1
                acc_pos[j] += j < a
                tst_pos[j] += j <= a
        deltas = [r.delta() for r in self.running]
        rejected = sum(a < kr for a, kr in counted)
        stats = StepStats(
            len(self.running), sum(kr for _, kr in counted), sum(a for a, _ in counted), rejected, acc_pos, prop_pos,
            emitted, out.draft_time, out.target_time, prefill, auto_k, tst_pos,
        )
        self._drop_finished()
        for kv in (self._target_kv, self._draft_kv):
            if kv.hole_fraction() > self.config.compact_hole_fraction:
                kv.compact()
        if auto_k is not None and not self._auto_failed:
            # the loop's own time, choose() included; a calibration this step did is a one-off, not per step
            loop = (time.perf_counter() - t_loop - out.draft_time - out.target_time
                    - (self.policy.calibration_seconds - calibrating))
            self.policy.observe(stats.batch_size, k, out.draft_time, out.target_time, loop, stats.accepted,
                                stats.accepted + rejected)
        return deltas, stats

    def _choose_k(self) -> int | None:
        """The k for this step's "auto" rows (None when no row asked for it)."""
        if not any(r.params.auto_k for r in self.running):
            return None
        views = [RowView(auto=r.params.auto_k, k=r.k_cap() if r.params.auto_k else r.step_k(), accepted=r.accepted,
                         tested=r.accepted + r.rejected) for r in self.running]
        if not self._auto_failed:
            try:
                return self.policy.choose(views)
            except Exception as e:  # noqa: BLE001  a calibration that failed (out of memory) must not fail the batch
                self._auto_failed = True
                _log.warning("num_speculative_tokens auto: calibration failed (%s: %s); auto rows draft %d from now on",
                             type(e).__name__, e, self._auto_fallback)
        return self._auto_fallback

    @property
    def _auto_fallback(self) -> int:
        """The k of auto rows once calibration failed: fixed from then on (>= 1: a row that stopped
        feeding its draft could not start again, spec.py's invariant)."""
        return min(max(self.config.auto_seeded_k, 1), self.config.auto_k_max)

    # ---- draft hot-swap ---------------------------------------------------------------------------
    def swap_draft(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Publish new draft weights (names as in ``draft.state_dict()``). Safe from any thread: the
        swap happens at the start of the next step, never inside one. Any draft keeps the output
        lossless; only acceptance depends on it."""
        # Checked here, in the caller's thread: a state the draft cannot take must fail the swap,
        # not the next step (every request in it) after load_state_dict copied half of it in.
        check_state_fits(self.draft, state, "swap_draft")
        with self._swap_lock:
            self._pending_swap = (state, version)

    @property
    def next_draft_version(self) -> int:
        """The version the next step drafts with: a swap published meanwhile (applied at that step's
        start), else the current one. An idle engine takes no step, so draft_version alone stayed on the
        old version after a rollback or an update until traffic came."""
        with self._swap_lock:
            pending = self._pending_swap
        return pending[1] if pending is not None else self.draft_version

    def _apply_swap(self) -> None:
        with self._swap_lock:
            pending, self._pending_swap = self._pending_swap, None
        if pending is None:
            return
        state, version = pending
        self.draft.load_state_dict(state, strict=False)
        self.draft_version = version
        if self.running:  # the draft cache holds keys/values of the old weights: recompute it
            self._draft_kv = self._refill_draft_cache()
        if self._partial is not None:
            self._partial.redraft(self.draft)
        self._ahead.clear()  # their draft caches hold the old weights' keys: they are prefilled again, as queued

    def _refill_draft_cache(self) -> BatchKV:
        """A fresh draft cache holding what the invariant in spec.py says: positions 0..N-1-pending_n."""
        pending = self._rows.pending_n.tolist()
        ids, valid = pad_right([(r.prompt_ids + r.output_ids)[: len(r.prompt_ids) + len(r.output_ids) - m]
                                for r, m in zip(self.running, pending)])  # [B, W]
        kv = BatchKV(self.draft, len(pending), self.device)
        if ids.shape[1]:
            kv.forward(ids.to(self.device), valid.to(self.device), keep=1)
        return kv

    def _drop_finished(self) -> None:
        for r in self.running:
            if r.finished:
                self.finished[r.finish_reason] += 1
                if self.recorder is not None:
                    self.recorder.finish(r)
        keep = [i for i, r in enumerate(self.running) if not r.finished]
        if len(keep) == len(self.running):
            return
        if not keep:  # start the next batch from fresh caches rather than zero-row ones
            self._empty_batch()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._target_kv.select(idx, self.config.compact_hole_fraction)
        self._draft_kv.select(idx, self.config.compact_hole_fraction)
        self._rows.select(idx)
        self.running = [self.running[i] for i in keep]

    # ---- drivers ----------------------------------------------------------------------------------
    def submit(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Request]:
        """Queue prompts (one SamplingParams for all, or one each); returns their Request objects."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("params must be one SamplingParams or one per prompt")
        reqs = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self._queue(p, sp, None, "default"))
        except BaseException:  # a refused prompt: the caller gets no requests, so none of them may run
            self._abort_all(reqs)
            raise
        return reqs

    def stream(self, prompts, params=None) -> Iterator[StreamDelta]:
        """Run prompts to completion with continuous batching, yielding deltas as tokens are accepted."""
        reqs = self.submit(prompts, params)
        try:
            while self.has_unfinished():
                deltas, _ = self.step()
                yield from (d for d in deltas if d.token_ids or d.text or d.finished)
        finally:  # a consumer that stops early (break, an exception) must not leave its rows decoding
            self._abort_all(reqs)

    def generate(self, prompts, params=None, stats: list | None = None) -> list[Completion]:
        """Run prompts to completion; one Completion per prompt, in order.
        ``stats``, when given a list, receives each step's StepStats."""
        reqs = self.submit(prompts, params)
        try:
            while self.has_unfinished():
                _, st = self.step()
                if st is not None and stats is not None:
                    stats.append(st)
        finally:  # as stream(): an interrupt (Ctrl-C, an exception in a step) leaves nothing to the next call
            self._abort_all(reqs)
        return [r.completion() for r in reqs]
