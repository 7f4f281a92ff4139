"""Triton kernel for the speculative verification step; torch reference: kernels/verify.py.

Math (one program per batch row b, k_i = num_draft[b]):

    accept_j = (u_j * q_j(x_j) < p_j(x_j)) and (q_j(x_j) > 0)       for j < k_i
    a        = length of the leading run of accepts
    dist     = p_a                          if a == k_i or sum(max(0, p_a - q_a)) == 0
             = max(0, p_a - q_a)            otherwise
    final    = min(#{i : C_i <= u_k * C_{V-1}}, last i with dist_i > 0),   C = cumsum(dist)
    out      = [x_0 .. x_{a-1}, final, -1 ...]

The accept test is elementwise, u * q < p on float32 probabilities compared in float64 (u is
float64), bit-identical to the reference. The cumulative sums are float64: the kernel sums V in
blocks (tl.cumsum plus a running carry), the reference in one torch.cumsum, and float64 makes the
two orders agree on the chosen token except when u * total lands within ~1e-16 of a boundary.

Two passes over V: the first finds the residual's mass (to choose dist) and the total, the second
locates the inverse-CDF index. k is small (<= ~10), so the draft positions are a scalar loop.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: kernels/ must still import, the dispatcher uses torch.
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _verify_kernel(
        target_ptr,  # [B, K+1, V] float32
        draft_ptr,  # [B, K, V] float32
        tokens_ptr,  # [B, K] int64
        num_draft_ptr,  # [B] int64
        uniforms_ptr,  # [B, K+1] float64: float32 would put the final sample on a 2**-24 grid near u = 1
        out_ptr,  # [B, K+1] int64
        num_accepted_ptr,  # [B] int64
        K,
        V,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,  # next power of two >= K+1
    ):
        b = tl.program_id(0).to(tl.int64)  # int64: b * (K+1) * V overflows int32 at large B*V
        target_row = target_ptr + b * (K + 1) * V
        draft_row = draft_ptr + b * K * V
        kd = tl.minimum(tl.load(num_draft_ptr + b), K)  # k_i <= k by contract; never read past row

        # Leading run of accepts; no early exit (k is tiny), `run` drops to 0 at the first reject.
        run = tl.full((), 1, tl.int32)
        a = tl.zeros((), dtype=tl.int32)
        for j in range(0, kd):
            x = tl.load(tokens_ptr + b * K + j)
            p_x = tl.load(target_row + j * V + x)
            q_x = tl.load(draft_row + j * V + x)
            u = tl.load(uniforms_ptr + b * (K + 1) + j)
            ok = ((u * q_x.to(tl.float64) < p_x.to(tl.float64)) & (q_x > 0)).to(tl.int32)
            run = run * ok
            a += run

        is_bonus = a == kd
        p_a = target_row + a * V
        q_a = draft_row + a * V  # only dereferenced when a < kd <= K
        # Scalar conditions go into the load bound rather than `mask & cond`: TRITON_INTERPRET
        # turns (block int1) & (scalar int1) into int32, which tl.load rejects as a mask.
        q_len = tl.where(a < kd, V, 0)

        # Pass 1: masses of p_a and of the residual.
        p_mass = tl.zeros((BLOCK_V,), dtype=tl.float64)
        r_mass = tl.zeros((BLOCK_V,), dtype=tl.float64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            p = tl.load(p_a + offs, mask=m, other=0.0)
            q = tl.load(q_a + offs, mask=offs < q_len, other=0.0)
            p_mass += p.to(tl.float64)
            r_mass += tl.maximum(p - q, 0.0).to(tl.float64)
        r_total = tl.sum(r_mass, axis=0)
        use_p = is_bonus | (r_total <= 0)
        total = tl.where(use_p, tl.sum(p_mass, axis=0), r_total)
        q_len = tl.where(use_p, 0, q_len)
        target = tl.load(uniforms_ptr + b * (K + 1) + K).to(tl.float64) * total

        # Pass 2: count cdf entries <= target (cdf is non-decreasing, so this is the first index
        # above target) and track the last nonzero token for the clamp.
        carry = tl.zeros((), dtype=tl.float64)
        count = tl.zeros((), dtype=tl.int64)
        last_nz = tl.zeros((), dtype=tl.int64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            p = tl.load(p_a + offs, mask=m, other=0.0)
            q = tl.load(q_a + offs, mask=offs < q_len, other=0.0)
            d = tl.where(use_p, p, tl.maximum(p - q, 0.0))
            cdf = carry + tl.cumsum(d.to(tl.float64), axis=0)
            count += tl.sum(((cdf <= target) & m).to(tl.int64), axis=0)
            last_nz = tl.maximum(last_nz, tl.max(tl.where((d > 0) & m, offs, 0).to(tl.int64), axis=0))
            carry = tl.max(tl.where(m, cdf, 0.0), axis=0)  # cdf's last valid entry
        final = tl.minimum(count, last_nz)

        # One vector store for the whole row: accepted drafts, final token, -1 padding.
        offs_k = tl.arange(0, BLOCK_K)
        drafts = tl.load(tokens_ptr + b * K + offs_k, mask=offs_k < a, other=-1)
        out = tl.where(offs_k == a, final, drafts)
        tl.store(out_ptr + b * (K + 1) + offs_k, out, mask=offs_k < K + 1)
        tl.store(num_accepted_ptr + b, a.to(tl.int64))


def verify_triton(
    target_probs: torch.Tensor,  # [B, k+1, V] float32 p at each verified position
    draft_probs: torch.Tensor,  # [B, k, V] float32 q at each drafted position
    draft_tokens: torch.Tensor,  # [B, k] int64 proposed tokens
    num_draft: torch.Tensor,  # [B] int64 per-row k_i <= k
    uniforms: torch.Tensor,  # [B, k+1] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:  # out_tokens [B, k+1] int64 (-1 pad), num_accepted [B] int64
    """Same contract and results as kernels.verify.verify_reference, one program per row."""
    if not HAS_TRITON:
        raise ImportError("verify_triton needs triton (pip install 'osd-serve[gpu]'); "
                          "use kernels.verify.verify_reference on CPU")
    b, k1, v = target_probs.shape
    k = k1 - 1
    out_tokens = torch.empty((b, k1), dtype=torch.int64, device=target_probs.device)  # [B, k+1]
    num_accepted = torch.empty((b,), dtype=torch.int64, device=target_probs.device)  # [B]
    if b == 0:
        return out_tokens, num_accepted
    _verify_kernel[(b,)](
        target_probs.float().contiguous(),
        draft_probs.float().contiguous(),
        draft_tokens.long().contiguous(),
        num_draft.long().contiguous(),
        uniforms.double().contiguous(),
        out_tokens,
        num_accepted,
        k,
        v,
        BLOCK_V=min(triton.next_power_of_2(v), 2048),
        BLOCK_K=triton.next_power_of_2(k1),
    )
    return out_tokens, num_accepted
