"""Behaviour of the lossless core that a mutation audit found untested: each test here fails on a
small change to engine.py / spec.py that the rest of the suite let through (the change is named in
the test's docstring where it is not obvious from it).

Every check is exact: the target's own greedy tokens (which greedy rows, top_k = 1 and a tiny top_p
must all reproduce), counts that must add up, or the arguments the engine hands its hooks."""

from __future__ import annotations

import copy

import pytest
import torch

import osd_serve.engine as engine_mod
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from tests.conftest import llama, perturbed
from tests.test_engine import _hf_greedy, _prompts

N_OUT = 12


@pytest.fixture(scope="module")
def models(tok):
    """(target, a draft that agrees often but not always): the rejection and residual paths both run."""
    target = llama(len(tok), seed=0)
    return target, perturbed(target, 0.015)


@pytest.fixture(scope="module")
def prompts(models):
    target, _ = models
    ps = _prompts(target.config.vocab_size, n=6, seed=5)
    return ps, [_hf_greedy(target, p, N_OUT) for p in ps]


def _params(k=3, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": N_OUT, "num_speculative_tokens": k, "ignore_eos": True, **kw})


# ---- per-row sampling parameters ------------------------------------------------------------------

def test_each_row_of_a_batch_keeps_its_own_temperature_top_k_and_top_p(models, tok, prompts):
    """Rows joining in one prefill get their own params, not the first row's. Greedy, top_k = 1 and a
    top_p that keeps only the most likely token all decode the target's greedy tokens exactly, so
    beside a plain temperature-1 row (first, whose params a mix-up would spread) each must still
    equal the target's own greedy decoding."""
    target, draft = models
    ps, refs = prompts
    params = [_params(temperature=1.0, seed=1), _params(), _params(temperature=1.0, top_k=1, seed=2),
              _params(temperature=1.0, top_p=1e-6, seed=3)]
    outs = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4)).generate(ps[:4], params)
    assert [o.token_ids for o in outs[1:]] == refs[1:4]
    assert outs[0].token_ids != refs[0]  # the sampled row really sampled (12 tokens at T=1)


# ---- abort --------------------------------------------------------------------------------------

def test_a_request_aborted_while_its_step_runs_gets_no_tokens_from_that_step(models, tok, prompts, monkeypatch):
    """The server aborts from another thread, which can land while a step is running: that step's
    tokens for the row are dropped and it ends as "abort", not with more output (or "length")."""
    target, draft = models
    ps, refs = prompts
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=3))
    reqs = eng.submit(ps[:3], _params())
    real, calls = engine_mod.speculative_step, []

    def step_then_abort(*args):
        calls.append(len(reqs[1].output_ids))
        if len(calls) == 2:
            eng.abort(reqs[1].request_id)  # mid-step, as the server's thread would
        return real(*args)

    monkeypatch.setattr(engine_mod, "speculative_step", step_then_abort)
    while eng.has_unfinished():
        eng.step()
    assert reqs[1].finish_reason == "abort" and len(reqs[1].output_ids) == calls[1] > 0
    assert reqs[1].output_ids == refs[1][: calls[1]]
    assert eng.finished["abort"] == 1 and [reqs[0].output_ids, reqs[2].output_ids] == [refs[0], refs[2]]


# ---- counts: per request and per step -------------------------------------------------------------

def test_per_request_counts_add_up_to_its_tokens(models, tok, prompts):
    """Each step emits a row's accepted drafts + 1 (max_tokens caps k, so nothing is cut here):
    len(token_ids) == accepted + steps exactly, and at batch 1 the steps' statistics are the
    request's own: proposed, accepted, and rejected (steps where a draft failed: what auto-k reads)."""
    target, draft = models
    ps, _ = prompts
    for bs in (1, 3):
        eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=bs))
        reqs, stats = eng.submit(ps[:3], _params(k=4)), []
        while eng.has_unfinished():
            stats.append(eng.step()[1])
        for r in reqs:
            assert len(r.output_ids) == r.accepted + r.steps == N_OUT
            assert r.accepted < r.proposed and 0 < r.rejected < r.steps  # partial acceptance: both paths ran
        if bs == 1:
            assert sum(s.proposed for s in stats) == sum(r.proposed for r in reqs)
            assert sum(s.accepted for s in stats) == sum(r.accepted for r in reqs)
            assert sum(s.rejected for s in stats) == sum(r.rejected for r in reqs)
            # one row: rejected says whether this step's draft failed somewhere
            assert all(s.rejected == (s.accepted < s.proposed) for s in stats)


