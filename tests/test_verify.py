"""Speculative verification: pinned cases, greedy, distribution convergence, kernel == reference.

Modelled on vLLM's tests/v1/sample/test_rejection_sampler.py: +100 logits for exact cases, a
histogram over many draws for the stochastic rule, and here also the Triton kernel compared
token-for-token with the torch reference (under TRITON_INTERPRET=1 when there is no GPU).
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

# TRITON_INTERPRET is read when triton decorates its own tl.* helpers, i.e. at `import triton`.
# If another test module imported triton first without it, the kernel cannot run on CPU in this
# process; the kernel tests then skip with that reason (fix: set it in tests/conftest.py).
_TRITON_IMPORTED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels.verify import inverse_cdf_sample, verify_greedy, verify_reference  # noqa: E402
from kernels.verify_triton import verify_triton  # noqa: E402
from osd_serve.sampling import greedy_tokens, logits_to_probs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.HAS_TRITON:
    _KERNEL_SKIP = "triton is not installed"
elif DEVICE == "cpu" and _TRITON_IMPORTED_EARLY:
    _KERNEL_SKIP = "triton was imported before TRITON_INTERPRET=1 was set (set it in tests/conftest.py)"
elif DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    _KERNEL_SKIP = "no GPU and TRITON_INTERPRET is not 1"
else:
    _KERNEL_SKIP = ""
needs_kernel = pytest.mark.skipif(bool(_KERNEL_SKIP), reason=_KERNEL_SKIP)


REPO = Path(__file__).resolve().parents[1]
IMPLS = [
    pytest.param(verify_reference, id="reference"),
    pytest.param(verify_triton, id="triton", marks=needs_kernel),
]


# --------------------------------------------------------------------------------------------
# helpers


def one_hot_probs(tokens: torch.Tensor, v: int) -> torch.Tensor:
    """[...] token ids -> [..., V] probs from +100 logits (exp(-100) underflows: exactly one-hot)."""
    logits = torch.full((*tokens.shape, v), -100.0)  # [..., V]
    logits.scatter_(-1, tokens.unsqueeze(-1), 100.0)
    flat = logits.reshape(-1, v)  # [N, V]
    n = flat.shape[0]
    ones = torch.ones(n)
    probs = logits_to_probs(flat, ones, torch.zeros(n, dtype=torch.long), ones)  # [N, V]
    return probs.reshape(*tokens.shape, v)


def run(impl, target_probs, draft_probs, draft_tokens, num_draft, uniforms):
    args = [t.to(DEVICE) for t in (target_probs, draft_probs, draft_tokens, num_draft, uniforms)]
    out, n = impl(*args)
    return out.cpu(), n.cpu()


def loop_verify(target_probs, draft_probs, draft_tokens, num_draft, uniforms):
    """The rule written row by row, independent of the vectorised reference's indexing."""
    b, k1, v = target_probs.shape
    out = torch.full((b, k1), -1, dtype=torch.long)
    acc = torch.zeros(b, dtype=torch.long)
    for i in range(b):
        a = 0
        while a < int(num_draft[i]):
            x = int(draft_tokens[i, a])
            p_x, q_x = target_probs[i, a, x], draft_probs[i, a, x]
            if not (uniforms[i, a] * q_x < p_x and q_x > 0):
                break
            out[i, a] = x
            a += 1
        dist = target_probs[i, a]
        if a < int(num_draft[i]):
            residual = (target_probs[i, a] - draft_probs[i, a]).clamp(min=0)
            if residual.double().sum() > 0:
                dist = residual
        out[i, a] = inverse_cdf_sample(dist[None], uniforms[i, k1 - 1 :])[0]
        acc[i] = a
    return out, acc


# --------------------------------------------------------------------------------------------
# pinned cases


