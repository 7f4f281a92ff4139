"""Disaggregated speculative decoding: draft and target on different workers, one call to each per
speculation step. Ray-free: deployments/disagg.py wraps DraftWorker and TargetVerifier in Ray Serve
deployments (a draft pool and a verifier, each batching across sequences); tests drive them directly.

Why every call carries the sequence's whole token history: a worker keeps each sequence's KV cache
(keyed by sequence id, so the router sends a sequence back to the worker that has it), but when a
sequence lands on a worker without its cache (a new replica, an eviction, a restart) the worker
recomputes it in the same forward (or, if long, in one of its own first: prefill.apart). Affinity is an
optimisation, never a correctness requirement.

Draft-ahead: after answering, a draft worker keeps drafting while the target verifies, assuming all k
proposals will be accepted and guessing the target's bonus token with its own. When the guess is
right, the next proposal is already there. Any proposal keeps the output lossless; this one is a
sample from the draft given the true prefix, drawn with uniforms independent of verification.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .config import is_greedy
from .engine import StepStats, check_state_fits
from .kv import BatchKV, make_hole_safe, pad_right
from .logprobs import step_logprobs
from .output import Request, StreamDelta
from .prefill import APART_OVERHEAD, apart
from .sampling import seeded_generator
from .spec import RowState, accept, broken_rows, fit_vocab, propose

_log = logging.getLogger(__name__)

_DRAFT, _AHEAD, _VERIFY = 1, 2, 3  # uniform streams: never share uniforms between these roles
# A sequence runs a step every few tens of milliseconds; one whose cache row has sat unused this long on
# a worker has finished with its release sent elsewhere, or moved to another replica for good.
IDLE_ROW_S = 120.0


def _evict(entries: OrderedDict, limit: int, now: float, idle_s: float) -> list:
    """Drop the oldest entries (each value's last item is when it was stored) past ``limit``, and any
    older than ``idle_s``; returns the dropped keys."""
    dropped = []
    while entries and (len(entries) > limit or now - next(iter(entries.values()))[-1] > idle_s):
        dropped.append(entries.popitem(last=False)[0])
    return dropped


def uniforms(seed: int, stream: int, position: int, n: int) -> torch.Tensor:
    """[n] uniforms that depend only on (seed, stream, position): any worker draws the same ones,
    so a sequence that moves to another worker keeps its seeded output. Positions only grow.
    float64, as the engine's (SpecEngine._uniforms)."""
    return torch.rand(n, generator=seeded_generator(seed, stream, position), dtype=torch.float64)


@dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)  # as the rows' float32 temperatures read it (config.FLOAT32_ZERO)


@dataclass
class ProposeItem:
    seq_id: str
    history: list[int]  # prompt + output so far
    k: int
    sampling: Sampling
    # k of the next step if all k are accepted (max_tokens caps it; 0: no step would draft), so
    # drafting ahead never runs past the positions the request can use. None: k again.
    next_k: int | None = None


@dataclass
class Proposal:
    tokens: list[int]  # [k]
    probs: torch.Tensor | None  # [k, V] float32 draft distributions; None for greedy (one-hot of tokens)
    version: int = 0  # the draft version that proposed them


@dataclass
class VerifyItem:
    seq_id: str
    history: list[int]
    draft: list[int]  # [k]
    draft_probs: torch.Tensor | None  # [k, V], None for greedy
    sampling: Sampling
    expert: str = "default"
    prompt_len: int = 0  # where the response starts in history (replay records index the response)
    draft_version: int = 0
    logprobs: int | None = None  # the request's logprobs (SamplingParams.logprobs): alternatives per token


@dataclass
class Verdict:
    tokens: list[int]  # accepted draft tokens, then one target token (correction or bonus)
    accepted: int
    recomputed: int  # history tokens this step fed because the worker lacked them (0 on a cache hit)
    broken: bool = False  # the target's logits ranked nothing (NaN): the tokens are not its; the request ends in an error
    logprobs: list | None = None  # a TokenLogprob per token, if the item asked for them (logprobs.py)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _firsts(seq_ids: list[str]) -> list[bool]:
    """Whether each place holds the first occurrence of its id."""
    seen: set[str] = set()
    return [not (s in seen or seen.add(s)) for s in seq_ids]