def test_step_stats_count_positions_and_emitted_tokens_exactly(models, tok, prompts):
    """accepted_per_position[j] counts rows whose j-th draft was accepted (so they sum to accepted
    and never exceed proposed_per_position), and emitted counts the tokens that reached the outputs
    (a stop string cutting a step's tokens short included)."""
    target, draft = models
    ps, _ = prompts
    stats = []
    outs = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4)).generate(ps[:4], _params(k=4), stats=stats)
    assert any(0 < s.accepted < s.proposed for s in stats)
    for s in stats:
        assert sum(s.accepted_per_position) == s.accepted and sum(s.proposed_per_position) == s.proposed
        assert all(a <= p for a, p in zip(s.accepted_per_position, s.proposed_per_position))
        # a row tests its accepted drafts and the one rejected (if any): min(a + 1, k) positions
        assert sum(s.tested_per_position) == s.accepted + s.rejected
        assert all(a <= t <= p for a, t, p in zip(s.accepted_per_position, s.tested_per_position,
                                                  s.proposed_per_position))
    assert sum(s.emitted for s in stats) == sum(len(o.token_ids) for o in outs)
    # Draft == target: nothing is ever rejected; and a stop string inside a step's 9 tokens cuts them.
    eng = SpecEngine(target, target, tok)
    text = eng.generate([ps[0]], _params(k=8))[0].text
    stop = text[4:6]
    stats = []
    out = eng.generate([ps[0]], _params(k=8, stop=[stop]), stats=stats)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == text.find(stop) + 2 < 9
    assert [(s.rejected, s.alpha, s.emitted) for s in stats] == [(0, 1.0, len(out.token_ids))]


# ---- auto k -------------------------------------------------------------------------------------

def test_unseeded_sampled_and_greedy_auto_requests_take_the_policys_k(models, tok, prompts):
    """Only a SEEDED sampled "auto" request is pinned to auto_seeded_k (its output must not depend on
    the batch); unseeded sampled and greedy ones draft what the policy chooses each step."""
    from tests.test_auto_k import CyclingPolicy

    target, draft = models
    ps, _ = prompts
    params = [_params(k="auto", temperature=1.0), _params(k="auto"), _params(k="auto", temperature=1.0, seed=4)]
    for p in params:
        eng = SpecEngine(target, draft, tok, EngineConfig(auto_seeded_k=3), policy=CyclingPolicy(1))  # always k = 1
        stats = []
        out = eng.generate([ps[0]], p, stats=stats)[0]
        seeded = p.seed is not None
        assert all(s.auto_k == (None if seeded else 1) for s in stats)
        assert max(s.proposed for s in stats) == (3 if seeded else 1)
        assert len(out.token_ids) == N_OUT


