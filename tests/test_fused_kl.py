"""The chunked forward KL (torch path and Triton kernel under TRITON_INTERPRET=1) against plain autograd."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_kl import chunked_forward_kl, forward_kl_reference
from kernels.fused_kl_triton import HAS_TRITON
from osd_serve.distill.losses import forward_kl


def _inputs(n, v, seed, topk=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, v, generator=g) * 3
    p = torch.softmax(torch.randn(n, v, generator=g) * 2, -1)
    if topk:  # a top-k record: zeros outside the top-k, and the mass does not sum to 1
        vals, ids = p.topk(topk, -1)
        p = torch.zeros_like(p).scatter_(1, ids, vals)
    mask = torch.arange(n) % 3 != 1  # some rows masked whenever n >= 2
    return s, p, mask


def _grad(fn, s, p, mask):
    s = s.clone().requires_grad_(True)
    loss = fn(s, p, mask)
    loss.backward()
    return loss.detach(), s.grad


def test_reference_equals_losses_forward_kl():
    s, p, mask = _inputs(9, 50, 0)
    ref = forward_kl_reference(s, p, mask)
    assert torch.allclose(ref, forward_kl(s, p.log(), mask), atol=1e-5)


BACKENDS = [False] + ([True] if HAS_TRITON else [])
# The Triton backend runs on the GPU where there is one: conftest sets TRITON_INTERPRET=1 only without
# CUDA, and a compiled kernel cannot read CPU tensors. The reference stays on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _dev(use_triton: bool) -> str:
    return DEVICE if use_triton else "cpu"


@pytest.mark.parametrize("use_triton", BACKENDS, ids=lambda t: "triton" if t else "torch")
@pytest.mark.parametrize("n,v,chunk,topk", [(7, 1000, 3, 0), (5, 4099, 2, 0), (6, 333, 4, 20), (1, 17, 8, 0)])
def test_chunked_matches_reference_value_and_gradient(use_triton, n, v, chunk, topk):
    s, p, mask = _inputs(n, v, n * v, topk)
    ref_loss, ref_grad = _grad(forward_kl_reference, s, p, mask)
    d = _dev(use_triton)
    got_loss, got_grad = _grad(lambda a, b, m: chunked_forward_kl(a, b, m, chunk_size=chunk, use_triton=use_triton), s.to(d), p.to(d), mask.to(d))
    got_loss, got_grad = got_loss.cpu(), got_grad.cpu()
    assert torch.allclose(got_loss, ref_loss, rtol=1e-4, atol=1e-5)
    assert torch.allclose(got_grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert not got_grad[~mask].any()  # masked positions get no gradient


@pytest.mark.parametrize("use_triton", BACKENDS, ids=lambda t: "triton" if t else "torch")
def test_low_precision_logits_keep_their_dtype(use_triton):
    s, p, mask = _inputs(4, 300, 3)
    s16, d = s.to(torch.bfloat16), _dev(use_triton)
    loss, grad = _grad(lambda a, b, m: chunked_forward_kl(a, b, m, chunk_size=2, use_triton=use_triton), s16.to(d), p.half().to(d), mask.to(d))
    loss, grad = loss.cpu(), grad.cpu()
    ref_loss, ref_grad = _grad(forward_kl_reference, s16.float(), p.half().float(), mask)
    assert grad.dtype == torch.bfloat16
    assert torch.allclose(loss, ref_loss, rtol=1e-3)
    assert torch.allclose(grad.float(), ref_grad, atol=2e-3)


def test_identical_distributions_give_zero():
    s, _, _ = _inputs(5, 64, 1)
    loss = chunked_forward_kl(s, torch.softmax(s, -1), chunk_size=2, use_triton=False)
    assert abs(float(loss)) < 1e-5


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        chunked_forward_kl(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.parametrize("use_triton", BACKENDS, ids=lambda t: "triton" if t else "torch")
def test_masked_vocabulary_gives_the_exact_kl_not_nan(use_triton):
    """A student logit of -inf where the teacher puts no mass adds nothing to KL(p || q), but
    0 * -inf made the loss NaN (every backend and the reference); in the Triton forward a row whose
    first block of logits was all -inf got lse = NaN, and so did its whole gradient."""
    from kernels.fused_kl_triton import BLOCK_V

    torch.manual_seed(0)
    v = 2 * BLOCK_V
    s = torch.randn(3, v)
    s[0, :BLOCK_V] = float("-inf")  # a whole first block masked
    s[1, ::7] = float("-inf")  # scattered
    p = torch.softmax(torch.randn(3, v), -1).masked_fill(s == float("-inf"), 0.0)
    p = p / p.sum(-1, keepdim=True)
    finite = s.masked_fill(s == float("-inf"), -1e4)  # the same distribution q, written with finite logits
    want = forward_kl_reference(finite, p)
    assert torch.isfinite(forward_kl_reference(s, p)) and torch.allclose(forward_kl_reference(s, p), want, atol=1e-5)
    d = _dev(use_triton)
    x = s.to(d).requires_grad_(True)
    loss = chunked_forward_kl(x, p.to(d), chunk_size=2, use_triton=use_triton)
    loss.backward()
    assert torch.allclose(loss.cpu(), want, atol=1e-5) and torch.isfinite(x.grad).all()
