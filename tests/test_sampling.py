"""osd_serve.sampling: temperature / top-k / top-p against per-row loops, greedy one-hot, inverse CDF."""

import pytest
import torch

from kernels.verify import inverse_cdf_sample
from osd_serve.sampling import apply_top_k_top_p, greedy_tokens, logits_to_probs


def _row_reference(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """One row, written the obvious way: [V] logits -> [V] probs."""
    logits = logits.float()
    v = logits.numel()
    if t == 0:
        out = torch.zeros(v)
        out[int(logits.argmax())] = 1.0
        return out
    x = logits / t
    if 0 < k < v:
        kth = torch.topk(x, k).values[-1]
        x = torch.where(x < kth, float("-inf"), x)
    if p < 1.0:
        probs = x.softmax(-1)
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(-1) - probs[order]  # mass of strictly larger tokens
        keep_sorted = mass_before < p  # smallest prefix reaching p; the first token always passes
        keep = torch.zeros(v, dtype=torch.bool)
        keep[order[keep_sorted]] = True
        x = torch.where(keep, x, float("-inf"))
    return x.softmax(-1)


def _params(n: int, v: int, gen: torch.Generator):
    temperature = torch.rand(n, generator=gen) * 1.7 + 0.3  # [N]
    temperature[::7] = 0.0  # some greedy rows mixed in
    top_k = torch.tensor([0, 1, 3, v - 1, v, v + 5, 10])[torch.randint(0, 7, (n,), generator=gen)]  # [N]
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.2, 1e-6])[torch.randint(0, 5, (n,), generator=gen)]  # [N]
    return temperature, top_k, top_p


@pytest.mark.parametrize("v", [2, 17, 50, 1000])
def test_matches_per_row_loop(v):
    gen = torch.Generator().manual_seed(v)
    n = 64
    logits = torch.randn(n, v, generator=gen) * 3  # [N, V]
    temperature, top_k, top_p = _params(n, v, gen)
    probs = logits_to_probs(logits, temperature, top_k, top_p)  # [N, V]
    assert probs.dtype == torch.float32 and probs.shape == (n, v)
    for i in range(n):
        expected = _row_reference(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]))
        torch.testing.assert_close(probs[i], expected, atol=1e-6, rtol=1e-5, msg=f"row {i}")


def test_each_filter_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 20, generator=gen)  # [1, V]
    ones = torch.ones(1)
    # Temperature only: softmax(logits / t).
    torch.testing.assert_close(
        logits_to_probs(logits, ones * 0.5, torch.zeros(1, dtype=torch.long), ones),
        (logits / 0.5).softmax(-1),
    )
    # top_k=5 keeps exactly the 5 largest.
    probs = logits_to_probs(logits, ones, torch.tensor([5]), ones)
    assert set((probs[0] > 0).nonzero().flatten().tolist()) == set(logits[0].topk(5).indices.tolist())
    # top_p keeps the smallest top set with mass >= p: check it is sufficient and minimal.
    full = logits.softmax(-1)[0]
    probs = logits_to_probs(logits, ones, torch.zeros(1, dtype=torch.long), ones * 0.7)
    kept = probs[0] > 0
    assert full[kept].sum() >= 0.7
    assert full[kept].sum() - full[kept].min() < 0.7


def test_temperature_zero_is_one_hot_of_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 100, generator=gen)  # [N, V]
    logits[3, [7, 42]] = 50.0  # tie: torch.argmax picks the first index
    zeros = torch.zeros(32)
    # top_k / top_p must not matter for greedy rows.
    probs = logits_to_probs(logits, zeros, torch.full((32,), 5), torch.full((32,), 0.3))
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 100).float()  # [N, V]
    assert torch.equal(probs, expected)
    assert probs[3].argmax() == 7


@pytest.mark.parametrize("temp", [1e-6, 1e-30, 1e-40])  # 1e-40 is a float32 subnormal: logits / T overflow
def test_a_tiny_temperature_samples_the_argmax(temp):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 64, generator=gen) * 5  # [N, V]
    n = len(logits)
    probs = logits_to_probs(logits, torch.full((n,), temp), torch.zeros(n, dtype=torch.long), torch.ones(n))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 64).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_break_ties_like_argmax(dtype):
    """HF greedy decoding takes torch.argmax (first index on ties); greedy_tokens must agree, ties
    included: low-precision logits tie often. Integer logits in [-3, 3) tie in almost every row."""
    gen = torch.Generator().manual_seed(2)
    for v in (2, 7, 4096, 50_000):
        logits = torch.randint(-3, 3, (3, 9, v), generator=gen).to(dtype)  # [B, T, V]
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
        assert torch.equal(greedy_tokens(logits[:, :, ::3]), logits[:, :, ::3].argmax(-1))  # strided view


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_gives_float32(dtype):
    logits = torch.randn(4, 33).to(dtype)  # [N, V]
    probs = logits_to_probs(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_at_least_one_token_survives():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 30, generator=gen)  # [N, V]
    n = 16
    for top_k, top_p in [(1, 1.0), (0, 1e-9), (1, 1e-9), (30, 1e-9), (2, 1e-9)]:
        probs = logits_to_probs(
            logits, torch.ones(n), torch.full((n,), top_k), torch.full((n,), top_p)
        )
        assert ((probs > 0).sum(-1) >= 1).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(n))
        if top_k == 1 or top_p == 1e-9:  # only the argmax survives
            assert torch.equal(probs.argmax(-1), logits.argmax(-1))
            assert ((probs > 0).sum(-1) == 1).all()
    # Rows already masked to -inf outside a few tokens still keep one.
    masked = torch.full((2, 10), float("-inf"))
    masked[0, 4] = 0.0
    masked[1, [2, 9]] = torch.tensor([1.0, 3.0])
    probs = logits_to_probs(masked, torch.ones(2), torch.tensor([3, 0]), torch.tensor([1e-9, 0.5]))
    assert probs[0, 4] == 1.0 and probs[1, 9] == 1.0


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.7500001, 4), (1.0, 4)])
def test_top_p_exact_boundary(top_p, kept):
    # Equal logits give exact quarters, so the boundary "mass >= top_p" is hit exactly.
    no_k = torch.zeros(1, dtype=torch.long)
    probs = logits_to_probs(torch.zeros(1, 4), torch.ones(1), no_k, torch.tensor([top_p]))  # [1, 4]
    assert int((probs > 0).sum()) == kept
    torch.testing.assert_close(probs[probs > 0], torch.full((kept,), 1.0 / kept))


