"""Gaps a mutation audit of kernels/ found: each test here failed against a mutant of the kernels that
tests/test_verify*.py, tests/test_fused_kl.py, tests/test_kernel_edges.py and tests/test_cpu_linear.py
let pass (the mutant is named in the docstring), and passes on the real code. Tiny shapes: the Triton
kernels run under TRITON_INTERPRET=1 without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import cpu_linear
from kernels import verify_triton as verify_triton_module
from kernels.cpu_linear import pack_linears
from kernels.fused_kl import chunked_forward_kl, forward_kl_reference
from kernels.fused_kl_triton import HAS_TRITON as KL_HAS_TRITON
from kernels.verify import verify_greedy, verify_reference
from kernels.verify_triton import verify_triton
from tests.test_verify import IMPLS, loop_verify, needs_kernel, random_inputs, run

# ---- speculative verification ------------------------------------------------------------------


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="without triton the reference is the only path")
def test_dispatcher_never_sends_cpu_tensors_to_the_kernel(monkeypatch):
    """kernels.verify takes the Triton kernel for CUDA tensors only: on a CPU install with triton (the
    dev extras) and no TRITON_INTERPRET, the kernel cannot run on CPU tensors at all. The existing test
    compares outputs only, which the interpreter makes identical. Mutant that survived:
    `if HAS_TRITON:` (dropping `and target_probs.is_cuda`)."""

    def refuse(*args):
        raise AssertionError("Triton kernel called for CPU tensors")

    monkeypatch.setattr(verify_triton_module, "verify_triton", refuse)
    args = random_inputs(4, 3, 20, "soft", seed=1)  # CPU tensors
    out, acc = kernels.verify(*args)
    ref_out, ref_acc = verify_reference(*args)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)


def test_greedy_ignores_draft_tokens_past_each_rows_k():
    """The engine's draft proposes k tokens for every row, also past a row's own k_i (spec.propose keeps
    generating with its inputs marked invalid), so the columns past k_i hold real token ids that may
    well equal the target's argmax. They must never be accepted: a request asking for k_i = 1 gets at
    most 1 accepted draft. tests/test_verify.py pads those columns with -1, which never matches.
    Mutant that survived: verify_greedy's accept without `& drafted`."""
    gen = torch.Generator().manual_seed(2)
    b, k, v = 6, 4, 9
    t_arg = torch.randint(0, v, (b, k + 1), generator=gen)  # [B, k+1] target argmax per position
    draft_tokens = t_arg[:, :k].clone()  # [B, k] every proposal agrees, including past k_i
    num_draft = torch.tensor([0, 1, 2, 3, 4, 1])  # [B]
    out, acc = verify_greedy(t_arg, draft_tokens, num_draft)
    assert acc.tolist() == num_draft.tolist()  # every drafted token accepted, none beyond k_i
    # ...and it is the reference's answer on the one-hot p and q the same drafts give
    p = torch.nn.functional.one_hot(t_arg, v).float()  # [B, k+1, V]
    q = torch.nn.functional.one_hot(draft_tokens, v).float()  # [B, k, V]
    u = torch.rand(b, k + 1, generator=gen, dtype=torch.float64)  # [B, k+1]
    ref_out, ref_acc = verify_reference(p, q, draft_tokens, num_draft, u)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    for i in range(b):  # the bonus comes from the target's argmax right after the last drafted token
        assert out[i, int(num_draft[i])] == t_arg[i, int(num_draft[i])]


@pytest.mark.parametrize("impl", IMPLS)
def test_num_draft_above_k_acts_as_k(impl):
    """Both implementations clamp k_i to k (the reference "keeps the kernel's bounds"): a row whose
    num_draft exceeds the drafted width verifies exactly as if it were k. Without the clamp the
    reference saw no bonus row (a == k != k_i) and sampled the final token from the residual
    max(0, p_k - q_{k-1}) instead of p_k; the kernel read tokens and probabilities past its row.
    Mutants that survived: the reference without `num_draft.clamp(max=k)`, the kernel without
    `tl.minimum(..., K)`."""
    v = 4
    one = torch.eye(v)  # [V, V] one-hot rows
    p = torch.stack([one[1], one[0], torch.tensor([0.5, 0.5, 0.0, 0.0])])  # [k+1, V] p_2 = half 0, half 1
    q = torch.stack([one[1], one[0]])  # [k, V] q == p at both drafts: accepted for any u < 1
    tokens = torch.tensor([1, 0])  # [k]
    # u_k = 0.1 falls in p_2's token 0; in the residual max(0, p_2 - q_1) = [0, 0.5, 0, 0] only token 1 has mass
    u = torch.tensor([0.5, 0.5, 0.1], dtype=torch.float64)  # [k+1]
    b = 3
    target, draft = p[None].repeat(b, 1, 1), q[None].repeat(b, 1, 1)  # [B, k+1, V], [B, k, V]
    toks, uu = tokens[None].repeat(b, 1), u[None].repeat(b, 1)  # [B, k], [B, k+1]
    want_out, want_acc = loop_verify(target, draft, toks, torch.full((b,), 2), uu)
    assert want_out.tolist() == [[1, 0, 0]] * b and want_acc.tolist() == [2] * b
    out, acc = run(impl, target, draft, toks, torch.tensor([2, 3, 7]), uu)  # [B] k_i = k, k + 1, k + 5
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)