@pytest.mark.parametrize("impl", IMPLS)
def test_pinned_one_hot(impl):
    v = 10
    # Row: draft tokens (k=3), target argmax at positions 0..3, num_draft -> expected out, accepted.
    cases = [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4], 3),  # all accepted -> bonus from p[3]
        ([1, 2, 3], [5, 2, 3, 4], 3, [5, -1, -1, -1], 0),  # reject at 0 -> target argmax
        ([1, 2, 3], [1, 6, 3, 4], 3, [1, 6, -1, -1], 1),  # reject in the middle
        ([1, 2, 3], [1, 2, 7, 4], 3, [1, 2, 7, -1], 2),  # reject at the last draft
        ([1, 2, 3], [1, 2, 7, 4], 2, [1, 2, 7, -1], 2),  # k_i=2: bonus from p[2]; x_2 ignored
        ([1, 2, 3], [1, 8, 3, 4], 1, [1, 8, -1, -1], 1),  # k_i=1: bonus from p[1]
        ([1, 2, 3], [9, 2, 3, 4], 0, [9, -1, -1, -1], 0),  # k_i=0: plain decoding from p[0]
    ]
    draft_tokens = torch.tensor([c[0] for c in cases])  # [B, k]
    target = one_hot_probs(torch.tensor([c[1] for c in cases]), v)  # [B, k+1, V]
    draft = one_hot_probs(draft_tokens, v)  # [B, k, V]
    num_draft = torch.tensor([c[2] for c in cases])  # [B]
    uniforms = torch.rand(len(cases), 4, generator=torch.Generator().manual_seed(0))  # [B, k+1]
    out, acc = run(impl, target, draft, draft_tokens, num_draft, uniforms)
    assert out.tolist() == [c[3] for c in cases]
    assert acc.tolist() == [c[4] for c in cases]
    assert out.dtype == torch.int64 and acc.dtype == torch.int64


@pytest.mark.parametrize("impl", IMPLS)
def test_pinned_thresholds_and_edge_rules(impl):
    v = 4
    p = torch.tensor([0.1, 0.3, 0.4, 0.2])  # [V]
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])  # [V] p(1)/q(1) = 0.5
    # residual = max(0, p - q) = [0, 0, 0.3, 0] -> always token 2 after a rejection
    target = torch.stack([p, p])[None].repeat(2, 1, 1)  # [2, 2, V]
    draft = q[None, None].repeat(2, 1, 1)  # [2, 1, V]
    tokens = torch.tensor([[1], [1]])  # [2, 1]
    uniforms = torch.tensor([[0.49, 0.99], [0.51, 0.0]])  # accept iff u < 0.5
    out, acc = run(impl, target, draft, tokens, torch.tensor([1, 1]), uniforms)
    assert acc.tolist() == [1, 0]
    assert out.tolist() == [[1, 3], [2, -1]]  # bonus u=0.99 -> last token; residual -> 2

    # A draft token with q(x) = 0 is rejected even though p accepts it; residual is p's argmax.
    q0 = one_hot_probs(torch.tensor([[1]]), v)  # [1, 1, V] q(2) = 0
    p0 = one_hot_probs(torch.tensor([[2, 3]]), v)  # [1, 2, V]
    out, acc = run(impl, p0, q0, torch.tensor([[2]]), torch.tensor([1]), torch.tensor([[0.0, 0.5]]))
    assert acc.tolist() == [0] and out.tolist() == [[2, -1]]

    # u = 0 is a possible draw; it must not accept a token the target gives zero mass.
    q2 = one_hot_probs(torch.tensor([[2]]), v)  # [1, 1, V]
    out, acc = run(impl, p0, q2, torch.tensor([[2]]), torch.tensor([1]), torch.tensor([[0.0, 0.5]]))
    assert acc.tolist() == [1] and out.tolist() == [[2, 3]]  # agreement still accepted at u = 0
    q_soft = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]])  # [1, 1, V] q(1) > 0 = p(1)
    out, acc = run(impl, p0, q_soft, torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[0.0, 0.5]]))
    assert acc.tolist() == [0] and out.tolist() == [[2, -1]]

    # The inverse CDF never returns a zero-mass token, even if u * total rounds up to total
    # (u = 1.0 is outside the contract; it stands in for that rounding).
    tail = torch.tensor([[[0.0, 0.7, 0.3, 0.0]]])  # [1, 1, V]
    no_draft = (torch.zeros(1, 0, v), torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    out, acc = run(impl, tail, *no_draft, torch.tensor([[1.0]]))
    assert out.tolist() == [[2]]

    # No residual mass (p <= q everywhere, e.g. differently normalised): fall back to p[a].
    qh = torch.tensor([[[0.0, 0.2, 0.0, 0.8]]])  # [1, 1, V]
    ph = torch.stack([qh[0, 0] * 0.5, torch.tensor([1.0, 0, 0, 0])])[None]  # [1, 2, V]
    out, acc = run(impl, ph, qh, torch.tensor([[3]]), torch.tensor([1]), torch.tensor([[0.9, 0.1]]))
    assert acc.tolist() == [0] and out.tolist() == [[1, -1]]  # 0.1 * 0.5 falls in p's token 1


@pytest.mark.parametrize("impl", IMPLS)
def test_k_zero_dimension_is_plain_decoding(impl):
    gen = torch.Generator().manual_seed(4)
    p = torch.randn(5, 1, 7, generator=gen).softmax(-1)  # [B, 1, V]
    u = torch.rand(5, 1, generator=gen)  # [B, 1]
    no_draft = (torch.zeros(5, 0, 7), torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, dtype=torch.long))
    out, acc = run(impl, p, *no_draft, u)
    assert acc.tolist() == [0] * 5
    assert torch.equal(out[:, 0], inverse_cdf_sample(p[:, 0], u[:, 0]))


