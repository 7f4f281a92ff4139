"""Edge cases of the accept rule and of the processing of p and q that tests/test_verify.py and
tests/test_sampling.py leave open: float64 precision where the docstrings promise it, rows that must
not see each other (a seeded request's tokens may not depend on its batch), and a draft whose
vocabulary is narrower than the target's.

Each test here was checked to fail on a mutant the older tests let through (named in its docstring).
"""

import math

import pytest
import torch

from kernels.verify import inverse_cdf_sample, verify_reference
from kernels.verify_triton import verify_triton
from osd_serve.sampling import logits_to_probs
from osd_serve.spec import RowState, fit_vocab, row_probs
from tests.test_verify import IMPLS, loop_verify, needs_kernel, run


@pytest.mark.parametrize("impl", IMPLS)
def test_accept_test_keeps_float64_precision(impl):
    """u * q(x) < p(x) is compared in float64 (the kernel "bit-identical to the reference"). With
    p(x) / q(x) = 0.5 exactly, u = 0.5 - 2**-30 accepts; float32 rounds that u to 0.5, which rejects.
    Mutants that survived tests/test_verify.py: `uniforms.float()` in the reference's accept test, or
    `u.to(tl.float32)` in the kernel's."""
    v = 4
    p = torch.tensor([0.0, 0.25, 0.75, 0.0])  # [V]
    q = torch.tensor([0.0, 0.5, 0.5, 0.0])  # [V] p(1) / q(1) = 0.5
    target = torch.stack([p, p])[None].repeat(3, 1, 1)  # [3, k+1, V]
    draft = q[None, None].repeat(3, 1, 1)  # [3, k, V]
    tokens = torch.ones(3, 1, dtype=torch.long)  # [3, k] token 1 drafted
    u = torch.tensor([[0.5 - 2.0**-30, 0.5], [0.5, 0.5], [0.5 + 2.0**-30, 0.5]], dtype=torch.float64)  # [3, k+1]
    assert float(torch.tensor(0.5 - 2.0**-30, dtype=torch.float32)) == 0.5  # what float32 would compare
    _, acc = run(impl, target, draft, tokens, torch.ones(3, dtype=torch.long), u)
    assert acc.tolist() == [1, 0, 0]


