"""Distillation losses between the target (teacher) p and the draft (student) q, as pure functions.

All take logits (or log-probs) ``[N, V]`` and an optional mask ``[N]`` and return the mean over the
unmasked positions (token-count normalisation, as in trl's GKD loss), so a batch with more corrected
positions does not weigh more than one with fewer.

    forward KL   KL(p || q) = sum_x p log(p/q)          mode-covering; the paper's online choice
    reverse KL   KL(q || p) = sum_x q log(q/p)          mode-seeking
    JSD(beta)    beta KL(p || m) + (1-beta) KL(q || m),  m = beta p + (1-beta) q
                 both terms vanish at beta=0 and beta=1, so (as GKD and trl do) beta=0 means forward KL
                 and beta=1 reverse KL
    TVD          1/2 sum_x |p - q|;  acceptance alpha = 1 - TVD(p, q) exactly, so minimising TVD
                 maximises the expected acceptance directly.

The mixture is formed in log space with logsumexp, never by exponentiating and adding, so tiny
probabilities do not underflow.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _check(student_logits, teacher_logits, mask, temperature: float = 1.0) -> None:
    """Inputs that broadcast gave a number, not an error: a [1, V] student or a [N, 1] side (a
    negative "KL"), or a [1] mask that masked all rows or none. The fused path refuses them too
    (kernels.fused_kl). A temperature of 0 or NaN gave NaN, a negative one the reversed distributions."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"shapes differ: student {tuple(student_logits.shape)}, teacher {tuple(teacher_logits.shape)}")
    if mask is not None and mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the positions {tuple(student_logits.shape[:-1])}")
    if not 0.0 < temperature < math.inf:
        raise ValueError(f"temperature must be positive and finite, got {temperature}")


def _reduce(per_pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over unmasked positions. per_pos [N], mask [N] bool or None."""
    if mask is None:  # no positions: 0, as when all are masked (mean() of nothing is NaN)
        return per_pos.mean() if per_pos.numel() else per_pos.sum()
    m = mask.to(per_pos.dtype)
    return (per_pos * m).sum() / m.sum().clamp_min(1.0)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probs. [N, V] -> [N]

    Ids where a has no mass add 0 (0 log 0 = 0): a masked vocabulary (-inf logits) would otherwise
    give exp(-inf) * (-inf - x) = NaN, as F.kl_div does. Their inputs are replaced before the
    arithmetic, not after, so the gradient there is 0 rather than NaN."""
    has_mass = log_a != -math.inf  # [N, V] a NaN stays NaN: a broken distribution must not pass for a masked id
    la, lb = torch.where(has_mass, log_a, 0.0), torch.where(has_mass, log_b, 0.0)  # [N, V]
    return torch.where(has_mass, la.exp() * (la - lb), 0.0).sum(-1)


def forward_kl(student_logits, teacher_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_teacher || q_student). logits [N, V]."""
    _check(student_logits, teacher_logits, mask, temperature)
    log_q = F.log_softmax(student_logits.float() / temperature, -1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, -1)
    return _reduce(_kl(log_p, log_q), mask)


def reverse_kl(student_logits, teacher_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """KL(q_student || p_teacher). logits [N, V]."""
    _check(student_logits, teacher_logits, mask, temperature)
    log_q = F.log_softmax(student_logits.float() / temperature, -1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, -1)
    return _reduce(_kl(log_q, log_p), mask)


def generalized_jsd(student_logits, teacher_logits, beta: float = 0.5, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """beta KL(p || m) + (1-beta) KL(q || m) with m = beta p + (1-beta) q. logits [N, V].

    beta=0 and beta=1 are special-cased to forward and reverse KL respectively: the weights vanish at
    the ends, and these are the conventions of GKD (Agarwal et al. 2023) and trl.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    _check(student_logits, teacher_logits, mask, temperature)
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, mask, temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, mask, temperature)
    log_q = F.log_softmax(student_logits.float() / temperature, -1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, -1)
    # Ids neither p nor q can produce (-inf in both) are kept out of logsumexp, whose gradient at an
    # all -inf input is NaN; m has no mass there, and _kl adds nothing for them.
    either = (log_p != -math.inf) | (log_q != -math.inf)  # [N, V]
    parts = torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)])  # [2, N, V]
    log_m = torch.where(either, torch.logsumexp(torch.where(either, parts, 0.0), dim=0), -math.inf)  # [N, V]
    per_pos = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    return _reduce(per_pos, mask)


def total_variation(student_logits, teacher_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """1/2 sum |p - q| in [0, 1]; 1 - TVD is the expected acceptance of one draft token. logits [N, V]."""
    _check(student_logits, teacher_logits, mask, temperature)
    q = F.softmax(student_logits.float() / temperature, -1)
    p = F.softmax(teacher_logits.float() / temperature, -1)
    return _reduce(0.5 * (p - q).abs().sum(-1), mask)


def expected_acceptance(student_logits, teacher_logits, mask=None) -> torch.Tensor:
    """alpha-hat = mean over positions of sum_x min(p(x), q(x)) = 1 - TVD. logits [N, V]."""
    return 1.0 - total_variation(student_logits, teacher_logits, mask)


LOSSES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": generalized_jsd, "tvd": total_variation}
