"""Triton kernels for the fused forward KL; math and torch reference in kernels/fused_kl.py.

One program per position (row). Both kernels stream the row's V in BLOCK_V blocks, keeping only
scalars between blocks (online max / sum-exp, as in flash attention's softmax), so no float32 row,
let alone a float32 [N, V], is ever written to memory. The backward recomputes exp(s - lse) from the
saved per-row lse instead of saving the softmax.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

BLOCK_V = 1024

if HAS_TRITON:

    @triton.jit
    def _kl_fwd_kernel(s_ptr, p_ptr, loss_ptr, lse_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s_row, p_row = s_ptr + row * V, p_ptr + row * V
        m = tl.full((), float("-inf"), tl.float32)  # running max of s
        z = tl.zeros((), tl.float32)  # running sum exp(s - m)
        ps = tl.zeros((), tl.float32)  # sum p * s
        plogp = tl.zeros((), tl.float32)  # sum p log p
        psum = tl.zeros((), tl.float32)  # sum p (1 unless a top-k record lost mass)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            s = tl.load(s_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            p = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, tl.max(s, 0))
            # While every logit so far is -inf, m_new is too and exp(-inf - -inf) would be NaN: nothing to rescale.
            alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            z = z * alpha + tl.sum(tl.where(ok & (s > float("-inf")), tl.exp(s - m_new), 0.0), 0)
            m = m_new
            ps += tl.sum(tl.where(p > 0, p * s, 0.0), 0)  # p = 0 (off the row, or a masked token): never 0 * -inf
            plogp += tl.sum(tl.where(p > 0, p * tl.log(tl.maximum(p, 1e-30)), 0.0), 0)
            psum += tl.sum(p, 0)
        lse = m + tl.log(z)
        tl.store(loss_ptr + row, plogp - ps + lse * psum)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _kl_bwd_kernel(s_ptr, p_ptr, lse_ptr, g_ptr, ds_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s_row, p_row, ds_row = s_ptr + row * V, p_ptr + row * V, ds_ptr + row * V
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        psum = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            psum += tl.sum(tl.load(p_row + cols, mask=cols < V, other=0.0).to(tl.float32), 0)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            s = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32)
            p = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
            ds = g * (tl.exp(s - lse) * psum - p)
            tl.store(ds_row + cols, ds.to(ds_ptr.dtype.element_ty), mask=ok)


def kl_rows_fwd(s: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(p || softmax(s)) and lse, float32 [N] each. s, p [N, V] contiguous."""
    n, v = s.shape
    loss = torch.empty(n, dtype=torch.float32, device=s.device)
    lse = torch.empty(n, dtype=torch.float32, device=s.device)
    if n:
        _kl_fwd_kernel[(n,)](s, p, loss, lse, v, BLOCK=min(BLOCK_V, triton.next_power_of_2(v)))
    return loss, lse


def kl_rows_bwd(s, p, lse, g) -> torch.Tensor:
    """dL/ds [N, V] in s's dtype, for per-row weights g [N] (float32)."""
    n, v = s.shape
    ds = torch.empty_like(s)
    if n:
        _kl_bwd_kernel[(n,)](s, p, lse, g.float().contiguous(), ds, v, BLOCK=min(BLOCK_V, triton.next_power_of_2(v)))
    return ds