def _rows(items, pending: list[list[int]], device, ks: list[int]) -> RowState:
    ids, valid = pad_right(pending)  # [B, W]
    s = [it.sampling for it in items]
    return RowState(
        last=torch.tensor([p[-1] for p in pending], device=device),
        pending=ids.to(device), pending_n=valid.sum(1).to(device), k=torch.tensor(ks, device=device),
        temperature=torch.tensor([x.temperature for x in s], dtype=torch.float32, device=device),
        top_k=torch.tensor([x.top_k for x in s], device=device),
        top_p=torch.tensor([x.top_p for x in s], dtype=torch.float32, device=device),
    )


class SeqCaches:
    """Each sequence's KV cache (and the tokens it holds), gathered into one batch per call.

    The sequences of the last call stay merged (the slab): in steady state the same sequences come
    back batch after batch, so no copy. When the set changes, the slab is split into per-sequence
    rows (views) and the new set merged (one copy per layer)."""

    def __init__(self, model, device: torch.device, max_seqs: int = 1024, idle_s: float = IDLE_ROW_S,
                 clock: Callable[[], float] = time.monotonic):
        make_hole_safe(model)
        self.model, self.device, self.max_seqs, self.idle_s, self.clock = model, device, max_seqs, idle_s, clock
        self.slab = BatchKV(model, 0, device)
        self.slab_ids: list[str] = []
        self.tokens: dict[str, list[int]] = {}  # seq id -> tokens its cache holds (positions 0..n-1)
        self.prefed: list[int] = []  # per row of the last gather, history tokens it fed apart (_apart)
        # Detached rows and when they left the slab, least recently used first.
        self._rows: OrderedDict[str, tuple[BatchKV, float]] = OrderedDict()

    def gather(self, seq_ids: list[str], histories: list[list[int]]) -> tuple[BatchKV, list[list[int]]]:
        """The batch for these sequences, each cache rolled back to the longest prefix it shares with
        its history (leaving at least the last token to feed); returns it and what each row must feed."""
        # tokens[sid] describes one row: a sequence id twice in one call (a duplicated or retried request)
        # has it at its first place only. Another place recomputes in full and is never recorded: its
        # cache, taken for the first's at the next call, gave a verdict from another history.
        firsts = _firsts(seq_ids)
        pre = self._apart(seq_ids, histories, firsts)  # before any state changes: a forward may raise
        self.prefed = [len(pre[s][1]) if own and s in pre else 0 for s, own in zip(seq_ids, firsts)]
        if seq_ids != self.slab_ids:
            staying, now = set(seq_ids), self.clock()
            for sid, row, own in zip(self.slab_ids, self.slab.split(), _firsts(self.slab_ids)):
                if own and sid in self.tokens:  # not released
                    if sid not in staying:  # its own tensors, holes squeezed out: a view would keep
                        row.compact()  # the whole old slab (every other row, the padding) alive
                    self._rows[sid] = (row, now)
            parts = []
            for sid, own in zip(seq_ids, firsts):
                row = self._rows.pop(sid, (None,))[0] if own else None
                if own and sid in pre:
                    row, self.tokens[sid] = pre[sid]
                elif row is None:
                    if own:
                        self.tokens[sid] = []
                    row = BatchKV(self.model, 1, self.device)
                parts.append(row)
            self.slab, self.slab_ids = BatchKV.merge(self.model, self.device, parts), list(seq_ids)
            # Rows of sequences whose client never came back, or whose steps now go to another replica
            # (it gets their release): oldest out past max_seqs, and any left idle for idle_s.
            for sid in _evict(self._rows, self.max_seqs, now, self.idle_s):
                self.tokens.pop(sid, None)
        # setdefault: a call queued before its sequence was released (the client went away) finds no
        # entry; it recomputes that row instead of failing every sequence batched with it.
        keep = [min(_lcp(self.tokens.setdefault(s, []), h), len(h) - 1) if own else 0
                for s, h, own in zip(seq_ids, histories, firsts)]
        self.slab.truncate(torch.tensor(keep, device=self.device))
        # Recorded now, not after the forward: one that raises leaves each row holding just this prefix,
        # and the longer tokens of before made the next call feed from past the row's end (a call
        # after one that failed got a verdict that was not the target's).
        for s, h, n, own in zip(seq_ids, histories, keep, firsts):
            if own:
                self.tokens[s] = h[:n]
        if self.slab.hole_fraction() > 0.5:  # rejected drafts leave holes; as the colocated engine does
            self.slab.compact()
        return self.slab, [h[n:] for h, n in zip(histories, keep)]

    def _apart(self, seq_ids: list[str], histories: list[list[int]], firsts: list[bool]) -> dict:
        """New sequences worth a prefill of their own (prefill.apart): seq id -> (a one-row cache holding
        its history but the last token, those tokens). Only rows with no cache here: the merge takes them."""
        in_slab = set(self.slab_ids)
        fresh = [own and s not in self.tokens and s not in in_slab for s, own in zip(seq_ids, firsts)]
        if len(seq_ids) < 2 or not any(f and len(h) > APART_OVERHEAD for f, h in zip(fresh, histories)):
            return {}  # the common case, decided without comparing any history
        feeds = [len(h) if f else len(h) - min(_lcp(self.tokens.get(s, []), h), len(h) - 1)
                 for s, h, f in zip(seq_ids, histories, fresh)]
        pre = {}
        for s, h, go in zip(seq_ids, histories, apart(feeds, fresh, APART_OVERHEAD)):
            if go:
                kv = BatchKV(self.model, 1, self.device)
                ids = torch.tensor([h[:-1]], device=self.device)  # [1, n]
                kv.forward(ids, torch.ones_like(ids, dtype=torch.bool), keep=1)  # a prefill reads no logits
                pre[s] = (kv, list(h[:-1]))
        return pre

    def set_tokens(self, seq_ids: list[str], tokens: list[list[int]]) -> None:
        for sid, t, own in zip(seq_ids, tokens, _firsts(seq_ids)):
            if own:  # see gather
                self.tokens[sid] = t

    def release(self, seq_id: str) -> None:
        """The sequence finished: forget it (its slab row goes at the next change of the batch)."""
        self.tokens.pop(seq_id, None)
        self._rows.pop(seq_id, None)