def test_the_policy_sees_each_rows_real_k_and_learns_the_width_each_step_ran(models, tok, prompts):
    """The hooks between engine and SpeculationPolicy: choose() gets a fixed row's k for this step
    (capped by max_tokens) and an auto row's cap, and observe() the step's widest k (the width
    its forwards ran at, so its seconds calibrate the right cost)."""
    from tests.test_auto_k import CyclingPolicy

    class Recording(CyclingPolicy):
        def choose(self, rows):
            views.append([(r.auto, r.k) for r in rows])
            return super().choose(rows)

        def observe(self, batch, k, *args, **kwargs):
            observed.append(k)
            return super().observe(batch, k, *args, **kwargs)

    target, draft = models
    ps, _ = prompts
    views, observed, stats = [], [], []
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=2), policy=Recording(2))
    reqs = eng.submit(ps[:2], [_params(k=5, max_tokens=8), _params(k="auto")])
    while eng.has_unfinished():
        before = [len(r.output_ids) for r in reqs]
        stats.append(eng.step()[1])
        auto = (True, N_OUT - before[1] - 1)  # an auto row's cap: the most drafts max_tokens leaves use for
        fixed = [(False, min(5, 8 - before[0] - 1))] if len(views[-1]) == 2 else []  # until the k=5 row ends
        assert views[-1] == fixed + [auto]
    assert observed == [len(s.proposed_per_position) for s in stats if s.auto_k is not None]
    assert len(observed) > 2 and any(len(v) == 2 for v in views)


# ---- the draft cache after a swap ----------------------------------------------------------------

def test_a_swap_after_a_fully_accepted_step_refills_both_pending_tokens(models, tok, prompts):
    """After a step that accepted every draft a row has two tokens pending for the draft (the last
    draft, never fed, and the bonus). A swap rebuilds the draft cache without them (the survivor kept
    one of them in the cache as well: the draft then saw it twice). Draft == target before and after
    the swap, so every later draft must still be accepted."""
    target, _ = models
    ps, refs = prompts
    eng = SpecEngine(target, copy.deepcopy(target), tok, EngineConfig(max_batch_size=3))
    reqs = eng.submit(ps[:3], _params(k=3))
    first = eng.step()[1]
    assert first.accepted == first.proposed == 9 and bool((eng._rows.pending_n == 2).all())
    eng.swap_draft({n: t.clone() for n, t in target.state_dict().items()}, 1)
    stats = []
    while eng.has_unfinished():
        stats.append(eng.step()[1])
    assert all(s.accepted == s.proposed for s in stats) and eng.draft_version == 1
    assert [r.output_ids for r in reqs] == refs[:3]



# ---- stream ---------------------------------------------------------------------------------------

def test_stream_yields_the_finished_delta_of_a_request_that_ended_without_new_tokens(tok):
    """A row whose target logits were NaN ends as "error" with no token from that step: its last
    delta carries no text and no ids, only finished, and stream() must still yield it, or its
    consumer never learns the request ended."""
    from tests.test_engine_edges import BAD, _nan_after

    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.015)
    _nan_after(target, BAD)
    ends = {}
    for d in SpecEngine(target, draft, tok, EngineConfig(max_batch_size=2)).stream([[10, 20, 30], [10, 20, BAD]], _params()):
        if d.finished:
            ends[d.request_id] = (d.finish_reason, d.token_ids, d.text)
    assert sorted(ends.values())[0] == ("error", [], "") and len(ends) == 2



# ---- a narrower draft at any temperature ----------------------------------------------------------

def test_a_narrower_draft_gives_its_missing_ids_no_mass_at_the_highest_temperature():
    """fit_vocab pads a narrower draft's logits with -inf. Any finite pad (the survivor was -1e4) is
    flattened into real mass by a temperature the API accepts (anything finite in float32), and the
    draft then proposes ids its embedding lacks."""
    from osd_serve.spec import RowState, fit_vocab, row_probs

    b, narrow, vocab = 2, 40, 48
    raw = torch.randn(b, 1, narrow, generator=torch.Generator().manual_seed(0))  # [B, 1, V']
    rows = RowState(
        last=torch.zeros(b, dtype=torch.long), pending=torch.zeros(b, 2, dtype=torch.long),
        pending_n=torch.ones(b, dtype=torch.long), k=torch.ones(b, dtype=torch.long),
        temperature=torch.tensor([1e30, 3e38]), top_k=torch.zeros(b, dtype=torch.long), top_p=torch.ones(b),
    )
    SamplingParams(temperature=3e38).validate()  # a temperature the API takes
    q = row_probs(fit_vocab(raw, vocab), rows)  # [B, 1, V]
    assert (q[..., narrow:] == 0).all() and (q[..., :narrow] > 0).all()
