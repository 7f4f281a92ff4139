"""num_speculative_tokens "auto": the choice follows the costs and acceptance it is given, and every
choice keeps the output the target's (greedy: token for token; sampled: its distribution)."""

from __future__ import annotations

import itertools

import pytest
import torch

import osd_serve.engine as engine_mod
from osd_serve.auto_k import Costs, RowView, SpeculationPolicy, expected_tokens
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.output import Request
from tests.test_engine import MAX_TOKENS, count_mismatches
from tests.test_sampling_e2e import PROMPT, _chi2, _chi2_critical, _exact, _IdTokenizer, histogram
from tests.test_sampling_e2e import models  # noqa: F401  the fixture

MS = 1e-3


def policy(draft: float, target: list[float], k_max: int = 8) -> SpeculationPolicy:
    """A policy whose every batch size costs ``draft`` and ``target`` (seconds), counting calibrations."""
    p = SpeculationPolicy(k_max, lambda b: (calls.append(b), Costs(draft, target))[1])
    calls: list[int] = []
    p.calls = calls
    return p


def rows(n: int, alpha: float, tested: int = 10_000, cap: int = 100) -> list[RowView]:
    """n auto rows, each with ``tested`` drafts of its own at acceptance α (so the prior barely counts)."""
    return [RowView(True, cap, round(alpha * tested), tested) for _ in range(n)]


FLAT = [10 * MS] * 9  # verification as cheap as decoding at every width (a GPU at small batch)
LINEAR = [10 * MS * w for w in range(1, 10)]  # cost in proportion to tokens (a CPU's compute-bound batch)


def test_cheap_verification_and_high_acceptance_draft_far():
    # rate(k) = E(0.9, k) / (k·1 ms + 10 ms): 6.13/18 at k = 8 beats 4.69/15 at k = 5
    assert policy(1 * MS, FLAT).choose(rows(1, 0.9)) == 8


def test_verification_in_proportion_to_tokens_drafts_one():
    # rate(1) = 1.77/(1 + 20) ms beats rate(2) = 2.36/(2 + 30) ms: each draft costs a target column
    assert policy(1 * MS, LINEAR).choose(rows(8, 0.77)) == 1


def test_low_acceptance_drafts_the_least_k_allows():
    assert policy(1 * MS, FLAT).choose(rows(1, 0.05)) == 1


def test_choice_is_the_best_expected_rate():
    """Against the formula evaluated directly, over a grid of costs and acceptances."""
    for draft, target, alpha in itertools.product((0.3 * MS, 2 * MS), (FLAT, LINEAR, [10 * MS + MS * w * w for w in range(9)]),
                                                  (0.3, 0.6, 0.8, 0.95)):
        rates = {k: expected_tokens(alpha, k) / (k * draft + target[k]) for k in range(1, 9)}
        got = policy(draft, target).choose(rows(1, alpha, tested=10**9))
        assert rates[got] == pytest.approx(max(rates.values()), rel=1e-6), (draft, target, alpha, got)


def test_a_fixed_row_sets_the_width_and_auto_rows_use_it():
    """A fixed k = 8 row makes the batch verify 9 columns anyway: drafting 8 costs the auto rows
    nothing more, though alone they would draft 1 (the test above)."""
    fixed = RowView(False, 8, 0, 0)
    assert policy(1 * MS, LINEAR).choose([fixed, *rows(7, 0.77)]) == 8


def test_max_tokens_cap_gives_the_smallest_k_that_reaches_it():
    # Every k >= 2 drafts the same 2 for a row with 3 tokens left: the same rate, and the least k wins.
    assert policy(1 * MS, FLAT).choose(rows(1, 0.9, cap=2)) == 2


def test_measured_steps_rescale_the_calibration():
    """Draft forwards measured 20x their calibration (the draft lost its cores) pull k down from 8."""
    p = policy(1 * MS, FLAT)
    assert p.choose(rows(1, 0.9)) == 8
    for _ in range(200):
        p.observe(1, 8, draft_seconds=8 * 20 * MS, target_seconds=10 * MS, loop_seconds=0.0, accepted=0, tested=0)
    assert p.draft_scale == pytest.approx(20, rel=1e-3) and p.target_scale == pytest.approx(1)
    assert p.choose(rows(1, 0.9)) == 1


