"""Loss properties (trl GKD style): zero on identical inputs, limits, symmetry, ranges, masks."""

from __future__ import annotations

import pytest
import torch

from osd_serve.distill.losses import expected_acceptance, forward_kl, generalized_jsd, reverse_kl, total_variation


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(13, 37, generator=g) * 3, torch.randn(13, 37, generator=g) * 3


@pytest.mark.parametrize("fn", [forward_kl, reverse_kl, total_variation, lambda s, t: generalized_jsd(s, t, 0.3)])
def test_identical_inputs_give_zero(fn, logits):
    s, _ = logits
    assert float(fn(s, s.clone())) == pytest.approx(0.0, abs=1e-6)


def test_jsd_limits_equal_plain_kl(logits):
    s, t = logits
    assert torch.allclose(generalized_jsd(s, t, 0.0), forward_kl(s, t))
    assert torch.allclose(generalized_jsd(s, t, 1.0), reverse_kl(s, t))


def test_jsd_half_is_symmetric_and_bounded(logits):
    s, t = logits
    assert torch.allclose(generalized_jsd(s, t, 0.5), generalized_jsd(t, s, 0.5), atol=1e-6)
    assert 0 < float(generalized_jsd(s, t, 0.5)) <= torch.log(torch.tensor(2.0)) + 1e-6


def test_tvd_in_unit_interval_and_alpha_is_sum_of_min(logits):
    s, t = logits
    tv = float(total_variation(s, t))
    assert 0.0 <= tv <= 1.0
    p, q = t.softmax(-1), s.softmax(-1)
    assert float(expected_acceptance(s, t)) == pytest.approx(float(torch.minimum(p, q).sum(-1).mean()), abs=1e-6)
    far = torch.full((1, 4), -1e4)
    far_s, far_t = far.clone(), far.clone()
    far_s[0, 0] = far_t[0, 1] = 1e4
    assert float(total_variation(far_s, far_t)) == pytest.approx(1.0)


def test_mask_and_token_count_normalisation(logits):
    s, t = logits
    mask = torch.zeros(13, dtype=torch.bool)
    mask[[1, 4, 7]] = True
    full = forward_kl(s[mask], t[mask])
    assert torch.allclose(forward_kl(s, t, mask), full)
    # masked positions get no gradient
    s2 = s.clone().requires_grad_()
    generalized_jsd(s2, t, 0.5, mask).backward()
    assert s2.grad[~mask].abs().max() == 0 and s2.grad[mask].abs().max() > 0


@pytest.mark.parametrize("fn,kind", [(forward_kl, "forward"), (reverse_kl, "reverse"),
                                     (lambda s, t: generalized_jsd(s, t, 0.3), "jsd")])
def test_a_vocabulary_masked_on_both_sides_gives_the_exact_loss_and_a_finite_gradient(fn, kind):
    """-inf logits (a masked vocabulary) made F.kl_div compute exp(-inf) * (-inf - x): NaN loss and
    NaN gradients, where 0 log 0 = 0 gives a finite loss."""
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    s[:, [3, 7]] = t[:, [3, 7]] = float("-inf")
    p, q = torch.softmax(t.double(), -1), torch.softmax(s.double(), -1)
    kl = lambda a, b: torch.where(a > 0, a * (a / b).log(), 0.0).sum(-1)  # noqa: E731
    m = 0.3 * p + 0.7 * q
    want = {"forward": kl(p, q), "reverse": kl(q, p), "jsd": 0.3 * kl(p, m) + 0.7 * kl(q, m)}[kind].mean()
    s.requires_grad_()
    loss = fn(s, t)
    loss.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-5) and torch.isfinite(s.grad).all()
    # a NaN is not a masked id: it stays visible (the trainer skips such a step)
    assert torch.isnan(fn(s.detach(), t.index_fill(1, torch.tensor([0]), float("nan"))))


ALL = [forward_kl, reverse_kl, total_variation, lambda s, t, **kw: generalized_jsd(s, t, 0.3, **kw)]


@pytest.mark.parametrize("fn", ALL)
def test_inputs_that_would_broadcast_are_refused(fn, logits):
    """They broadcast into a number: a [N, 1] teacher gave a negative KL, a [1, V] student was
    scored against every row, a [1] mask masked all rows or none. The fused path refuses them too."""
    s, t = logits
    for a, b in ((s, t[:, :1]), (s[:1], t), (s[:, :-1], t)):
        with pytest.raises(ValueError, match="shapes differ"):
            fn(a, b)
    with pytest.raises(ValueError, match="mask shape"):
        fn(s, t, mask=torch.zeros(1, dtype=torch.bool))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("fn", ALL)
def test_a_temperature_that_is_not_positive_and_finite_is_refused(fn, temperature, logits):
    """0 and NaN gave NaN; a negative temperature trained towards the reversed distributions."""
    with pytest.raises(ValueError, match="temperature"):
        fn(*logits, temperature=temperature)


@pytest.mark.parametrize("fn", ALL)
def test_no_positions_give_zero_with_or_without_a_mask(fn):
    """An empty batch was 0 with a mask and NaN without one (mean() of nothing)."""
    s = torch.zeros(0, 5, requires_grad=True)
    assert float(fn(s, torch.zeros(0, 5))) == 0.0 == float(fn(s, torch.zeros(0, 5), mask=torch.zeros(0, dtype=torch.bool)))


@pytest.mark.parametrize("fn", ALL)
def test_a_temperature_divides_both_the_student_and_the_teacher_logits(fn, logits):
    """Distillation at temperature T compares softmax(s / T) with softmax(t / T). Only bad temperatures
    were tested, so a loss that left the teacher (or the student) at T = 1 passed."""
    s, t = logits
    assert float(fn(s, t, temperature=2.5)) == pytest.approx(float(fn(s / 2.5, t / 2.5)), rel=1e-5)
    assert float(fn(s, t, temperature=2.5)) != pytest.approx(float(fn(s, t)), rel=1e-2)  # the temperature matters here
