"""One speculative decoding step over a batch: propose, verify, accept, roll back, record.

The invariant between steps, for every row with N tokens so far (prompt + output):
  * the target cache holds positions 0..N-2; the last token ``rows.last`` is pending for the target;
  * the draft cache holds positions 0..N-1-m; its m pending tokens (1 or 2) are in ``rows.pending``.
Both hold because the prompt is prefilled without its last token (see engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch

from kernels import verify, verify_greedy
from kernels.verify import inverse_cdf_sample

from .kv import BatchKV
from .sampling import greedy_tokens, logits_to_probs


@dataclass
class RowState:
    """Per-row tensors of the running batch, kept aligned with the rows of both caches."""

    last: torch.Tensor  # [B] int64  last token, pending for the target
    pending: torch.Tensor  # [B, W] int64  tokens not yet in the draft cache (right-padded; W=2 in the engine)
    pending_n: torch.Tensor  # [B] int64  how many of them are real (1 or 2 in the engine; any in disagg.py)
    k: torch.Tensor  # [B] int64  draft tokens per step for each row
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32

    @property
    def all_greedy(self) -> bool:
        """Every row decodes at temperature 0: p and q are one-hot, and accept() needs only tokens."""
        return bool((self.temperature == 0).all())

    def select(self, rows: torch.Tensor) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name)[rows])

    def extend(self, other: "RowState") -> None:
        for f in fields(self):
            setattr(self, f.name, torch.cat([getattr(self, f.name), getattr(other, f.name)]))


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B, k+1] int64, -1 padded: accepted draft tokens then one target token
    num_accepted: torch.Tensor  # [B] int64 accepted draft tokens; each row emits num_accepted + 1
    draft_tokens: torch.Tensor  # [B, k]
    # The processed distributions the accept rule used; None for an all-greedy batch, which is
    # verified by argmax agreement without building them (see accept()).
    target_probs: torch.Tensor | None  # [B, k+1, V]
    draft_probs: torch.Tensor | None  # [B, k, V]
    # Raw (temperature 1, unfiltered) logits, padded to V: distillation learns the target's own
    # distribution, not the one-hot a greedy request verifies against.
    target_logits: torch.Tensor  # [B, k+1, V]
    draft_logits: torch.Tensor  # [B, k, V]
    draft_time: float
    target_time: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, T, V'] -> [B, T, vocab]. A draft with a smaller embedding never proposes the missing ids."""
    if logits.shape[-1] < vocab:
        return torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
    return logits[..., :vocab]


def row_probs(logits: torch.Tensor, rows: RowState) -> torch.Tensor:
    """Process [B, T, V] logits with each row's params into [B, T, V] probs (same rule for p and q)."""
    b, t, vocab = logits.shape
    flat = logits.reshape(b * t, vocab)
    probs = logits_to_probs(
        flat,
        rows.temperature.repeat_interleave(t),
        rows.top_k.repeat_interleave(t),
        rows.top_p.repeat_interleave(t),
    )
    return probs.view(b, t, vocab)


def propose(draft: BatchKV, rows: RowState, k: int, vocab: int, u_draft: torch.Tensor):
    """The draft proposes k tokens per row, autoregressively on its own cache.

    u_draft [B, k] uniforms for sampling each proposal (ignored by greedy rows: their q is one-hot).
    returns draft_tokens [B, k] int64, draft_probs [B, k, V] float32 (None when every row is greedy:
    q is then one-hot at each proposal, and accept() needs only the tokens), draft_logits [B, k, V].
    """
    active = rows.k > 0  # [B] rows with k=0 never read their draft, so their cache is not fed
    steps = torch.arange(rows.pending.shape[1], device=rows.k.device)
    inp, inp_valid = rows.pending, (steps[None, :] < rows.pending_n[:, None]) & active[:, None]  # [B, W]
    # Feed no column that is padding in every row: it would stay in the cache as a hole, and one hole
    # makes every later forward build a 4D attention mask (at batch 1 there are then no holes at all).
    n_in = inp_valid.sum(1)  # [B] real pending inputs per row (valid entries come first)
    width = max(int(n_in.max()), 1)
    inp, inp_valid = inp[:, :width], inp_valid[:, :width]  # [B, W']
    last = (n_in - 1).clamp_min(0)  # [B] index of each row's last real pending input
    batch = torch.arange(len(last), device=last.device)  # [B]
    # An all-greedy batch (the common serving case) takes each argmax straight from the logits:
    # per draft token, the processing and sampling ops cost a quarter of the draft's own forward on
    # CPU. Same tokens as the general path: q = one-hot of the argmax there too, and inverse-CDF
    # sampling a one-hot returns its index.
    greedy = rows.all_greedy
    # The first forward's logits from the earliest last input on: a disaggregated draft's first feed of a
    # sequence is its whole prompt, whose logits it never reads
    keep = width - int(last.min())
    tokens, probs, raw = [], [], []
    for j in range(k):
        logits = fit_vocab(draft.forward(inp, inp_valid, keep=keep if j == 0 else None), vocab)  # [B, keep or 1, V]
        raw.append(logits[batch, last - (width - keep)] if j == 0 else logits[:, 0])  # [B, V]
        if greedy:
            x = greedy_tokens(raw[-1])  # [B]
        else:
            q = row_probs(raw[-1][:, None], rows)[:, 0]  # [B, V]
            x = inverse_cdf_sample(q, u_draft[:, j])  # [B] the accept rule's own sampler: the q it is given
            probs.append(q)
        tokens.append(x)
        inp, inp_valid = x[:, None], (j + 1 < rows.k)[:, None]
    draft_probs = None if greedy else torch.stack(probs, 1)  # [B, k, V]
    return torch.stack(tokens, 1), draft_probs, torch.stack(raw, 1)  # [B, k], [B, k, V], [B, k, V]