class DraftWorker:
    """Proposes k tokens for a batch of sequences, then drafts ahead (see the module docstring)."""

    def __init__(self, draft, vocab: int, max_seqs: int = 1024, ahead: bool = True, version: int = 0, **cache_args):
        self.draft, self.vocab, self.ahead, self.version = draft, vocab, ahead, version
        self.device = next(draft.parameters()).device
        self.max_seqs, self._cache_args = max_seqs, cache_args  # cache_args: SeqCaches' idle_s, clock
        self.caches = SeqCaches(draft, self.device, max_seqs, **cache_args)
        # seq id -> (history it assumes, proposal), least recently drafted first. Bounded like the caches:
        # with several replicas a sequence's next step or release may go to another one, leaving it here.
        self._ahead: OrderedDict[str, tuple[list[int], Proposal, float]] = OrderedDict()
        self._last: tuple[list[ProposeItem], list[Proposal]] | None = None
        self.hits = self.misses = 0

    def swap(self, state: dict[str, torch.Tensor], version: int) -> None:
        """New draft weights (names as in draft.state_dict()). Call it between calls, never during one
        (the deployment runs it on its torch thread). Caches and drafted-ahead proposals hold the old
        weights' work: dropped, so each sequence is recomputed by the new draft at its next proposal."""
        check_state_fits(self.draft, state, "swap")  # else a mix of two versions served, labelled the old one
        self.draft.load_state_dict(state, strict=False)
        self.version = version
        self.caches = SeqCaches(self.draft, self.device, self.max_seqs, **self._cache_args)
        self._ahead, self._last = OrderedDict(), None

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out: list[Proposal | None] = [None] * len(items)
        todo = []
        for i, it in enumerate(items):
            base, prop, _ = self._ahead.pop(it.seq_id, (None, None, None))
            if base == it.history and len(prop.tokens) >= it.k:  # more when max_tokens capped this k
                out[i] = Proposal(prop.tokens[: it.k], prop.probs[: it.k] if prop.probs is not None else None, prop.version)
                self.hits += 1
            elif it.k > 0:
                todo.append(i)
                self.misses += base is not None
            else:
                out[i] = Proposal([], None, self.version)
        if todo:
            run = [items[i] for i in todo]
            kmax = max(it.k for it in run)
            u = [uniforms(it.sampling.seed, _DRAFT, len(it.history), kmax) for it in run]
            for i, p in zip(todo, self._draft(run, [it.history for it in run], [it.k for it in run], u)):
                out[i] = p
        # Draft ahead for every sequence that proposed, from drafting ahead or not.
        live = [i for i, it in enumerate(items) if it.k > 0]
        self._last = ([items[i] for i in live], [out[i] for i in live]) if live else None
        return out

    def draft_ahead(self) -> None:
        """Draft k+1 more tokens for the sequences of the last propose(): a guess of the target's
        bonus token, then the next step's k proposals. Runs while the target verifies."""
        if not self.ahead or self._last is None:
            return
        items, props = self._last
        self._last = None
        nexts = [it.k if it.next_k is None else it.next_k for it in items]
        keep = [i for i, n in enumerate(nexts) if n > 0]  # a request that would end needs no next step
        if not keep:
            return
        items, props, nexts = [items[i] for i in keep], [props[i] for i in keep], [nexts[i] for i in keep]
        histories = [it.history + p.tokens for it, p in zip(items, props)]
        # The bonus guess draws from its own stream; the next step's proposals draw exactly what
        # propose() would on a miss (the _DRAFT stream at that step's history length), so a seeded
        # request's output does not depend on whether drafting ahead hit.
        kmax = max(nexts)
        u = [torch.cat([uniforms(it.sampling.seed, _AHEAD, len(h), 1), uniforms(it.sampling.seed, _DRAFT, len(h) + 1, kmax)])
             for it, h in zip(items, histories)]
        now = self.caches.clock()
        for it, h, p in zip(items, histories, self._draft(items, histories, [n + 1 for n in nexts], u)):
            probs = p.probs[1:] if p.probs is not None else None
            self._ahead[it.seq_id] = (h + p.tokens[:1], Proposal(p.tokens[1:], probs, p.version), now)
            self._ahead.move_to_end(it.seq_id)
        _evict(self._ahead, self.max_seqs, now, self.caches.idle_s)

    def _draft(self, items: list[ProposeItem], histories: list[list[int]], ks: list[int], u: list[torch.Tensor]) -> list[Proposal]:
        """u: each row's uniforms, one per drafted column (at least max(ks))."""
        ids = [it.seq_id for it in items]
        kv, feeds = self.caches.gather(ids, histories)
        rows = _rows(items, feeds, self.device, ks)
        kmax = max(ks)
        u = torch.stack([x[:kmax] for x in u]).to(self.device)  # [B, k]
        tokens, probs, _ = propose(kv, rows, kmax, self.vocab, u)  # [B, k], [B, k, V]
        tokens = tokens.tolist()
        # The cache now holds the history and each row's first k_i - 1 proposals (the last is never fed).
        self.caches.set_tokens(ids, [h + t[: n - 1] for h, t, n in zip(histories, tokens, ks)])
        # A copy per row: on CPU .float().cpu() of a float32 slice is a view, and a pickled view carries
        # its whole buffer, so every Proposal sent on carried the batch's [B, k, V]
        return [Proposal(t[:n], None if it.sampling.greedy else probs[i, :n].to("cpu", torch.float32, copy=True), self.version)
                for i, (it, t, n) in enumerate(zip(items, tokens, ks))]

    def release(self, seq_id: str) -> None:
        self.caches.release(seq_id)
        self._ahead.pop(seq_id, None)
        if self._last is not None:  # a release between propose() and draft_ahead() would bring it back
            keep = [i for i, it in enumerate(self._last[0]) if it.seq_id != seq_id]
            self._last = ([self._last[0][i] for i in keep], [self._last[1][i] for i in keep]) if keep else None