@needs_kernel
def test_kernel_residual_total_is_summed_in_float64():
    """After a rejection the kernel samples max(0, p - q) by inverse CDF against u * (residual total);
    the reference takes that total from one float64 cumsum. Summed per lane in float32 across blocks,
    lane 1 here holds 2**-26 + 0.5, which float32 rounds to 0.5: the total drops by 2**-26 and targets
    2**-27 either side of a boundary in block 1 land on the wrong side. The float64 carry is covered by
    tests/test_verify_edges.py on the bonus path (p's total); this is the residual path. Mutant that
    survived: `r_mass` accumulated in float32."""
    v = 2051  # blocks [0, 2048) and [2048, 2051)
    p = torch.full((v,), 2.0**-26)  # [V] every entry exact in float32
    p[0], p[2048], p[2049], p[2050] = 1.0, 2.0**-20, 0.5, 0.0
    q = torch.zeros(v)  # [V]
    q[2050] = 1.0  # the draft proposes token 2050, which p gives no mass: always rejected
    residual = (p - q).clamp(min=0)  # [V] == p
    cdf = residual.double().cumsum(0)  # [V] exact: every partial sum fits float64's 53 bits
    total = float(cdf[-1])
    targets = [float(cdf[2048]) - 2.0**-27, float(cdf[2048]) + 2.0**-27]
    u = torch.tensor([[0.5, t / total] for t in targets], dtype=torch.float64)  # [2, k+1], k = 1
    target = torch.stack([p, p])[None].repeat(2, 1, 1)  # [2, k+1, V]
    draft = q[None, None].repeat(2, 1, 1)  # [2, k, V]
    tokens, num_draft = torch.full((2, 1), 2050), torch.ones(2, dtype=torch.long)  # [2, k], [2]
    ref_out, ref_acc = verify_reference(target, draft, tokens, num_draft, u)
    assert ref_acc.tolist() == [0, 0] and ref_out[:, 0].tolist() == [2048, 2049]
    out, acc = run(verify_triton, target, draft, tokens, num_draft, u)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)


# ---- fused KL ------------------------------------------------------------------------------------

KL_BACKENDS = [False] + ([True] if KL_HAS_TRITON else [])
KL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("use_triton", KL_BACKENDS, ids=lambda t: "triton" if t else "torch")
@pytest.mark.parametrize("shift", [-200.0, 200.0])
def test_kl_is_invariant_to_shifting_every_logit(use_triton, shift):
    """softmax(s + c) = softmax(s), so loss and gradient must not change when a row's logits all move
    by c, whatever their magnitude: exp() of a logit beyond +-88 over- or underflows float32, so the
    log-sum-exp must be taken relative to the row's max. V = 333 is no power of two, so the Triton
    kernel's last block has masked lanes. Mutants that survived: the torch path's lse as
    `s.exp().sum(-1).log()` (inf at +200, -inf at -200: NaN loss), and the Triton forward loading masked
    lanes as 0.0 instead of -inf (a running max of 0 above every real logit at -200: exp underflows to
    0 everywhere, lse = -inf)."""
    g = torch.Generator().manual_seed(3)
    n, v = 4, 333
    s = torch.randn(n, v, generator=g) * 3  # [N, V]
    p = torch.softmax(torch.randn(n, v, generator=g) * 2, -1)  # [N, V]
    mask = torch.tensor([True, True, False, True])  # [N]

    def loss_and_grad(fn, logits, device):
        x = logits.detach().clone().to(device).requires_grad_(True)  # a leaf of its own
        loss = fn(x, p.to(device), mask.to(device))
        loss.backward()
        return loss.detach().cpu(), x.grad.cpu()

    want_loss, want_grad = loss_and_grad(forward_kl_reference, s, "cpu")  # log_softmax: shift-safe
    fused = lambda a, b, m: chunked_forward_kl(a, b, m, chunk_size=3, use_triton=use_triton)  # noqa: E731
    got_loss, got_grad = loss_and_grad(fused, s + shift, KL_DEVICE if use_triton else "cpu")
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-3, atol=1e-6)


# ---- cpu_linear ----------------------------------------------------------------------------------


@pytest.mark.skipif(not cpu_linear.packable(), reason="this torch has no oneDNN")
def test_a_shallow_copy_sharing_the_weight_repacks():
    """copy.copy of a packed layer shares its weight tensor (same storage, same version) but, like
    deepcopy and pickle, drops the packed copy, which has no storage to carry. The copy must repack on
    its first call, not trust a record of a pack it no longer holds. deepcopy and pickle make new
    storage, which hides this (also a pickle loaded in another process whose weight happens to land at
    the same address). Mutant that survived: __getstate__ keeping `_packed_of`, after which the copy
    handed oneDNN a None weight. 72 float32 rows: past the AVX-512 kernel, on the packed path."""
    torch.manual_seed(0)
    lin = nn.Linear(33, 70)
    assert pack_linears(lin) == 1
    shallow = copy.copy(lin)
    assert shallow.weight is lin.weight
    x = torch.randn(72, 33)  # [rows, in]
    with torch.inference_mode():
        torch.testing.assert_close(shallow(x), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-4)
