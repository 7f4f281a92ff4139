"""Forward KL(p_teacher || q_student) for distillation, chunked over positions; Triton kernel in
kernels/fused_kl_triton.py.

Why chunked: the loss needs log_softmax over the whole vocabulary at every kept position. With a
real vocabulary (32k-150k) and thousands of positions per update, one float32 [N, V] copy of the
logits (plus its softmax, plus autograd's saved copies) is gigabytes. Here only one chunk of rows
is ever upcast to float32; autograd saves the low-precision logits and one log-sum-exp per row,
and the backward recomputes softmax chunk by chunk:

    loss_n   = sum_x p(x) log p(x) - sum_x p(x) s(x) + lse_n * sum_x p(x)        (s: student logits)
    dL/ds_n  = g_n * (exp(s_n - lse_n) * sum_x p(x) - p_n)      (= g_n (q_n - p_n) when p sums to 1)

with g_n = mask_n / (number of unmasked positions): token-count normalisation, as in losses.py.
"""

from __future__ import annotations

import torch


def forward_kl_reference(student_logits, teacher_probs, mask=None) -> torch.Tensor:
    """Plain autograd: mean over unmasked positions of KL(p || softmax(s)). [N, V], [N, V], [N]."""
    s = student_logits.float()
    p = teacher_probs.float()
    log_q = torch.log_softmax(s, -1)
    plogp = torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p))
    per_row = (plogp - torch.where(p > 0, p * log_q, 0.0)).sum(-1)  # [N]; p = 0 adds nothing, even where q = 0
    m = torch.ones_like(per_row) if mask is None else mask.float()
    return (per_row * m).sum() / m.sum().clamp_min(1.0)


def _rows_fwd_torch(s: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: per-row KL and lse, in float32. s, p [n, V] -> [n], [n]."""
    s, p = s.float(), p.float()
    lse = torch.logsumexp(s, -1)
    plogp = torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p)).sum(-1)
    # p = 0 where s = -inf (a masked vocabulary) adds nothing: never 0 * -inf = NaN
    return plogp - torch.where(p > 0, p * s, 0.0).sum(-1) + lse * p.sum(-1), lse


def _rows_bwd_torch(s, p, lse, g) -> torch.Tensor:
    """One chunk of dL/ds: g [n] * (exp(s - lse) * sum p - p), returned in s's dtype. [n, V]"""
    p32 = p.float()
    grad = torch.exp(s.float() - lse[:, None]) * p32.sum(-1, keepdim=True) - p32
    return (grad * g[:, None]).to(s.dtype)


class _ChunkedForwardKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, p, weights, chunk_size: int, use_triton: bool):
        n = s.shape[0]
        per_row = torch.empty(n, dtype=torch.float32, device=s.device)
        lse = torch.empty(n, dtype=torch.float32, device=s.device)
        if use_triton:
            from kernels.fused_kl_triton import kl_rows_fwd

            per_row, lse = kl_rows_fwd(s, p)
        else:
            for i in range(0, n, chunk_size):
                per_row[i : i + chunk_size], lse[i : i + chunk_size] = _rows_fwd_torch(s[i : i + chunk_size], p[i : i + chunk_size])
        ctx.save_for_backward(s, p, lse, weights)
        ctx.chunk_size, ctx.use_triton = chunk_size, use_triton
        return (per_row * weights).sum()

    @staticmethod
    def backward(ctx, grad_out):
        s, p, lse, weights = ctx.saved_tensors
        g = weights * grad_out  # [N]
        if ctx.use_triton:
            from kernels.fused_kl_triton import kl_rows_bwd

            return kl_rows_bwd(s, p, lse, g), None, None, None, None
        grad = torch.empty_like(s)
        c = ctx.chunk_size
        for i in range(0, s.shape[0], c):
            grad[i : i + c] = _rows_bwd_torch(s[i : i + c], p[i : i + c], lse[i : i + c], g[i : i + c])
        return grad, None, None, None, None


def chunked_forward_kl(student_logits, teacher_probs, mask=None, chunk_size: int = 1024, use_triton: bool | None = None):
    """Same value and gradient as forward_kl_reference, without a float32 [N, V] for all N.

    student_logits [N, V] (any float dtype; the gradient comes back in it), teacher_probs [N, V]
    (float16/32), mask [N] bool. use_triton: None picks the Triton kernel on CUDA.
    """
    if student_logits.shape != teacher_probs.shape:
        raise ValueError(f"shapes differ: student {tuple(student_logits.shape)}, teacher {tuple(teacher_probs.shape)}")
    if student_logits.dim() != 2:  # [B, T, V] failed deep in a chunk with a broadcasting error
        raise ValueError(f"logits must be [N, V] (flatten the positions first), got {tuple(student_logits.shape)}")
    # A [1] or [N, 1] mask broadcast: the loss came out as the sum over all rows, not their mean
    # (losses._check refuses it for the plain losses)
    if mask is not None and mask.shape != student_logits.shape[:1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the positions {tuple(student_logits.shape[:1])}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if use_triton is None:
        from kernels.fused_kl_triton import HAS_TRITON

        use_triton = HAS_TRITON and student_logits.is_cuda
    n = student_logits.shape[0]
    m = torch.ones(n, device=student_logits.device) if mask is None else mask.float()
    weights = m / m.sum().clamp_min(1.0)  # [N] token-count normalisation
    return _ChunkedForwardKL.apply(student_logits.contiguous(), teacher_probs.contiguous(), weights, chunk_size, use_triton)