def test_acceptance_is_learned_and_a_rows_own_counts_dominate():
    p = policy(1 * MS, FLAT)
    for _ in range(300):
        p.observe(1, 4, 4 * MS, 10 * MS, 0.0, accepted=1, tested=10)  # every row's α ≈ 0.1
    assert p.mean_alpha == pytest.approx(0.1, abs=0.01)
    assert p.alpha(RowView(True, 8, 0, 0)) == pytest.approx(0.1, abs=0.01)  # a new row: the mean
    assert p.alpha(RowView(True, 8, 950, 1000)) > 0.9  # a row with its own record: its own
    assert p.choose([RowView(True, 8, 0, 0)]) == 1
    assert p.choose([RowView(True, 8, 9500, 10_000)]) == 8


def test_powers_of_two_are_calibrated_once_and_forks_share_them():
    p = policy(1 * MS, FLAT)
    for n in (1, 1, 3, 1, 3, 4):
        p.choose(rows(n, 0.5))
    assert p.calls == [1, 2, 4]  # 3 lies between 2 and 4
    f = p.fork()
    f.choose(rows(3, 0.5))
    assert p.calls == [1, 2, 4] and f.draft_scale == 1.0 and f.mean_alpha == pytest.approx(0.6)


def test_sizes_between_calibrated_ones_are_interpolated_up_to_the_largest_batch():
    calls = []

    def measure(b):  # costs growing with the batch, as a compute-bound forward's do
        calls.append(b)
        return Costs(b * MS, [b * w * MS for w in range(1, 10)])

    p = SpeculationPolicy(8, measure, max_batch=6)
    assert p.cost(3).target[1] == pytest.approx(6 * MS) and p.cost(3).draft == pytest.approx(3 * MS)
    assert p.cost(5).draft == pytest.approx(5 * MS) and p.cost(6).draft == pytest.approx(6 * MS)
    assert calls == [2, 4, 6]  # 6 is max_batch: calibrated itself, and the top of 5's interval (not 8)


def test_widths_past_the_calibration_are_extended():
    c = Costs(1 * MS, [10 * MS, 12 * MS, 15 * MS])
    assert c.target_at(2) == pytest.approx(15 * MS) and c.target_at(5) == pytest.approx(24 * MS)
    assert policy(1 * MS, [10 * MS, 12 * MS], k_max=1).choose([RowView(False, 4, 0, 0)]) == 1  # no IndexError


def test_auto_is_a_valid_k_and_other_strings_are_named_errors():
    assert SamplingParams(num_speculative_tokens="auto").auto_k
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens="fast")
    for field, bad in (("auto_k_max", 0), ("auto_k_max", 17), ("auto_seeded_k", -1)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})
    req = Request("r", "", [1], SamplingParams(num_speculative_tokens="auto", max_tokens=5), None)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        req.step_k()  # only the engine chooses (the disaggregated path must not guess)
    assert req.step_k(auto_k=8) == 4  # capped by max_tokens as any k


class CyclingPolicy(SpeculationPolicy):
    """Chooses 1, 2, ..., k_max, 1, ... regardless of cost: every change of k between steps is exercised."""

    def __init__(self, k_max: int):
        super().__init__(k_max, lambda b: Costs(1.0, [1.0] * (k_max + 1)))
        self._next = itertools.cycle(range(1, k_max + 1))

    def choose(self, rows):
        return next(self._next)