@needs_kernel
def test_kernel_carries_the_cdf_across_blocks_in_float64():
    """The kernel walks V in blocks of 2048 and carries the running sum between them; the reference
    takes one float64 cumsum. Block 0 here sums to 1 + 2047 * 2**-26, which float32 cannot hold (its
    nearest values are 2**-26 away or more), so a carry kept in float32 moves every boundary of the
    next block by >= 2**-26. Targets 2**-27 either side of the first boundary in block 1 must land on
    the reference's side. Mutant that survived tests/test_verify.py: the carry as a float32 block sum."""
    v = 2050  # blocks [0, 2048) and [2048, 2050)
    p = torch.full((v,), 2.0**-26)  # [V] every entry exact in float32
    p[0], p[2048], p[2049] = 1.0, 2.0**-20, 0.5
    cdf = p.double().cumsum(0)  # [V] exact: every partial sum fits float64's 53 bits
    total = float(cdf[-1])
    targets = [float(cdf[2048]) - 2.0**-27, float(cdf[2048]) + 2.0**-27]
    u = torch.tensor([[t / total] for t in targets], dtype=torch.float64)  # [2, 1] k = 0: plain decoding
    target = p[None, None].repeat(2, 1, 1)  # [2, 1, V] (unnormalised: the sampler divides by the total)
    no_draft = (torch.zeros(2, 0, v), torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    ref_out, _ = verify_reference(target, *no_draft, u)
    assert ref_out[:, 0].tolist() == [2048, 2049]  # first index whose cumulative mass exceeds u * total
    out, _ = run(verify_triton, target, *no_draft, u)
    assert out.tolist() == ref_out.tolist()


def _edge_rows():
    """Six rows (k = 2, V = 4), each an edge of the rule, as (p [k+1, V], q [k, V], tokens [k], k_i, u [k+1])."""
    uniform = torch.full((4,), 0.25)
    pq = torch.tensor([0.1, 0.2, 0.3, 0.4])
    qh = torch.tensor([0.0, 0.2, 0.0, 0.8])
    return [
        # p <= q everywhere (normalised differently): a rejection leaves no residual, so p[0] is sampled
        (torch.stack([qh * 0.5, uniform, uniform]), torch.stack([qh, uniform]), [3, 0], 2, [0.9, 0.5, 0.1]),
        # an ordinary rejection at position 1, the residual max(0, p - q) sampled
        (torch.stack([pq, pq.flip(0), pq]), torch.stack([pq, pq]), [2, 3], 2, [0.3, 0.99, 0.6]),
        # plain decoding (k_i = 0) with u = 1.0 standing in for u * total rounding up to the total:
        # the last token with mass (2), never the zero-mass token after it
        (torch.stack([torch.tensor([0.0, 0.7, 0.3, 0.0]), uniform, uniform]), torch.stack([uniform, uniform]), [-1, -1], 0, [0.5, 0.5, 1.0]),
        # p == q: every draft accepted, even at the largest float64 uniform below 1; then the bonus
        (torch.stack([pq, pq, uniform]), torch.stack([pq, pq]), [3, 1], 2, [1 - 2.0**-53, 1 - 2.0**-53, 0.6]),
        # a drafted token q gives no mass (padding-like) is rejected however much p gives it
        (torch.stack([pq, pq, pq]), torch.stack([torch.tensor([0.5, 0.5, 0.0, 0.0]), pq]), [3, 0], 2, [0.0, 0.5, 0.95]),
        # k_i = 1 < k: the bonus comes from p[1], the padded column 2 is never read
        (torch.stack([pq, torch.tensor([0.0, 0.0, 1.0, 0.0]), uniform]), torch.stack([pq, uniform]), [3, -1], 1, [0.1, 0.5, 0.3]),
    ]


@pytest.mark.parametrize("impl", IMPLS)
def test_each_row_is_verified_as_if_alone(impl):
    """A row's tokens depend on its own p, q, drafts and uniforms only, never on its batch (the engine
    promises a seeded request the same output in any batch). The edge rows above together, in both
    orders, equal each row alone and the row-by-row loop. Mutant that survived tests/test_verify.py:
    the reference's residual-mass check summed over the whole batch (`residual.sum() > 0`), which gave
    the first row, whose residual is empty, token 0 from an all-zero distribution."""
    rows = _edge_rows()
    p = torch.stack([r[0] for r in rows])  # [B, k+1, V]
    q = torch.stack([r[1] for r in rows])  # [B, k, V]
    tokens = torch.tensor([r[2] for r in rows])  # [B, k]
    num_draft = torch.tensor([r[3] for r in rows])  # [B]
    u = torch.tensor([r[4] for r in rows], dtype=torch.float64)  # [B, k+1]
    want_out, want_acc = loop_verify(p, q, tokens, num_draft, u)
    assert want_out.tolist() == [[1, -1, -1], [2, 0, -1], [2, -1, -1], [3, 1, 2], [3, -1, -1], [3, 2, -1]]
    assert want_acc.tolist() == [0, 1, 0, 2, 0, 1]
    for order in (torch.arange(len(rows)), torch.arange(len(rows)).flip(0)):
        out, acc = run(impl, p[order], q[order], tokens[order], num_draft[order], u[order])
        assert torch.equal(out, want_out[order]) and torch.equal(acc, want_acc[order])
    for i in range(len(rows)):
        out, acc = run(impl, p[i : i + 1], q[i : i + 1], tokens[i : i + 1], num_draft[i : i + 1], u[i : i + 1])
        assert torch.equal(out[0], want_out[i]) and acc.item() == want_acc[i]


def test_logits_to_probs_rows_do_not_see_each_other():
    """Each row's p (and q) is processed from its own logits and params alone, whatever shares its batch:
    an overflowed +inf logit, a NaN row (a broken forward), a greedy row, -inf padding of a narrower draft,
    a tiny temperature, top-k past V, a tiny top-p. Mutant that survived tests/test_sampling.py: the +inf
    rule applied when any row of the batch has +inf (`pos_inf.any()`), which turned every other row
    into -inf, then NaN."""
    gen = torch.Generator().manual_seed(0)
    v = 50
    logits = torch.randn(8, v, generator=gen) * 3  # [N, V]
    logits[0, 7] = math.inf
    logits[1, 3] = math.nan
    logits[3, 40:] = -math.inf
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3, 1e-6, 1.0, 2.0, 0.9])  # [N]
    top_k = torch.tensor([0, 0, 5, 3, 0, v + 10, 1, 0])  # [N]
    top_p = torch.tensor([1.0, 1.0, 0.3, 0.9, 1.0, 0.8, 1.0, 1e-6])  # [N]
    batch = logits_to_probs(logits, temperature, top_k, top_p)  # [N, V]
    for i in range(len(logits)):
        alone = logits_to_probs(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])[0]
        assert torch.equal(batch[i], alone) or (i == 1 and batch[i].isnan().all() and alone.isnan().all()), i
    finite = [i for i in range(len(logits)) if i != 1]
    assert torch.allclose(batch[finite].sum(-1), torch.ones(len(finite)))
    assert batch[0, 7] == 1.0 and (batch[3, 40:] == 0).all()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (5.0, 0, 1.0), (1.0, 30, 0.99)])
