"""End to end: the engine's sampled tokens follow the target's own sampling distribution.

A vocabulary of 6 and three generated tokens give 216 outcomes whose exact probabilities under the
target (with the same temperature/top-k/top-p processing) are enumerated; thousands of seeded requests
are compared to them with a chi-square test. Three tokens let the first step draft k=2 (a request
never drafts past max_tokens), so a rejection at the second position and its residual are exercised.
The same test run with a sampler that accepts every draft token (no rejection) must fail, which shows
the test has the power to catch a broken sampler.
"""

from __future__ import annotations

import math

import pytest
import torch

import osd_serve.spec as spec
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.sampling import logits_to_probs
from tests.conftest import llama

V = 6
PROMPT = [2, 4, 1]
N = 6000


class _IdTokenizer:
    """Token ids as text: this test only looks at ids."""

    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        return " ".join(map(str, ids))


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation (no scipy needed)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@torch.inference_mode()
def _exact(target, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the processed target distribution. [V, V, V]"""
    def probs(ids):
        logits = target(torch.tensor(ids)).logits[:, -1]
        n = logits.shape[0]
        return logits_to_probs(
            logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k), torch.full((n,), params.top_p)
        )

    p1 = probs([PROMPT])[0]  # [V]
    p2 = probs([PROMPT + [t] for t in range(V)])  # [V, V]
    p3 = probs([PROMPT + [t, u] for t in range(V) for u in range(V)]).view(V, V, V)  # [V, V, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def _sample(target, draft, params: SamplingParams) -> torch.Tensor:
    eng = SpecEngine(target, draft, _IdTokenizer(), EngineConfig(max_batch_size=256))
    outs = eng.generate([PROMPT] * N, [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(N)])
    return histogram(o.token_ids for o in outs)


def histogram(outputs) -> torch.Tensor:
    """Counts of each three-token output. [V, V, V]"""
    counts = torch.zeros(V, V, V)
    for ids in outputs:
        counts[tuple(ids)] += 1
    return counts


def _chi2(counts: torch.Tensor, exact: torch.Tensor) -> tuple[float, int]:
    expected = exact * counts.sum()
    keep = expected > 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


@pytest.fixture(scope="module")
def models():
    target = llama(V, hidden=32, layers=2, seed=11)
    # An unrelated draft: its distribution differs a lot from the target's, so acceptance is partial
    # and the residual distribution does real work.
    draft = llama(V, hidden=32, layers=1, seed=12)
    return target, draft


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=3, temperature=1.0, num_speculative_tokens=2),
    SamplingParams(max_tokens=3, temperature=0.7, top_k=4, top_p=0.9, num_speculative_tokens=3),
])
def test_sampled_output_follows_target(models, params):
    target, draft = models
    exact = _exact(target, params)
    stat, df = _chi2(_sample(target, draft, params), exact)
    assert stat < _chi2_critical(df), f"chi2={stat:.1f} over {df} dof"


def test_broken_sampler_fails_the_same_test(models, monkeypatch):
    """Accepting every draft token (no rejection, no residual) must be caught by the chi-square bound."""
    target, draft = models
    params = SamplingParams(max_tokens=3, temperature=1.0, num_speculative_tokens=2)

    def accept_all(target_probs, draft_probs, draft_tokens, num_draft, uniforms):
        b, k = draft_tokens.shape
        bonus = torch.multinomial(target_probs[:, k], 1)
        return torch.cat([draft_tokens, bonus], 1), num_draft.clone()

    monkeypatch.setattr(spec, "verify", accept_all)
    stat, df = _chi2(_sample(target, draft, params), _exact(target, params))
    assert stat > _chi2_critical(df)