def test_greedy_auto_equals_target_while_k_changes_every_step(pair, tok):
    from tests.test_engine import _hf_greedy, _prompts

    arch, target, draft = pair
    prompts = _prompts(target.config.vocab_size, n=24, seed=3)
    refs = [_hf_greedy(target, p, MAX_TOKENS) for p in prompts]
    for bs in (1, 3, 8):
        eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=bs), policy=CyclingPolicy(8))
        stats = []
        # a fixed k = 0 row and a fixed k = 3 row share batches with the auto rows
        params = [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=[0, 3, "auto", "auto"][i % 4], ignore_eos=True)
                  for i in range(len(prompts))]
        outs = eng.generate(prompts, params, stats=stats)
        assert count_mismatches(target, prompts, [o.token_ids for o in outs], refs)[0] == 0, (arch, bs)
        chosen = {s.auto_k for s in stats if s.auto_k is not None}
        assert len(chosen) >= 4, chosen  # k really moved
        assert all(o.proposed == 0 for o in outs[::4])  # the fixed k = 0 rows stayed plain decoding


def test_auto_learns_from_the_engine_steps(pair, tok):
    """With real forwards: each batch size met is calibrated, acceptance and scales come from the steps."""
    from tests.test_engine import _prompts

    arch, target, draft = pair
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4, auto_k_max=4))
    stats = []
    eng.generate(_prompts(target.config.vocab_size, n=8, seed=5), SamplingParams(max_tokens=12, num_speculative_tokens="auto"),
                 stats=stats)
    assert set(eng.policy.costs) <= {1, 2, 4} and 4 in eng.policy.costs  # 3 rows: between 2 and 4
    # Rows leave as requests finish; which sizes a run meets depends on the k chosen, so on timing (a
    # loaded CI machine met {2, 4} once, not 3): a full batch, a smaller one, each within the calibration.
    sizes = {s.batch_size for s in stats}
    assert 4 in sizes and min(sizes) < 4 and all(any(c >= b for c in eng.policy.costs) for b in sizes)
    assert all(len(c.target) == 5 for c in eng.policy.costs.values())
    assert all(1 <= s.auto_k <= 4 for s in stats)
    tested = sum(s.accepted + s.rejected for s in stats)
    assert 0.1 < eng.policy.mean_alpha < 0.95 and tested > 0
    assert eng.policy.target_scale != 1.0 and eng.policy.overhead > 0


def test_a_seeded_sampled_auto_request_drafts_the_fixed_k(pair, tok):
    """Its output must not depend on the batch, so it keeps auto_seeded_k: the same tokens as asking for it."""
    arch, target, draft = pair
    prompt = [5, 9, 14, 3]
    outs = []
    for k in ("auto", 3):
        eng = SpecEngine(target, draft, tok, EngineConfig(auto_seeded_k=3), policy=CyclingPolicy(8))
        outs.append(eng.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=7, num_speculative_tokens=k))[0])
    assert outs[0].token_ids == outs[1].token_ids and outs[0].proposed == outs[1].proposed


def test_sampled_auto_output_follows_target(models, monkeypatch):  # noqa: F811
    """Unseeded sampled requests under a k that changes every step: the chi-square test of
    test_sampling_e2e against the enumerated target distribution (request seeds made deterministic)."""
    target, draft = models
    seeds = itertools.count(1000)
    monkeypatch.setattr(engine_mod.secrets, "randbits", lambda n: next(seeds))
    params = SamplingParams(max_tokens=3, temperature=1.0, num_speculative_tokens="auto")
    eng = SpecEngine(target, draft, _IdTokenizer(), EngineConfig(max_batch_size=256), policy=CyclingPolicy(2))
    outs = eng.generate([PROMPT] * 6000, params)
    stat, df = _chi2(histogram(o.token_ids for o in outs), _exact(target, params))
    assert stat < _chi2_critical(df), f"chi2={stat:.1f} over {df} dof"


def test_calibration_stays_within_a_short_models_positions(tok):
    """GPT-2's positions are learned: a calibration past them would index out of its embedding."""
    from tests.conftest import gpt2, perturbed

    target = gpt2(len(tok), seed=0)
    target.config.n_positions = 8  # what max_positions reads; the embedding is longer, so check positions by hand
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2, auto_k_max=8))
    seen = []
    real = eng.target.forward
    eng.target.forward = lambda *a, **kw: (seen.append(int(kw["position_ids"].max()) if kw.get("position_ids") is not None
                                                        else None), real(*a, **kw))[1]
    costs = eng.policy.cost(2)
    assert len(costs.target) < 9 and costs.target_at(8) > 0
    assert max(p for p in seen if p is not None) < 8


