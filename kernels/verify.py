"""Torch reference of the speculative verification step (Leviathan et al. 2023, Chen et al. 2023).

For each row, with draft tokens x_0..x_{k_i-1} proposed from q_j and target distributions p_j:

    accept x_j  iff  u_j * q_j(x_j) < p_j(x_j)  and  q_j(x_j) > 0      (u_j < min(1, p/q), no divide)
    a = number of leading accepts (stop at the first rejection)
    final token ~ p_a                          if a == k_i   (bonus: every draft accepted)
                ~ norm(max(0, p_a - q_a))      otherwise     (residual; p_a if it has no mass)

Emitted tokens x_0..x_{a-1}, final are distributed exactly as a_i+1 autoregressive samples from p.
The comparison is strict: u is drawn from [0, 1) and can be exactly 0, and `0 * q <= 0` would
accept a token the target gives no mass (for greedy rows: a token that is not the target argmax).
The final sample is an inverse CDF with uniforms[:, k]; its cumulative sums are accumulated in
float64 so that this reference and the Triton kernel (which sums in a different order) pick the
same token for the same uniform except with negligible probability.
"""

from __future__ import annotations

import torch


def inverse_cdf_sample(
    dist: torch.Tensor,  # [B, V] float, non-negative, unnormalised
    uniforms: torch.Tensor,  # [B] float64 in [0, 1) (float32 ones sit on a 2**-24 grid)
) -> torch.Tensor:  # [B] int64
    """First index whose cumulative mass exceeds u * total, clamped to the last nonzero token."""
    v = dist.shape[-1]
    cdf = dist.double().cumsum(dim=-1)  # [B, V] float64: summation order must not matter
    target = uniforms.double() * cdf[:, -1]  # [B]
    idx = (cdf <= target.unsqueeze(1)).sum(dim=-1)  # [B] cdf is non-decreasing
    positions = torch.arange(v, device=dist.device)  # [V]
    last_nonzero = torch.where(dist > 0, positions, 0).amax(dim=-1)  # [B]
    return torch.minimum(idx, last_nonzero)  # [B]


def verify_reference(
    target_probs: torch.Tensor,  # [B, k+1, V] float32 p at each verified position
    draft_probs: torch.Tensor,  # [B, k, V] float32 q at each drafted position
    draft_tokens: torch.Tensor,  # [B, k] int64 proposed tokens
    num_draft: torch.Tensor,  # [B] int64 per-row k_i <= k
    uniforms: torch.Tensor,  # [B, k+1] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:  # out_tokens [B, k+1] int64 (-1 pad), num_accepted [B] int64
    """Accept a prefix of the draft tokens and sample one corrected-or-bonus token per row."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    # float32, as the Triton wrapper casts: a float16 residual (or float64 p, q) could pick another token
    target_probs, draft_probs = target_probs.float(), draft_probs.float()
    rows = torch.arange(b, device=device)  # [B]
    positions = torch.arange(k1, device=device)  # [k+1]

    num_draft = num_draft.clamp(max=k)  # [B] k_i <= k by contract; keeps the kernel's bounds
    drafted = positions[:k].unsqueeze(0) < num_draft.unsqueeze(1)  # [B, k] positions >= k_i ignored
    # p_j(x_j), q_j(x_j) at the proposed tokens; ignored positions may hold padding such as -1.
    tok = torch.where(drafted, draft_tokens, 0).unsqueeze(-1)  # [B, k, 1]
    p_x = target_probs[:, :k].gather(2, tok).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(2, tok).squeeze(-1)  # [B, k]
    accept = (uniforms[:, :k].double() * q_x < p_x) & (q_x > 0) & drafted  # [B, k] compared in float64, as the kernel
    # Leading run of accepts: cumprod zeroes everything after the first rejection.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]

    p_a = target_probs[rows, num_accepted]  # [B, V]
    is_bonus = num_accepted == num_draft  # [B]
    if k > 0:
        # Bonus rows have no q_a; the clamp only keeps the gather in range, is_bonus discards it.
        q_a = draft_probs[rows, num_accepted.clamp(max=k - 1)]  # [B, V]
        residual = (p_a - q_a).clamp(min=0)  # [B, V]
        # A rejection implies q(x) > p(x), so the residual has mass unless p and q are not
        # normalised alike; then p_a is the only distribution left to honour.
        has_mass = residual.double().sum(dim=-1) > 0  # [B]
        use_p = is_bonus | ~has_mass  # [B]
        dist = torch.where(use_p.unsqueeze(1), p_a, residual)  # [B, V]
    else:
        dist = p_a  # [B, V]
    final = inverse_cdf_sample(dist, uniforms[:, k])  # [B]

    return emitted_tokens(draft_tokens, num_accepted, final), num_accepted


def verify_greedy(
    target_tokens: torch.Tensor,  # [B, k+1] int64 the target's argmax at each verified position
    draft_tokens: torch.Tensor,  # [B, k] int64 proposed tokens
    num_draft: torch.Tensor,  # [B] int64 per-row k_i <= k
) -> tuple[torch.Tensor, torch.Tensor]:  # out_tokens [B, k+1] int64 (-1 pad), num_accepted [B] int64
    """verify_reference for a batch where target and draft are both greedy (temperature 0), without
    the [B, k+1, V] one-hot p and q it would need. With one-hot p and q the rule above reduces to:
    accept x_j iff x_j is the target's argmax (q(x_j) = 1, so u*q < p needs p(x_j) = 1), and both
    the residual after a rejection and the bonus are one-hot at the target's argmax at position a.
    So the result is the same tokens for any uniforms (tests/test_verify.py checks it against the
    reference), at the cost of a comparison instead of gathers and a float64 cumsum over V per row."""
    k = draft_tokens.shape[1]
    positions = torch.arange(k, device=target_tokens.device)  # [k]
    drafted = positions.unsqueeze(0) < num_draft.clamp(max=k).unsqueeze(1)  # [B, k]
    accept = (draft_tokens == target_tokens[:, :k]) & drafted  # [B, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] leading run of accepts
    final = target_tokens.gather(1, num_accepted.unsqueeze(1))[:, 0]  # [B] the correction, or the bonus when a == k_i
    return emitted_tokens(draft_tokens, num_accepted, final), num_accepted


def emitted_tokens(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """Each row's output [B, k+1]: its a accepted drafts, then the final token, then -1 padding.
    draft_tokens [B, k], num_accepted [B] (= a), final [B]."""
    b, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device)  # [k+1]
    drafts = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), -1)], dim=1)  # [B, k+1]
    n = num_accepted.unsqueeze(1)  # [B, 1]
    out_tokens = torch.where(positions < n, drafts, -1)  # [B, k+1]
    return torch.where(positions == n, final.unsqueeze(1), out_tokens)  # [B, k+1]