class TargetVerifier:
    """Scores every sequence's proposals in one target forward and applies the accept rule.

    recorder: a distill Recorder; each step's target distributions go to it (no extra forward), and
    finish() turns a finished sequence into a replay record for the distiller."""

    def __init__(self, target, vocab: int, max_seqs: int = 1024, recorder=None):
        self.target, self.vocab, self.recorder = target, vocab, recorder
        self.device = next(target.parameters()).device
        self.caches = SeqCaches(target, self.device, max_seqs)

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verdict], dict[str, StepStats]]:
        if not items:  # as propose([]) answers: max() of no k raised, after gather had detached every row
            return [], {}
        t0 = time.perf_counter()
        dev, b = self.device, len(items)
        ids, hist = [it.seq_id for it in items], [it.history for it in items]
        kv, feeds = self.caches.gather(ids, hist)
        ks = [len(it.draft) for it in items]
        kmax = max(ks)
        inp, valid = pad_right([f + it.draft for f, it in zip(feeds, items)])  # [B, W]
        # Row i's last history token sits at len(feed_i) - 1; it and the k_i drafts after it are scored.
        # Logits from the earliest such column on: a sequence's first feed is its prompt, scored never
        start = torch.tensor([len(f) - 1 for f in feeds], device=dev)  # [B]
        cut = int(start.min())
        logits = kv.forward(inp.to(dev), valid.to(dev), keep=inp.shape[1] - cut)  # [B, W - cut, V']
        pos = (start[:, None] - cut + torch.arange(kmax + 1, device=dev)[None, :]).clamp_max(logits.shape[1] - 1)  # [B, k+1]
        logits = fit_vocab(logits[torch.arange(b, device=dev)[:, None], pos], self.vocab)  # [B, k+1, V]
        rows = _rows(items, [h[-1:] for h in hist], dev, ks)
        draft, _ = pad_right([it.draft for it in items])  # [B, k] (k = the longest draft)
        draft = draft.to(dev)
        q = None  # all greedy: accept() needs only the tokens (one-hot q)
        if not rows.all_greedy:
            q = torch.zeros(b, kmax, self.vocab, device=dev)  # [B, k, V]
            for i, it in enumerate(items):
                if not ks[i]:
                    continue
                if it.draft_probs is None:  # greedy: the draft's distribution is one-hot at its token
                    q[i, torch.arange(ks[i]), draft[i, : ks[i]]] = 1.0
                else:
                    q[i, : ks[i]] = it.draft_probs.to(dev, torch.float32)
        # Row i draws k_i + 1: its k_i accept tests, then the final sample, which accept() reads from column
        # kmax. Drawing kmax + 1 put another uniform there whenever a longer draft shared the batch, so a
        # seed's tokens depended on the batch (as SpecEngine._uniforms; the columns between are never read).
        u = torch.full((b, kmax + 1), 0.5, dtype=torch.float64)  # [B, k+1]
        for i, (it, ki) in enumerate(zip(items, ks)):
            d = uniforms(it.sampling.seed, _VERIFY, len(it.history), ki + 1)  # [k_i + 1]
            u[i, :ki], u[i, kmax] = d[:ki], d[ki]
        u = u.to(dev)
        tokens, n_acc, _ = accept(logits, rows, draft, q, u)
        broken = broken_rows(logits, n_acc).tolist()  # [B]: argmax and sampling would have said token 0
        n_acc_l = n_acc.tolist()
        lps = step_logprobs(logits, tokens, n_acc_l, [it.logprobs for it in items])
        tokens = tokens.tolist()
        if self.recorder is not None:
            if q is None:  # all greedy: the draft's q is one-hot at its tokens (padding past k_i is never read)
                q = torch.nn.functional.one_hot(draft, self.vocab).float()  # [B, k, V]
            # A sequence id twice in the batch (a duplicated request) is recorded at its first place only,
            # as its cache is (SeqCaches.gather): both places in one trace made a record whose positions
            # and distributions came from two histories.
            own = _firsts(ids)
            rows_ = slice(None) if all(own) else torch.tensor([i for i, o in enumerate(own) if o], device=dev)
            pick = lambda xs: [x for x, o in zip(xs, own) if o]  # noqa: E731
            self.recorder.observe_probs(pick([(it.seq_id, it.expert) for it in items]), torch.softmax(logits[rows_].float(), -1),
                                        q[rows_], pick(n_acc_l), pick(ks), pick([len(h) - it.prompt_len for h, it in zip(hist, items)]),
                                        pick([it.draft_version for it in items]))
        # The cache keeps the history and the accepted drafts; the correction/bonus token is fed next step.
        kv.truncate(torch.tensor([len(h) + a for h, a in zip(hist, n_acc_l)], device=dev))
        self.caches.set_tokens(ids, [h + it.draft[:a] for h, it, a in zip(hist, items, n_acc_l)])
        # A broken row keeps its tokens: a router of the release before `broken` appends them (as it
        # did) rather than verifying the same history again forever; run_request drops them.
        verdicts = [Verdict(t[: a + 1], a, len(f) - 1 + n, bad, lp)
                    for t, a, f, n, bad, lp in zip(tokens, n_acc_l, feeds, self.caches.prefed, broken, lps)]
        for it in (it for it, bad in zip(items, broken) if bad):
            _log.warning("sequence %s ended: the target's logits were NaN", it.seq_id)
        return verdicts, self._stats(items, verdicts, time.perf_counter() - t0)

    @staticmethod
    def _stats(items: list[VerifyItem], verdicts: list[Verdict], seconds: float) -> dict[str, StepStats]:
        """One StepStats per expert in this batch (what telemetry.on_step takes)."""
        out: dict[str, StepStats] = {}
        for it, v in zip(items, verdicts):
            if v.broken:  # its request ends without these tokens (as SpecEngine.step, which skips it)
                continue
            k = len(it.draft)
            st = out.setdefault(it.expert, StepStats(0, 0, 0, 0, [], [], 0, 0.0, seconds, 0.0))
            st.accepted_per_position += [0] * (k - len(st.accepted_per_position))
            st.proposed_per_position += [0] * (k - len(st.proposed_per_position))
            st.tested_per_position += [0] * (k - len(st.tested_per_position))
            st.batch_size += 1
            st.proposed += k
            st.accepted += v.accepted
            st.rejected += v.accepted < k
            # The verdict's tokens: the router may cut some (past EOS or a stop string), which the
            # verifier cannot see, so here emitted is what the target produced, not what was output.
            st.emitted += len(v.tokens)
            for j in range(k):
                st.proposed_per_position[j] += 1
                st.accepted_per_position[j] += j < v.accepted
                st.tested_per_position[j] += j <= v.accepted
        return out

    def release(self, seq_id: str) -> None:
        self.caches.release(seq_id)

    def finish(self, seq_id: str, prompt_ids: list[int], output_ids: list[int]):
        """The sequence's replay record (None if no position was kept, or nothing is recorded)."""
        if self.recorder is None:
            return None
        return self.recorder.finish(SimpleNamespace(request_id=seq_id, prompt_ids=prompt_ids, output_ids=output_ids))[0]