def test_top_k_keeps_ties_at_threshold():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])  # [1, V]
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.ones(1))
    assert torch.isfinite(out).tolist() == [[False, True, True, True, False]]


def test_inverse_cdf_sample_pinned():
    probs = torch.tensor([[0.2, 0.3, 0.5]] * 4)  # [4, 3]
    u = torch.tensor([0.0, 0.19, 0.21, 0.51])
    assert inverse_cdf_sample(probs, u).tolist() == [0, 0, 1, 2]
    sparse = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)  # [4, 5] zero-mass tokens never chosen
    u = torch.tensor([0.0, 0.49, 0.51, 1.0])  # 1.0 stands in for u*total rounding up to total
    tokens = inverse_cdf_sample(sparse, u)
    assert tokens.dtype == torch.int64 and tokens.tolist() == [1, 1, 3, 3]
    unnormalised = torch.tensor([[2.0, 0.0, 6.0]])  # [1, 3]
    assert inverse_cdf_sample(unnormalised, torch.tensor([0.26])).tolist() == [2]


def test_inverse_cdf_sample_histogram():
    gen = torch.Generator().manual_seed(3)
    v, n = 8, 100_000
    p = torch.randn(v, generator=gen).softmax(-1)  # [V]
    tokens = inverse_cdf_sample(p.expand(n, v), torch.rand(n, generator=gen))  # [n]
    hist = torch.bincount(tokens, minlength=v).float() / n  # [V]
    assert 0.5 * (hist - p).abs().sum() < 0.01


def test_inverse_cdf_sample_is_the_exact_inverse_cdf_at_a_real_vocab():
    """The draft's sampler (spec.propose) must draw from the q the accept rule is told. Over a 152k vocab (Qwen2.5's) a
    float32 running sum drifted: with half the mass on one token and a flat tail, the q' it sampled was
    1.25e-3 (total variation) from q, and 5 of these 400 uniforms picked another token than the exact one."""
    v = 152_064
    q = torch.full((1, v), 0.5 / (v - 1))  # [1, V]
    q[0, 0] = 0.5
    u = torch.linspace(0.0, 0.999, 400)  # [U]
    got = torch.cat([inverse_cdf_sample(q.expand(len(c), v), c) for c in u.split(50)])  # [U], 50 rows at a time: [50, V] float64 cdfs
    cdf = q[0].double().cumsum(0)  # [V] exact to ~1e-16
    want = torch.searchsorted(cdf, u.double() * cdf[-1], right=True)  # first index whose mass exceeds u * total
    assert torch.equal(got, want), f"{int((got != want).sum())} of {len(u)} uniforms picked another token"


def test_an_overflowed_logit_holds_the_rows_mass():
    """float16 logits can overflow to +inf: greedy picks that token; sampling gave a NaN row and token 0."""
    logits = torch.tensor([[3.0, 1.0, float("inf"), 0.5], [3.0, float("inf"), 1.0, float("inf")]], dtype=torch.float16)
    temp, k, p = torch.tensor([1.0, 0.7]), torch.tensor([0, 2]), torch.tensor([1.0, 0.9])
    probs = logits_to_probs(logits, temp, k, p)
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.5]]))
    toks = inverse_cdf_sample(probs.repeat(50, 1), torch.rand(100))
    assert set(toks[0::2].tolist()) == {2} and set(toks[1::2].tolist()) <= {1, 3}


@pytest.mark.parametrize("field, value", [("temperature", float("inf")), ("temperature", 1e39),
                                          ("temperature", float("nan")), ("seed", 2**63), ("seed", -(2**63) - 1)])
def test_parameters_that_cannot_be_honoured_are_refused(field, value):
    """temperature inf made every draft row NaN (acceptance 0, silently); seeds s and s + 2**64 gave one stream."""
    from osd_serve.config import SamplingParams

    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    SamplingParams(temperature=1e30, seed=-(2**63))  # the edges that are fine
    SamplingParams(seed=2**63 - 1)


def test_seeds_that_differ_above_bit_31_give_different_streams():
    """torch's CPU generator keeps the low 32 bits of its seed: 5 and 5 + 2**32 gave one stream,
    in the engine and in the disaggregated path's position-keyed uniforms."""
    from osd_serve.disagg import uniforms
    from osd_serve.sampling import seeded_generator

    draw = lambda *key: torch.rand(4, generator=seeded_generator(*key)).tolist()  # noqa: E731
    assert draw(5) == draw(5) and draw(5) != draw(5 + 2**32) and draw(-1) != draw(2**63 - 1)
    assert draw(5, 1, 10) != draw(5 + 2**32, 1, 10) and draw(5, 1, 10) != draw(5, 2, 10) != draw(5, 2, 11)
    assert not torch.equal(uniforms(-1, 3, 10, 4), uniforms(-1 + 2**63, 3, 10, 4))
    assert not torch.equal(uniforms(7, 1, 10, 4), uniforms(7 + 2**40, 1, 10, 4))
