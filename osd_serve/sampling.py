"""Logits -> probabilities -> tokens, as pure functions of tensors.

The speculative loop calls `logits_to_probs` with the SAME per-request params on the target's and
the draft's logits, so p and q are processed identically and the rejection rule in
`kernels.verify` stays exact (it only needs p and q to be the distributions actually sampled from).

Greedy rows (temperature 0) come back as the one-hot of argmax. With one-hot p and q the
Leviathan rule `accept iff u * q(x) < p(x)` is exactly "draft argmax == target argmax", and the
residual norm(max(0, p - q)) is the one-hot of the target argmax, so one verifier handles both.
"""

from __future__ import annotations

import math

import torch


def apply_top_k_top_p(
    logits: torch.Tensor,  # [N, V] float32, already divided by temperature
    top_k: torch.Tensor,  # [N] int64, <= 0 or >= V disables
    top_p: torch.Tensor,  # [N] float, 1.0 disables
) -> torch.Tensor:  # [N, V] float32, dropped tokens set to -inf
    """Mask logits outside top-k, then outside the top-p nucleus; one sort for both.

    Top-k keeps every token tied with the k-th largest logit (a threshold, as in vLLM), so the
    result does not depend on how the sort breaks ties. Top-p keeps the smallest set of the
    largest tokens whose mass is >= top_p; the largest token is always kept.
    """
    n, v = logits.shape
    # Ascending, so the tokens to drop form a prefix of each row.
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [N, V], [N, V]

    k = torch.where((top_k <= 0) | (top_k >= v), v, top_k).clamp(min=1)  # [N]
    kth_largest = logits_sort.gather(1, (v - k).unsqueeze(1))  # [N, 1]
    logits_sort = logits_sort.masked_fill(logits_sort < kth_largest, float("-inf"))  # [N, V]

    probs_sort = logits_sort.softmax(dim=-1)  # [N, V]
    # cumsum[i] is the mass of tokens i and below; dropping them leaves mass 1 - cumsum[i] >= top_p.
    cum_low = probs_sort.cumsum(dim=-1)  # [N, V]
    drop = cum_low <= (1.0 - top_p.float()).unsqueeze(1)  # [N, V]
    drop[:, -1] = False  # at least one token survives any top_p
    logits_sort = logits_sort.masked_fill(drop, float("-inf"))  # [N, V]

    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)  # [N, V]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [..., V] any float dtype -> [...] int64
    """The argmax of each row, the first index on ties as ``torch.argmax`` and HF greedy decoding pick
    (torch.max documents the same rule). ``max(-1).indices`` because on CPU it costs a fraction of
    ``argmax`` on bfloat16 logits (e.g. 28 against 145 us for [1, 8, 4096]), once per draft token."""
    return logits.max(dim=-1).indices


def overflow_holds_all(logits: torch.Tensor) -> torch.Tensor:  # [..., V] float -> [..., V]
    """A logit that overflowed to +inf (float16 can) holds the row's whole mass, at any temperature: the
    limit of the softmax, and the token greedy picks. Such rows become 0 there and -inf elsewhere; shifted
    by the max (or less its logsumexp) they would be inf - inf, a NaN row that sampled token 0."""
    pos_inf = torch.isposinf(logits)
    return torch.where(pos_inf.any(dim=-1, keepdim=True), torch.where(pos_inf, 0.0, -math.inf), logits)


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] any float dtype
    temperature: torch.Tensor,  # [N] float, 0 means greedy
    top_k: torch.Tensor,  # [N] int64, <= 0 or >= V disables
    top_p: torch.Tensor,  # [N] float in (0, 1], 1.0 disables
) -> torch.Tensor:  # [N, V] float32
    """Per-row temperature, top-k, top-p, softmax; greedy rows become one-hot(argmax)."""
    logits = logits.float()  # [N, V] low-precision softmax would bias the accept test
    n, v = logits.shape
    greedy = temperature == 0  # [N]
    one_hot = torch.zeros_like(logits)  # [N, V]
    one_hot.scatter_(1, greedy_tokens(logits).unsqueeze(1), 1.0)  # argmax ties -> first index
    if bool(greedy.all()):  # the common serving case: skip the sort and softmax it would discard
        return one_hot
    logits = overflow_holds_all(logits)  # [N, V]
    # Greedy rows get temperature 1 only so the shared path below stays finite; they are replaced.
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [N]
    # The row max comes off first: a tiny temperature (1e-40 is a float32 subnormal) would make
    # logits / T overflow to inf and the softmax NaN; shifted logits are <= 0, so they only reach -inf.
    scaled = (logits - logits.amax(dim=1, keepdim=True)) / temp.unsqueeze(1)  # [N, V]
    probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)  # [N, V]
    return torch.where(greedy.unsqueeze(1), one_hot, probs)  # [N, V]


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator for an integer key (a request's seed; the disaggregated path adds stream and
    position). torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so seeds that
    differ above bit 31 (5 and 5 + 2**32) gave one stream: the key is mixed with splitmix64 and
    folded to 32 bits, and two keys then share a stream with probability 2**-32."""
    x = 0
    for part in key:
        x = _splitmix64(x ^ (part & _MASK64))
    return torch.Generator().manual_seed((x ^ (x >> 32)) & 0xFFFFFFFF)