def accept(target_logits: torch.Tensor, rows: RowState, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           u_verify: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The accept rule (kernels/) on target logits [B, k+1, V]: (tokens [B, k+1], num_accepted [B],
    target_probs [B, k+1, V] or None). draft_probs None means every row is greedy: p and q would
    both be one-hot, and verify_greedy gives the same tokens from the argmaxes alone (on CPU the
    one-hot p, q and the reference's float64 cumsum cost ~1 ms per step at batch 8, V=4096)."""
    if draft_probs is None:
        tokens, num_accepted = verify_greedy(greedy_tokens(target_logits), draft_tokens, rows.k)
        return tokens, num_accepted, None
    target_probs = row_probs(target_logits, rows)  # [B, k+1, V]
    tokens, num_accepted = verify(target_probs, draft_probs, draft_tokens, rows.k, u_verify)
    return tokens, num_accepted, target_probs


def broken_rows(target_logits: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose tokens this step came from a target distribution that ranks nothing, logits
    [B, k+1, V] with no finite maximum (NaN from an overflow inside the model, or all -inf) at one of
    the positions 0..num_accepted [B] that chose them. Argmax and sampling both return token 0 there."""
    top = target_logits.amax(-1)  # [B, k+1] NaN where any logit is NaN
    decided = torch.arange(top.shape[1], device=top.device)[None, :] <= num_accepted[:, None]  # [B, k+1]
    return ((top.isnan() | (top == float("-inf"))) & decided).any(1)


def speculative_step(
    target: BatchKV, draft: BatchKV, rows: RowState, vocab: int, u_draft: torch.Tensor, u_verify: torch.Tensor
) -> StepOutput:
    """u_draft [B, k], u_verify [B, k+1]: per-row uniforms drawn from each request's own generator."""
    k = u_draft.shape[1]
    device = rows.last.device
    b = rows.last.shape[0]
    n_before = target.length.clone()  # [B] = N-1

    # 1. propose
    t0 = time.perf_counter()
    if k > 0:
        draft_tokens, draft_probs, draft_logits = propose(draft, rows, k, vocab, u_draft)
    else:
        draft_tokens = torch.empty(b, 0, dtype=torch.long, device=device)
        draft_logits = torch.empty(b, 0, vocab, device=device)
        draft_probs = None if rows.all_greedy else draft_logits  # as propose() returns it
    _sync(device)
    t1 = time.perf_counter()

    # 2. verify: one target forward over [last, d_1..d_k]; positions past a row's own k are padding
    inp = torch.cat([rows.last[:, None], draft_tokens], 1)  # [B, k+1]
    inp_valid = torch.arange(k + 1, device=device)[None, :] <= rows.k[:, None]  # [B, k+1]
    target_logits = fit_vocab(target.forward(inp, inp_valid), vocab)  # [B, k+1, V]

    # 3. accept (pure functions in kernels/)
    tokens, num_accepted, target_probs = accept(target_logits, rows, draft_tokens, draft_probs, u_verify)
    _sync(device)
    t2 = time.perf_counter()

    # 4. roll back both caches to the accepted prefix: N-1 + 1 (last) + accepted
    keep = n_before + 1 + num_accepted
    target.truncate(keep)
    if k > 0:
        draft.truncate(keep)
    new_last = tokens.gather(1, num_accepted[:, None])[:, 0]  # [B] the corrected or bonus token
    # If a row accepted all its k_i drafts, the draft never saw d_{k_i} (proposed, not fed): pending too.
    all_in = (num_accepted == rows.k) & (rows.k > 0)  # [B]
    d_last = draft_tokens.gather(1, (rows.k - 1).clamp_min(0)[:, None])[:, 0] if k > 0 else new_last  # [B]
    rows.pending = torch.stack([torch.where(all_in, d_last, new_last), new_last], 1)
    rows.pending_n = torch.where(all_in, 2, 1)
    rows.last = new_last

    # 5. record
    return StepOutput(
        tokens, num_accepted, draft_tokens, target_probs, draft_probs, target_logits, draft_logits, t1 - t0, t2 - t1
    )