# --------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_is_argmax_agreement(impl):
    gen = torch.Generator().manual_seed(5)
    b, k, v = 64, 4, 6  # small V so draft and target argmaxes often agree
    target_logits = torch.randn(b, k + 1, v, generator=gen)  # [B, k+1, V]
    draft_logits = target_logits[:, :k] + 0.8 * torch.randn(b, k, v, generator=gen)  # [B, k, V]
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)  # [B]

    def greedy(logits):  # [..., V] -> [..., V] one-hot via temperature 0
        n = logits.numel() // v
        params = torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n)
        return logits_to_probs(logits.reshape(n, v), *params).reshape(logits.shape)

    p, q = greedy(target_logits), greedy(draft_logits)  # [B, k+1, V], [B, k, V]
    draft_tokens = draft_logits.argmax(-1)  # [B, k] what a greedy draft proposes
    uniforms = torch.rand(b, k + 1, generator=gen)  # [B, k+1] must not matter
    out, acc = run(impl, p, q, draft_tokens, num_draft, uniforms)

    t_arg = target_logits.argmax(-1)  # [B, k+1]
    for i in range(b):
        a = 0
        while a < num_draft[i] and draft_tokens[i, a] == t_arg[i, a]:
            a += 1
        expected = draft_tokens[i, :a].tolist() + [int(t_arg[i, a])] + [-1] * (k - a)
        assert out[i].tolist() == expected, i
        assert acc[i] == a
    assert 0 < acc.float().mean() < k  # both agreement and disagreement were exercised


@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_verify_greedy_equals_the_reference_on_one_hot_p_and_q(k):
    """The all-greedy fast path gives the reference's tokens and counts for one-hot p and q, on logits
    full of ties, with per-row k_i (0 included), padding past k_i, and drafts that are not the draft's
    own argmax (the rule only sees q one-hot at each proposal)."""
    gen = torch.Generator().manual_seed(11 + k)
    b, v = 200, 5  # small V: draft and target agree often enough to reach every acceptance count
    target_logits = torch.randint(-2, 2, (b, k + 1, v), generator=gen).float()  # [B, k+1, V] many ties
    t_arg = greedy_tokens(target_logits)  # [B, k+1]
    draft_tokens = torch.where(torch.rand(b, k, generator=gen) < 0.7, t_arg[:, :k],
                               torch.randint(0, v, (b, k), generator=gen))  # [B, k]
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)  # [B]
    draft_tokens = torch.where(torch.arange(k)[None] < num_draft[:, None], draft_tokens, -1)  # padding past k_i
    p = torch.nn.functional.one_hot(t_arg, v).float()  # [B, k+1, V]
    q = torch.nn.functional.one_hot(draft_tokens.clamp_min(0), v).float()  # [B, k, V]
    uniforms = torch.rand(b, k + 1, generator=gen)  # [B, k+1]
    out, acc = verify_greedy(t_arg, draft_tokens, num_draft)
    ref_out, ref_acc = verify_reference(p, q, draft_tokens, num_draft, uniforms)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    if k:
        assert set(acc.tolist()) == set(range(k + 1))  # every acceptance count was exercised


