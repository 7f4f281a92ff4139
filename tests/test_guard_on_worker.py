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


def _run_worker(monkeypatch, tmp_path, serving, train, held, steps: int) -> tuple[dict, dict]:
    """train_job.train_loop_per_worker as rank 0 of 1, ray.train's context and report stubbed (no cluster):
    returns the metrics it reported and the state its checkpoint holds."""
    import ray
    import ray.train
    import ray.train.torch  # noqa: F401  imported before Checkpoint is stubbed: its annotations name it
    from safetensors.torch import load_file, save_file
    from types import SimpleNamespace

    from deployments.train_job import train_loop_per_worker

    serving.save_pretrained(tmp_path / "draft")
    save_file({n: t.clone() for n, t in serving.state_dict().items()}, str(tmp_path / "base.safetensors"))
    reported = []
    monkeypatch.setattr(ray, "get", lambda refs: list(refs))  # the refs are the records themselves here
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_world_rank=lambda: 0, get_world_size=lambda: 1))
    monkeypatch.setattr(ray.train, "Checkpoint", SimpleNamespace(from_directory=lambda d: d))
    monkeypatch.setattr(ray.train, "report", lambda m, checkpoint=None: reported.append((m, load_file(f"{checkpoint}/draft.safetensors"))))
    train_loop_per_worker({"record_refs": train, "draft_path": str(tmp_path / "draft"), "state_path": str(tmp_path / "base.safetensors"),
                           "train": {"lr": 3e-3}, "steps": steps, "use_gpu": False, "held_refs": held, "guard": GUARD})
    [(metrics, state)] = reported
    return metrics, state


def test_rank_0_guards_the_state_it_checkpoints_after_the_steps_it_took(pair, tok, tmp_path, monkeypatch):
    import copy

    from osd_serve.distill.guard import evaluate

    target, serving, held = pair
    train, _ = _records(target, serving, tok, _prompts(len(tok), 16, 4))
    metrics, state = _run_worker(monkeypatch, tmp_path, serving, train, held, steps=4)
    verdict, vocab = metrics["verdict"], len(tok)
    assert metrics["steps"] == 4 and verdict["device"] == "cpu"
    candidate = copy.deepcopy(serving)
    candidate.load_state_dict(state)
    # the guard scored the checkpointed state, against the draft the job started from
    assert verdict["candidate"]["expected_acceptance"] == pytest.approx(evaluate(candidate, held, vocab)["expected_acceptance"], abs=1e-6)
    assert verdict["serving"]["expected_acceptance"] == pytest.approx(evaluate(serving, held, vocab)["expected_acceptance"], abs=1e-6)
    # every gradient non-finite: the steps asked for (4) were all skipped, and the guard is told 0
    nan = [copy.copy(r) for r in train]
    for r in nan:
        r.probs = torch.full_like(r.probs, math.nan)
    untrained, _ = _run_worker(monkeypatch, tmp_path / "none", serving, nan, held, steps=4)
    assert untrained["steps"] == 0 and not untrained["verdict"]["publish"]  # the steps it took, not those asked for
    assert untrained["verdict"]["reason"].startswith("no training step taken")


def test_a_guard_that_raises_refuses_with_its_error(pair, tok, tmp_path, monkeypatch):
    """Failed, the job was retrained at every back-off: an out-of-memory guard failed every one for good."""
    import deployments.train_job as tj

    def oom(*a, **k):
        raise RuntimeError("CUDA out of memory")

    target, serving, held = pair
    monkeypatch.setattr(tj, "guard_candidate", oom)
    train, _ = _records(target, serving, tok, _prompts(len(tok), 4, 5))
    metrics, state = _run_worker(monkeypatch, tmp_path, serving, train, held, steps=1)
    assert not metrics["verdict"]["publish"] and "CUDA out of memory" in metrics["verdict"]["reason"] and state