def test_a_failed_calibration_falls_back_to_a_fixed_k_and_fails_no_request(pair, tok, caplog):
    """A calibration that ran out of memory raised out of every step: each request of the batch
    ended with an error, the fixed-k ones beside the auto ones, and the next step tried again."""
    from tests.test_engine import _hf_greedy

    arch, target, draft = pair
    calls = []

    def oom(batch):
        calls.append(batch)
        raise torch.OutOfMemoryError("calibrating")

    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=2, auto_seeded_k=3),
                     policy=SpeculationPolicy(8, oom, 2))
    prompts = [[5, 9, 14], [7, 3, 22, 8]]
    stats = []
    outs = eng.generate(prompts, [SamplingParams(max_tokens=12, num_speculative_tokens=k, ignore_eos=True) for k in (3, "auto")],
                        stats=stats)
    assert [o.token_ids for o in outs] == [_hf_greedy(target, p, 12) for p in prompts]
    assert len(calls) == 1 and {s.auto_k for s in stats} - {None} == {3} and "calibration failed" in caplog.text


def test_fork_keeps_the_settings_and_copes_with_a_larger_batch():
    p = SpeculationPolicy(8, lambda b: Costs(b * MS, [b * w * MS for w in range(1, 10)]), max_batch=2, prior_alpha=0.9)
    f = p.fork()
    assert f.mean_alpha == pytest.approx(0.9) and f._lock is p._lock
    assert f.cost(3).draft == pytest.approx(3 * MS)  # past max_batch: calibrated itself (ZeroDivisionError before)


def test_calibration_leaves_torchs_global_generator_alone(pair, tok):
    arch, target, draft = pair
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=2))
    torch.manual_seed(0)
    eng.policy.cost(2)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))


def test_the_loops_own_time_is_learned_and_favours_longer_steps():
    """A step's time outside the forwards (L) is measured and added to every k's cost: a large fixed
    cost per step is amortized over more tokens, so the choice drafts further than without it."""
    p = policy(1 * MS, LINEAR)
    assert p.choose(rows(8, 0.77)) == 1
    for _ in range(400):
        p.observe(8, 1, draft_seconds=1 * MS, target_seconds=20 * MS, loop_seconds=0.5, accepted=0, tested=0)
    assert p.overhead == pytest.approx(0.5, rel=1e-3)
    assert p.step_seconds(8, 1) == pytest.approx(1 * MS + 20 * MS + 0.5, rel=1e-3)
    assert p.choose(rows(8, 0.77)) > 1


def test_steps_that_test_no_draft_leave_the_acceptance_estimate_alone():
    """A step whose rows all sit at their last token tests no draft (a run of max_tokens=1 auto requests).
    Decayed anyway, the prior wore away: one accepted draft after 200 such steps read alpha 1.0 and the
    next row drafted the maximum, and after ~15k steps both counts sat at one subnormal, alpha 1.0 with no data."""
    ms = 1e-3
    widths = [10 * ms * (1 + 0.3 * w) for w in range(9)]  # a target forward over w+1 tokens per row

    def policy():
        return SpeculationPolicy(8, lambda b: Costs(1 * ms, widths))

    new_row = [RowView(True, 100, 0, 0)]
    fresh = policy()
    fresh.observe(1, 1, 1 * ms, 13 * ms, 0.0, accepted=1, tested=1)
    idle = policy()
    for _ in range(200):
        idle.observe(1, 0, 0.0, 10 * ms, 0.0, accepted=0, tested=0)
    idle.observe(1, 1, 1 * ms, 13 * ms, 0.0, accepted=1, tested=1)
    assert idle.mean_alpha == pytest.approx(fresh.mean_alpha) and fresh.mean_alpha < 0.7
    assert idle.choose(new_row) == fresh.choose(new_row)