async def run_request(
    req: Request, seed: int, tokenizer, eos_ids: set[int],
    propose_fn: Callable[[ProposeItem], Awaitable[Proposal]],
    verify_fn: Callable[[VerifyItem], Awaitable[Verdict]],
) -> AsyncIterator[StreamDelta]:
    """Drive one request: propose, verify, append, until it stops. Yields deltas as tokens are accepted."""
    p = req.params
    s = Sampling(p.temperature, p.top_k, p.top_p, seed)
    while not req.finished:
        history = req.prompt_ids + req.output_ids
        k = req.step_k()
        item = ProposeItem(req.request_id, history, k, s, next_k=req.step_k(emitted=len(req.output_ids) + k + 1))
        prop = await propose_fn(item) if k else Proposal([], None)
        v = await verify_fn(VerifyItem(req.request_id, history, prop.tokens, prop.probs, s, req.expert,
                                       len(req.prompt_ids), prop.version, p.logprobs))
        if v.broken:  # as SpecEngine.step: nothing the target did not choose is emitted
            req.finish_reason = "error"
            yield req.delta()
            return
        req.proposed += k
        req.accepted += v.accepted
        req.steps += 1
        req.append(v.tokens, tokenizer, eos_ids, v.logprobs)
        d = req.delta()
        if d.token_ids or d.text or d.finished:
            yield d


def version_row(version: int, was: int | None, manifest: dict | None) -> dict | None:
    """The Verifier's telemetry row for a proposal from draft version ``version``, ``was`` the one it last logged,
    or None: no change to log. manifest: the shared store's (None: unknown, so any change is one). After a publish
    or a rollback, DraftPool replicas not yet swapped (their watcher polls every 2 s, then loads the draft)
    propose from the version left: only the store's current version is a row, or they flipped it back and
    forth. One below the last, which the store still keeps (a clear restarts the numbering), is a rollback,
    marked so on every Verifier replica, not only on the one the Router told."""
    if manifest is not None and version != manifest["current"]:
        return None
    rolled = was is not None and version < was and manifest is not None and was in manifest["versions"]
    return {"version": version, **({"rollback": 1} if rolled else {})}