# --------------------------------------------------------------------------------------------
# distribution: emitted tokens ~ p


TV_BOUND = 0.01


def broken_verify(target_probs, draft_probs, draft_tokens, num_draft, uniforms):
    """The correct accept rule, but after a rejection it samples p[a] instead of the residual."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    p_x = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    accept = (uniforms[:, :k] * q_x < p_x) & (q_x > 0) & (torch.arange(k) < num_draft[:, None])
    acc = accept.long().cumprod(1).sum(1)  # [B]
    final = inverse_cdf_sample(target_probs[torch.arange(b), acc], uniforms[:, k])  # [B]
    out = torch.full((b, k1), -1)  # [B, k+1]
    out[:, :k] = torch.where(torch.arange(k) < acc[:, None], draft_tokens, -1)
    out[torch.arange(b), acc] = final
    return out, acc


def speculative_draws(n, k, v, seed, num_draft=None, draft_noise=None):
    """n independent rows drafting from fixed q_j and verified against fixed p_j.

    draft_noise=None draws q independently of p (low acceptance, large residual); a number makes
    q a noisy copy of p so that later positions are reached often enough to be tested.
    """
    gen = torch.Generator().manual_seed(seed)
    p_logits = 1.5 * torch.randn(k + 1, v, generator=gen)  # [k+1, V]
    if draft_noise is None:
        q_logits = 1.5 * torch.randn(k, v, generator=gen)  # [k, V]
    else:
        q_logits = p_logits[:k] + draft_noise * torch.randn(k, v, generator=gen)  # [k, V]
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)  # [k+1, V], [k, V]
    draft_u = torch.rand(n, k, generator=gen)  # [n, k]
    draft_tokens = torch.stack(
        [inverse_cdf_sample(q[j].expand(n, v), draft_u[:, j]) for j in range(k)], dim=1
    )  # [n, k] x_j ~ q_j
    if num_draft is None:
        num_draft = torch.full((n,), k)
    uniforms = torch.rand(n, k + 1, generator=gen)  # [n, k+1]
    args = (p.expand(n, k + 1, v), q.expand(n, k, v), draft_tokens, num_draft, uniforms)
    return p, q, args


def tv(tokens, p):
    hist = torch.bincount(tokens, minlength=p.numel()).double() / tokens.numel()  # [V]
    return 0.5 * float((hist - p.double()).abs().sum())


@pytest.mark.parametrize("k", [1, 3])
def test_first_token_distribution_matches_target(k):
    n, v = 100_000, 12
    p, q, args = speculative_draws(n, k, v, seed=10 + k)
    out, acc = verify_reference(*args)
    assert tv(out[:, 0], p[0]) < TV_BOUND

    # The bound is tight enough to catch a sampler that is wrong only after rejections.
    bad_out, bad_acc = broken_verify(*args)
    assert torch.equal(bad_acc, acc)  # same accept decisions, different corrections
    assert tv(bad_out[:, 0], p[0]) > 3 * TV_BOUND
    # ...and that is not luck of the draw: its exact first-token law is far from p.
    m = torch.minimum(p[0], q[0])  # [V] accepted mass per token
    bad_law = m + (1 - m.sum()) * p[0]  # [V]
    assert 0.5 * float((bad_law - p[0]).abs().sum()) > 3 * TV_BOUND


def test_every_emitted_position_matches_target_with_mixed_num_draft():
    # Given x_0..x_{j-1} accepted, position j is a fresh speculative step, so the j-th emitted
    # token (where it exists) is ~ p_j whether it came from acceptance, residual or bonus.
    n, k, v = 300_000, 3, 10
    gen = torch.Generator().manual_seed(20)
    num_draft = torch.randint(0, k + 1, (n,), generator=gen)  # [n]
    p, _, args = speculative_draws(n, k, v, seed=0, num_draft=num_draft, draft_noise=0.7)
    out, acc = verify_reference(*args)
    bad_out, _ = broken_verify(*args)
    for j in range(k + 1):
        rows = acc >= j  # [n] rows that emit a j-th token
        count = int(rows.sum())
        assert count > 20_000
        bound = TV_BOUND * (50_000 / count) ** 0.5  # the noise floor scales as 1/sqrt(count)
        assert tv(out[rows, j], p[j]) < bound, j
        if j < k:  # position k is bonus-only; the broken sampler only differs after a rejection
            assert tv(bad_out[rows, j], p[j]) > 2 * bound, j


@needs_kernel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="50k programs are too slow for the interpreter")
def test_kernel_distribution_on_gpu():
    n, k, v = 100_000, 3, 12
    p, _, args = speculative_draws(n, k, v, seed=30)
    out, acc = run(verify_triton, *args)
    assert tv(out[:, 0], p[0]) < TV_BOUND
    ref_out, ref_acc = verify_reference(*args)
    assert (out == ref_out).all() and (acc == ref_acc).all()


# --------------------------------------------------------------------------------------------
# vectorised reference == row loop == kernel


def random_inputs(b, k, v, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "one_hot":
        t_tok = torch.randint(0, v, (b, k + 1), generator=gen)  # [B, k+1]
        agree = torch.rand(b, k, generator=gen) < 0.8  # [B, k]
        d_tok = torch.where(agree, t_tok[:, :k], torch.randint(0, v, (b, k), generator=gen))  # [B, k]
        target, draft, draft_tokens = one_hot_probs(t_tok, v), one_hot_probs(d_tok, v), d_tok
    else:
        t_logits = 2 * torch.randn(b, k + 1, v, generator=gen)  # [B, k+1, V]
        d_logits = t_logits[:, :k] + torch.randn(b, k, v, generator=gen)  # [B, k, V] a decent draft
        n_tk = b * (k + 1)
        # "sparse": the same top-k on both sides, so p and q have many exact zeros.
        top_k = torch.full((n_tk,), 3 if kind == "sparse" else 0)
        ones = torch.ones(n_tk)
        target = logits_to_probs(t_logits.reshape(-1, v), ones, top_k, ones).reshape(b, k + 1, v)
        n_d = b * k  # same params on the draft side, as the engine does
        draft = logits_to_probs(d_logits.reshape(-1, v), ones[:n_d], top_k[:n_d], ones[:n_d]).reshape(b, k, v)
        u = torch.rand(b * k, generator=gen)
        draft_tokens = inverse_cdf_sample(draft.reshape(-1, v), u).reshape(b, k)  # [B, k] x ~ q
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)  # [B]
    num_draft[0] = k  # at least one full-length row
    # Positions >= k_i are ignored, so callers may pad them; -1 would break any stray gather.
    draft_tokens = torch.where(torch.arange(k) < num_draft[:, None], draft_tokens, -1)  # [B, k]
    uniforms = torch.rand(b, k + 1, generator=gen)  # [B, k+1]
    return target, draft, draft_tokens, num_draft, uniforms


@pytest.mark.parametrize("kind", ["one_hot", "soft", "sparse"])
def test_reference_matches_row_loop(kind):
    args = random_inputs(64, 4, 33, kind, seed=40)
    out, acc = verify_reference(*args)
    exp_out, exp_acc = loop_verify(*args)
    assert torch.equal(out, exp_out) and torch.equal(acc, exp_acc)
    assert acc.min() < acc.max()


@needs_kernel
@pytest.mark.parametrize("kind", ["one_hot", "soft"])
@pytest.mark.parametrize("v", [5, 17, 1000, 1031])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("b", [1, 3, 7])
def test_kernel_matches_reference(b, k, v, kind):
    args = random_inputs(b, k, v, kind, seed=b * 1000 + k * 100 + v)
    ref_out, ref_acc = verify_reference(*args)
    out, acc = run(verify_triton, *args)
    assert torch.equal(out, ref_out), (out, ref_out)
    assert torch.equal(acc, ref_acc)


@needs_kernel
@pytest.mark.parametrize("v", [2049, 4099])
def test_kernel_matches_reference_multi_block(v):
    # V above the kernel's largest block, so the inverse CDF carries its sum across blocks.
    for kind in ["soft", "one_hot"]:
        args = random_inputs(6, 2, v, kind, seed=v)
        ref_out, ref_acc = verify_reference(*args)
        out, acc = run(verify_triton, *args)
        assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc), kind


@needs_kernel
def test_kernel_matches_reference_many_rows():
    # Enough rows that accepts, rejections, bonus tokens and zero-mass tokens all occur.
    outs = []
    for kind in ["soft", "sparse", "one_hot"]:
        args = random_inputs(24, 5, 64, kind, seed=50)
        ref_out, ref_acc = verify_reference(*args)
        out, acc = run(verify_triton, *args)
        assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc), kind
        outs.append((ref_acc, args[3]))
    acc = torch.cat([a for a, _ in outs])
    num_draft = torch.cat([nd for _, nd in outs])
    assert (acc == num_draft).any() and (acc < num_draft).any()  # bonus and rejection both seen


def test_dispatcher_uses_reference_on_cpu():
    args = random_inputs(8, 3, 20, "soft", seed=60)
    out, acc = kernels.verify(*args)
    ref_out, ref_acc = verify_reference(*args)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)


def test_kernels_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "p = torch.tensor([[[0.0, 1.0]]]); u = torch.zeros(1, 1)\n"
        "none = (torch.zeros(1, 0, 2), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long))\n"
        "out, n = kernels.verify(p, *none, u)\n"
        "assert out.tolist() == [[1]]\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=60)


@pytest.mark.parametrize("impl", IMPLS)
def test_uniforms_keep_their_float64_precision(impl):
    """The engine draws float64 uniforms (a float32 torch.rand returns multiples of 2**-24 only, which
    rounds every token's chance to that grid: 1.5e-3 total variation at V = 152k). The kernel cast
    them to float32, which rounds u = 1 - 2**-28 up to 1 and picks the last token, whose mass is 2**-30
    and whose inverse-CDF interval lies above that u."""
    v = 4
    p = torch.tensor([[[0.5, 0.25, 0.25 - 2.0**-30, 2.0**-30]]], dtype=torch.float32)  # [1, 1, V]
    p = p.double().float()  # float32 cannot hold 0.25 - 2**-30: the last two entries as stored
    u = torch.tensor([[1 - 2.0**-28]], dtype=torch.float64)  # [1, k+1]
    out, _ = run(impl, p, torch.zeros(1, 0, v), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long), u)
    cdf = p[0, 0].double().cumsum(0)
    want = int((cdf <= u[0, 0] * cdf[-1]).sum().clamp(max=v - 1))
    assert out[0, 0].item() == want


def test_engine_uniforms_are_float64(tok):
    """Off float32's 2**-24 grid, in the engine and in the disaggregated workers."""
    from osd_serve.config import SamplingParams
    from osd_serve.disagg import uniforms
    from osd_serve.engine import SpecEngine
    from tests.conftest import llama

    model = llama(len(tok), seed=0)
    eng = SpecEngine(model, model, tok)
    for seed in range(40):
        eng.add_request([5, 6, 7], SamplingParams(temperature=1.0, seed=seed, num_speculative_tokens=8, max_tokens=20))
    eng._admit()
    u_draft, u_verify = eng._uniforms([8] * len(eng.running))  # [B, k], [B, k+1]
    for u in (u_draft, u_verify, uniforms(7, 0, 5, 1000)):
        assert u.dtype == torch.float64 and ((u * 2**24) % 1 != 0).any()