def test_a_narrower_draft_never_proposes_ids_it_lacks(temperature, top_k, top_p):
    """A draft whose embedding is narrower than the target's (Qwen2.5-0.5B 151936 rows, 7B 152064) is
    padded to the target's V with -inf: its q gives the missing ids no mass, so neither greedy nor
    sampled proposals reach them, even where every real logit is negative or the temperature is high.
    Mutant that survived the tests: padding with 0.0, a logit above every real one here."""
    gen = torch.Generator().manual_seed(1)
    b, narrow, vocab = 3, 40, 48
    raw = -5.0 - torch.rand(b, 2, narrow, generator=gen)  # [B, T, V'] every logit negative
    logits = fit_vocab(raw, vocab)  # [B, T, V]
    assert logits.shape == (b, 2, vocab) and torch.equal(logits[..., :narrow], raw)
    rows = RowState(
        last=torch.zeros(b, dtype=torch.long), pending=torch.zeros(b, 2, dtype=torch.long),
        pending_n=torch.ones(b, dtype=torch.long), k=torch.full((b,), 2),
        temperature=torch.full((b,), temperature), top_k=torch.full((b,), top_k), top_p=torch.full((b,), top_p),
    )
    q = row_probs(logits, rows)  # [B, T, V]
    assert (q[..., narrow:] == 0).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(b, 2))
    flat = q.reshape(-1, vocab)  # [B*T, V]
    u = torch.linspace(0, 1 - 2.0**-40, 101, dtype=torch.float64)  # [U] up to just below 1
    picks = torch.stack([inverse_cdf_sample(flat, torch.full((len(flat),), float(x), dtype=torch.float64)) for x in u])
    assert int(picks.max()) < narrow
    # and a draft wider than the target is cut to the target's ids
    assert torch.equal(fit_vocab(raw, narrow - 8), raw[..., : narrow - 8])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("impl", IMPLS)
def test_the_reference_and_the_kernel_verify_in_float32_whatever_the_dtype(impl, dtype):
    """The Triton wrapper casts p and q to float32; the reference kept float16's rounding in the residual
    (p - q) and so, for one uniform, sampled another token than the kernel from the same inputs."""
    p = torch.tensor([0.4, 0.4, 0.2])  # [V]
    q = torch.tensor([0.0003, 0.0001, 0.9996])  # [V]
    target, draft = torch.stack([p, p])[None].to(dtype), q[None, None].to(dtype)  # [1, 2, V], [1, 1, V]
    u = torch.tensor([[0.9, 0.49986114448455893]], dtype=torch.float64)  # between float16's and float32's boundaries
    args = torch.tensor([[2]]), torch.tensor([1]), u
    assert run(impl, target, draft, *args)[0].tolist() == run(impl, target.float(), draft.float(), *args)[0].tolist()


def test_a_rejection_samples_a_residual_of_tiny_but_positive_mass():
    """After a rejection the token comes from norm(max(0, p - q)) however little mass that has; only a
    residual with none falls back to p. A threshold (float32 sum > 1e-6) instead of exact > 0 passed
    every other test (found by mutation testing)."""
    p = torch.tensor([0.6, 0.4])  # [V]
    q = torch.tensor([0.6 + 4e-7, 0.4 - 4e-7])  # [V] q(0) > p(0): token 0 can be rejected
    assert (p - q).clamp(min=0).double().sum() > 0  # residual [0, ~4e-7]: only token 1 has mass
    target = p[None, None].repeat(1, 2, 1)  # [1, k+1, V], k = 1
    draft = q[None, None]  # [1, k, V]
    tokens, num_draft = torch.tensor([[0]]), torch.tensor([1])
    # u_0 * q(0) >= p(0): rejected. u_1 = 0.1 picks token 0 from p, but only token 1 from the residual.
    u = torch.tensor([[0.9999999, 0.1]], dtype=torch.float64)
    out, acc = verify_reference(target, draft, tokens, num_draft, u)
    assert acc.tolist() == [0] and out.tolist() == [[1, -1]]
