"""Turn each verification step into replay records and per-request acceptance traces.

Verification is where the target's distributions come for free: the target has just scored every
draft position in one forward, so recording costs a softmax and a copy, never an extra forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .replay import ReplayRecord, compress, make_record


@dataclass
class RecordConfig:
    keep: str = "mismatch"  # mismatch: only positions the draft got wrong (the paper) | all verified
    topk: int = 0  # 0 keeps the full distribution; else top-k probs + the remaining mass
    # Every guard_every-th request is a guard sample: all its verified positions are kept and it is
    # held out for the guard. Mismatch positions alone would bias the guard: there the serving draft
    # was wrong by construction (greedy agreement 0), so any candidate looks better and a worse one
    # was published.
    guard_every: int = 4
    # What one request may hold in flight before it finishes (its record's size): past it, later
    # positions are not kept. A guard sample keeps every position, and with the full distribution
    # (topk 0) a 4k-token reply over a 152k vocabulary would hold 1.2 GB outside the buffer's budget.
    max_record_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.keep not in ("mismatch", "all"):
            raise ValueError(f"keep must be 'mismatch' or 'all', got {self.keep!r}")
        if self.topk < 0:
            raise ValueError(f"topk must be >= 0, got {self.topk}")
        if self.guard_every < 1:
            raise ValueError(f"guard_every must be >= 1, got {self.guard_every}")
        if self.max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be >= 1, got {self.max_record_bytes}")


@dataclass
class RequestTrace:
    """What one request saw of the draft: the per-request numbers of `osd-serve replay`."""

    request_id: str
    expert: str = "default"
    tested: int = 0  # draft positions the target checked (accepted ones + the first rejected)
    accepted: int = 0
    expected: float = 0.0  # sum over tested positions of sum_x min(p(x), q(x)): raw p and q colocated;
    # the disaggregated verifier has only the processed q (one-hot under greedy)
    scored: int = 0  # the tested positions in ``expected``: those whose p and q were finite
    steps: int = 0
    emitted: int = 0
    draft_version: int = 0  # the version that served the request's last step
    guard: bool = False  # a guard sample (RecordConfig.guard_every)
    positions: list[int] = field(default_factory=list)  # response indices kept for the record
    # per kept position, on CPU: [V] float16, or with RecordConfig.topk the (vals [1, K], ids [1, K],
    # rest [1]) of replay.compress, compressed as it comes so a request in flight holds what its record will
    probs: list = field(default_factory=list)
    nbytes: int = 0  # of probs

    @property
    def greedy_acceptance(self) -> float | None:
        return self.accepted / self.tested if self.tested else None

    @property
    def expected_acceptance(self) -> float | None:
        return self.expected / self.scored if self.scored else None

    def summary(self) -> dict:
        return {
            "request_id": self.request_id, "expert": self.expert, "acceptance": self.greedy_acceptance,
            "expected_acceptance": self.expected_acceptance, "tokens_per_target_forward":
            self.emitted / self.steps if self.steps else None, "draft_version": self.draft_version,
        }


class Recorder:
    """Called by the engine after every step and when a request finishes.

    on_finish(record_or_None, trace) receives each finished request; the record is None when no
    position was kept (e.g. keep='mismatch' and the draft was right everywhere).
    """

    def __init__(self, cfg: RecordConfig | None = None, on_finish: Callable | None = None, max_traces: int = 4096):
        self.cfg = cfg or RecordConfig()
        self.max_traces = max_traces
        self.on_finish = on_finish
        self.traces: dict[str, RequestTrace] = {}
        self._started = 0  # requests seen: every guard_every-th is a guard sample

    @torch.no_grad()
    def observe(self, requests, out, n_acc: list[int], k_rows: list[int], before: list[int], version: int) -> None:
        """requests: the batch's Request objects (row order); before[i]: len(output_ids) before the step."""
        p = torch.softmax(out.target_logits.float(), -1).cpu()  # [B, k+1, V]
        q = torch.softmax(out.draft_logits.float(), -1).cpu()  # [B, k, V]
        keys = [(r.request_id, getattr(r, "expert", "default")) for r in requests]
        self.observe_probs(keys, p, q, n_acc, k_rows, before, [version] * len(keys))

    @torch.no_grad()
    def observe_probs(self, keys: list[tuple[str, str]], p: torch.Tensor, q: torch.Tensor, n_acc: list[int],
                      k_rows: list[int], before: list[int], versions: list[int]) -> None:
        """keys: (request id, expert) per row. p [B, k+1, V]: the target's raw distributions; q [B, k, V]:
        the draft's (the disaggregated verifier has only the processed q, one-hot for greedy)."""
        p, q = p.float().cpu(), q.float().cpu()
        k = q.shape[1]
        overlap = torch.minimum(p[:, :k], q).sum(-1)  # [B, k]
        # A target logit that overflowed (float16 can reach inf) makes its softmax NaN while greedy
        # serving goes on: such a position is not kept, or one record would poison every update.
        finite = torch.isfinite(p).all(-1).tolist()  # [B][k+1]
        topk = self.cfg.topk if self.cfg.topk < p.shape[-1] else 0
        row_bytes = topk * 6 + 2 if topk else p.shape[-1] * 2  # float16 probs (+ int32 ids and the rest)
        for i, ((rid, expert), a, kr) in enumerate(zip(keys, n_acc, k_rows)):
            # Least recently observed last: over max_traces, what goes is a request not seen for longest
            # (one that moved to another replica and never finished here), never a live one.
            tr = self.traces.pop(rid, None)
            if tr is None:
                tr = RequestTrace(rid, expert, guard=self._started % self.cfg.guard_every == 0)
                self._started += 1
            self.traces[rid] = tr
            while len(self.traces) > self.max_traces:
                self.traces.pop(next(iter(self.traces)))
            tested = a + (a < kr)  # the draft positions whose context was on the target's path
            tr.tested += tested
            tr.accepted += a
            # A non-finite p (or q) gives a NaN overlap, which would make the request's expected
            # acceptance NaN, and with it every mean over traces it joins (replay, W&B)
            ok = torch.isfinite(overlap[i, :tested])
            tr.expected += float(overlap[i, :tested][ok].sum())
            tr.scored += int(ok.sum())
            tr.steps += 1
            tr.emitted += a + 1
            tr.draft_version = versions[i]
            if self.cfg.keep == "all" or tr.guard:
                kept = range(a + 1)
            else:
                kept = [a] if a < kr else []  # the position where the target corrected the draft
            for j in kept:
                if not finite[i][j] or tr.nbytes + row_bytes > self.cfg.max_record_bytes:
                    continue
                tr.positions.append(before[i] + j)
                # float16, as the record stores it; a copy, not a view, which would pin the whole
                # step's [B, k+1, V]
                tr.probs.append(compress(p[i, j][None], topk) if topk else p[i, j].half())
                tr.nbytes += row_bytes

    def drop(self) -> None:
        """Forget every request in flight (the engine was reset: none of them will finish)."""
        self.traces.clear()

    def finish(self, request) -> tuple[ReplayRecord | None, RequestTrace]:
        tr = self.traces.pop(request.request_id, None) or RequestTrace(request.request_id)
        n = len(request.output_ids)  # stop strings and max_tokens may have cut the last step short
        tr.emitted = min(tr.emitted, n)  # what was output, as the engine's tokens per step counts it
        keep = [j for j, pos in enumerate(tr.positions) if pos < n]
        rec = None
        if keep:
            rows = [tr.probs[j] for j in keep]
            # [n, V], or the compressed (vals [n, K], ids [n, K], rest [n])
            probs = tuple(torch.cat(parts) for parts in zip(*rows)) if isinstance(rows[0], tuple) else torch.stack(rows)
            rec = make_record(request.prompt_ids, request.output_ids, [tr.positions[j] for j in keep], probs,
                              topk=self.cfg.topk, expert=tr.expert)
            rec.heldout = tr.guard
        tr.positions, tr.probs, tr.nbytes = [], [], 0
        if self.on_finish is not None:
            self.on_finish(rec, tr)
        return rec, tr
