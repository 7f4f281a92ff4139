"""``num_speculative_tokens: "auto"``: the engine picks k each step, the k with the most expected
tokens per second for the batch it is running.

Why one fixed k is wrong for a server: S = E[tokens] / (k·c + v) assumes verifying k+1 tokens per row
costs what decoding 1 does (v = 1). That holds at batch 1 and on a GPU, where a forward is bound by
reading the weights; on a CPU at batch 8 the linears are bound by their FLOPs, so v grows with the
rows the batch verifies and the best k falls (the default pair on 2 cores: best k 3-5 at batch 1, 1-2
at batch 8, where k = 4 gives 0.97-1.14x the target alone; benchmarks/ENGINE.md). Load changes the batch,
so the right k changes with it.

The model, per step, for the rows' own acceptance α_i and the k each row would take:
    tokens(k)  = Σ_i (1 − α_i^(k_i+1)) / (1 − α_i)           (Leviathan et al., i.i.d. acceptance)
    seconds(k) = K·D(B) + T(B, K+1) + L,   K = max_i k_i   (the draft runs K forwards over the batch,
                                                            the target verifies K+1 columns for all rows)
D and T are measured, not assumed: each batch size B the engine meets is calibrated once (one draft
forward, and target forwards of 1..k_max+1 tokens per row, on a cache of ``context`` tokens; a few
hundred ms on the default pair), and every step then rescales them by what its own forwards took
(a longer context, another process on the cores). L is the step's time outside both, measured.
α_i is the row's accepted / tested drafts, shrunk towards the running mean of all rows while the row
has few of its own.

Only speed depends on this: every k is lossless. k stays >= 1 for "auto" rows, since a row that
skips the draft for a step leaves its draft cache behind (spec.py's invariant), and k = 1 costs
the target little more than k = 0 (v ≈ 1.05 at batch 1, 1.33 at batch 8 on 2 cores).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kv import BatchKV
from .spec import _sync


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step yields for a row drafting k with per-position acceptance α: (1 − α^(k+1)) / (1 − α),
    every position accepted independently (α = 1: k+1), as S assumes. Real acceptance is correlated (a
    hard stretch of text rejects early in every step) and max_tokens cuts each sequence's last step, so
    measured tokens per forward fall below this as k grows (the bench reports the ratio, 0.92-0.99)."""
    return k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


@torch.inference_mode()
def filled_cache(model, batch: int, context: int, vocab: int, device) -> BatchKV:
    """A BatchKV of ``batch`` rows holding ``context`` random tokens each."""
    kv = BatchKV(model, batch, device)
    # [batch, context]; from a generator of its own: calibrating mid-serve must not move torch's global one
    ctx = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)
    kv.forward(ctx, torch.ones_like(ctx, dtype=torch.bool), keep=1)
    return kv


@torch.inference_mode()
def timed_forward(kv: BatchKV, tokens: int, vocab: int) -> float:
    """Seconds of one forward appending ``tokens`` random tokens to every row, then rolled back.

    Rolled back by ``truncate`` alone: every row drops the same suffix, which crops the cache in
    place, so the next forward appends into the same buffers as an engine step does. Compacting here
    as well would hand every layer a freshly gathered tensor that the next forward must copy into a
    new buffer: a whole-cache copy per timed forward (1.1 ms of a 6 ms target forward at batch 1, 3 ms
    of 10 ms at batch 8 on the 2-core host) that no decode step pays. It made c and v read 5-15% low."""
    device, width = kv.length.device, kv.width
    tok = torch.randint(0, vocab, (kv.batch_size, tokens), generator=torch.Generator().manual_seed(1)).to(device)  # [B, tokens]
    new = torch.ones(kv.batch_size, tokens, dtype=torch.bool, device=device)  # [B, tokens]
    _sync(device)
    t0 = time.perf_counter()
    kv.forward(tok, new)
    _sync(device)
    dt = time.perf_counter() - t0
    kv.truncate(kv.length - tokens)  # keep the context length fixed
    assert kv.width == width, "a common suffix must be cropped, not left as holes"
    return dt


@dataclass
class Costs:
    """Calibrated seconds at one batch size: ``draft`` one draft forward of 1 token per row,
    ``target[w - 1]`` one target forward of w tokens per row (w = 1..k_max+1)."""

    draft: float
    target: list[float]

    @staticmethod
    def between(lo: "Costs", hi: "Costs", t: float) -> "Costs":
        """Costs a fraction t of the way from lo to hi (batch sizes between two calibrated ones)."""
        n = min(len(lo.target), len(hi.target))
        return Costs(lo.draft + t * (hi.draft - lo.draft), [a + t * (b - a) for a, b in zip(lo.target[:n], hi.target[:n])])

    def target_at(self, k: int) -> float:
        """Seconds verifying k+1 tokens per row; past the calibrated widths (a fixed row may ask for up
        to 16), extended by the last calibrated step's increment."""
        last = len(self.target) - 1
        if k <= last:
            return self.target[k]
        return self.target[last] + (k - last) * max(self.target[last] - self.target[last - 1] if last else 0.0, 0.0)


