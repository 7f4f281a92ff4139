"""The ray_train backend's publish guard runs in the Train job's rank-0 worker (train_job.guard_candidate),
on the capacity planned for the job. The controller used to load the draft twice per job and score both
on the CPUs serving uses (it is an actor with num_cpus=0)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("ray")

from deployments.train_job import guard_candidate  # noqa: E402
from tests.conftest import llama, perturbed  # noqa: E402
from tests.test_distill import _prompts, _records  # noqa: E402
from tests.test_distiller_mutants import _controller, _fill, draft_dir, plain_ray  # noqa: E402,F401  (fixtures)

GUARD = {"tolerance": 0.0, "heldout_fraction": 0.25, "min_heldout": 2, "max_heldout": 32}


@pytest.fixture(scope="module")
def pair(tok):
    target = llama(len(tok), seed=0)
    serving = perturbed(target, 0.2)
    held, _ = _records(target, serving, tok, _prompts(len(tok), 8, 3))
    return target, serving, held


def _state(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_the_worker_guard_publishes_a_better_candidate_and_leaves_serving_as_it_was(pair):
    target, serving, held = pair
    before = _state(serving)
    v = guard_candidate(serving, _state(target), held, GUARD, steps=3)  # the target itself: the best draft there is
    assert v["publish"] and v["reason"] == "ok" and v["device"] == "cpu"
    assert v["candidate"]["expected_acceptance"] > v["serving"]["expected_acceptance"] + 0.2
    assert v["candidate"]["positions"] == v["serving"]["positions"] == sum(len(r.positions) for r in held)
    assert all(torch.equal(before[n], t) for n, t in serving.state_dict().items())  # the job's draft, untouched


def test_the_worker_guard_refuses_worse_non_finite_and_untrained_candidates(pair):
    _, serving, held = pair
    worse = guard_candidate(serving, _state(perturbed(serving, 0.5, seed=7)), held, GUARD, steps=3)
    assert not worse["publish"] and worse["reason"].startswith("alpha-hat ")
    nan = {n: t.clone().fill_(math.nan) if t.is_floating_point() else t for n, t in _state(serving).items()}
    assert guard_candidate(serving, nan, held, GUARD, steps=3)["reason"] == "non-finite weights"
    assert not guard_candidate(serving, _state(serving), held, GUARD, steps=0)["publish"]


def test_the_controller_loads_no_draft_for_a_job(plain_ray, monkeypatch, tmp_path, draft_dir):  # noqa: F811
    """Only the first job of an expert with no version yet loads the draft, to publish it as version 0."""
    from transformers import AutoModelForCausalLM

    ctrl, trains, checks = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    loads = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: (loads.append(a), real(*a, **k))[1])
    for job in range(2):
        _fill(plain_ray, 12, heldout=4)
        event = ctrl._update("default", "size", {"num_workers": 1, "use_gpu": False})
        assert event["published"] and event["guarded_on"] == "cpu" and len(checks[job].held) == 2
        assert len(loads) == 1  # version 0's; before, two more per job (the serving draft and the candidate)