def calibrate(target, draft, batch: int, widths: int, vocab: int, context: int, repeats: int = 3) -> Costs:
    """Costs at ``batch`` rows, target widths 1..``widths`` on ``context`` tokens, each the fastest of ``repeats`` forwards after one warm-up: the fastest,
    since another process on the cores only ever slows a forward, and the per-step rescaling in
    SpeculationPolicy takes care of the level; what the choice needs from here is the shape over w."""
    device = next(target.parameters()).device
    tkv, dkv = filled_cache(target, batch, context, vocab, device), filled_cache(draft, batch, context, vocab, device)

    def fastest(kv: BatchKV, tokens: int) -> float:
        timed_forward(kv, tokens, vocab)
        return min(timed_forward(kv, tokens, vocab) for _ in range(repeats))

    return Costs(fastest(dkv, 1), [fastest(tkv, w) for w in range(1, widths + 1)])


@dataclass
class RowView:
    """What the choice needs of one running row."""

    auto: bool  # asked for "auto"
    k: int  # its own k (a fixed row), or the most it may draft this step (an auto row: max_tokens' cap)
    accepted: int  # its drafts accepted so far
    tested: int  # its drafts tested so far (accepted + rejections)


class SpeculationPolicy:
    """Chooses k for the "auto" rows of each step and learns from the steps it sees.

    ``measure(batch) -> Costs`` calibrates a batch size the first time it is needed: the powers of two
    and ``max_batch``, with the sizes between interpolated (a server of max_batch_size 256 calibrates
    9 sizes, not 256, each a stall of ~40 forwards). ``fork()`` gives a policy sharing the calibration
    but learning afresh (the bench: each run served as by a server that met those batch sizes before)."""

    def __init__(self, k_max: int, measure: Callable[[int], Costs], max_batch: int | None = None,
                 prior_alpha: float = 0.6, prior_weight: float = 8.0, decay: float = 0.05):
        self.k_max, self.measure, self.max_batch = k_max, measure, max_batch
        self.costs: dict[int, Costs] = {}  # calibrated batch sizes only
        self.prior_weight, self.decay = prior_weight, decay
        # Running acceptance of all rows, a decayed count (a row's own α is shrunk towards it)
        self._acc, self._tested = prior_alpha * prior_weight, prior_weight
        # measured ÷ calibrated, for draft and target forwards; the loop's own seconds per step
        self.draft_scale, self.target_scale, self.overhead = 1.0, 1.0, 0.0
        self.calibration_seconds = 0.0  # spent in measure(), for the engine to leave out of L
        self._hyper = (prior_alpha, prior_weight, decay)
        # Forks share costs and this lock: two engines (threads) meeting one size must not calibrate
        # it side by side, each timing its forwards under the other's load
        self._lock = threading.Lock()

    def fork(self) -> "SpeculationPolicy":
        p = SpeculationPolicy(self.k_max, self.measure, self.max_batch, *self._hyper)
        p.costs, p._lock = self.costs, self._lock
        return p

    @property
    def mean_alpha(self) -> float:
        return self._acc / self._tested

    def cost(self, batch: int) -> Costs:
        lo = 1 << (batch.bit_length() - 1)  # the power of two at or below batch
        hi = min(2 * lo, self.max_batch or 2 * lo)
        if lo == batch or hi <= batch:  # a power of two, max_batch, or past it (a batch over max_batch)
            return self._calibrated(batch)
        return Costs.between(self._calibrated(lo), self._calibrated(hi), (batch - lo) / (hi - lo))

    def _calibrated(self, batch: int) -> Costs:
        with self._lock:
            if batch not in self.costs:
                t0 = time.perf_counter()
                self.costs[batch] = self.measure(batch)
                dt = time.perf_counter() - t0
                self.calibration_seconds += dt
                logging.getLogger(__name__).info("num_speculative_tokens auto: calibrated batch size %d in %.2f s", batch, dt)
            return self.costs[batch]

    def step_seconds(self, batch: int, k: int) -> float:
        """Predicted seconds of a step of ``batch`` rows whose widest row drafts k."""
        c = self.cost(batch)
        return k * c.draft * self.draft_scale + c.target_at(k) * self.target_scale + self.overhead

    def alpha(self, row: RowView) -> float:
        w = self.prior_weight
        return (row.accepted + w * self.mean_alpha) / (row.tested + w)

    def choose(self, rows: list[RowView]) -> int:
        """The k in 1..k_max for the auto rows with the most expected tokens per second (the smallest
        such k on a tie: fewer wasted drafts). Fixed rows keep their k but count: they set the
        verification's width and yield tokens."""
        alphas = [self.alpha(r) for r in rows]
        best, best_rate = 1, -1.0
        for k in range(1, self.k_max + 1):
            ks = [min(k, r.k) if r.auto else r.k for r in rows]
            top = max(ks)
            rate = sum(expected_tokens(a, ki) for a, ki in zip(alphas, ks)) / self.step_seconds(len(rows), top)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    def observe(self, batch: int, k: int, draft_seconds: float, target_seconds: float, loop_seconds: float,
                accepted: int, tested: int) -> None:
        """One step's measurements: its rows, widest k, seconds in draft forwards, in the target's
        verification and in the loop's own work, and its drafts accepted and tested."""
        c, e = self.cost(batch), self.decay
        if k > 0:
            self.draft_scale += e * (draft_seconds / (k * c.draft) - self.draft_scale)
        self.target_scale += e * (target_seconds / c.target_at(k) - self.target_scale)
        self.overhead += e * (max(loop_seconds, 0.0) - self.overhead)
        if tested:  # a step that tested no draft (every row at its last token) is no evidence: it forgets nothing
            keep = 1 - e  # (decayed anyway, a run of max_tokens=1 requests wore the prior away to a subnormal 1.0)
            self._acc, self._tested = keep * self._acc + accepted, keep * self._tested + tested
