"""The publish guard and the distiller's bookkeeping around it, found by mutation testing: a guard
whose greedy-agreement check or noise allowance is off, a held-out split of the wrong records, and a
distiller that compares against (or reverts to, or swaps in) the wrong weights after a publish, a
refusal, a failed write or a rollback. The tiny trained drafts make many such slips come out the same,
so the guard is given drafts whose scores are set by construction and the trainer a scripted outcome."""

from __future__ import annotations

import copy
import math
import tempfile
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import perturbed
from tests.test_distill import _prompts, models  # noqa: F401  (models: the shared target and weak draft)

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.distill.guard import GuardConfig, check, split_for_guard
from osd_serve.distill.online import OnlineDistiller
from osd_serve.distill.replay import BufferConfig, ReplayBuffer, make_record
from osd_serve.distill.trainer import DistillTrainer, TrainConfig
from osd_serve.distill.versions import VersionStore
from osd_serve.engine import SpecEngine

SP = SamplingParams(max_tokens=12, num_speculative_tokens=3)


# ---- the guard's numbers, on drafts whose distributions are given ------------------------------------
class _Table(torch.nn.Module):
    """A 'draft' whose logits at a position are a row picked by that position's input id: a record
    whose prompt is [i] is scored on row i, so each held-out position gets the distribution chosen."""

    def __init__(self, rows: list[list[float]]):
        super().__init__()
        self.emb = torch.nn.Embedding.from_pretrained(torch.tensor(rows).log(), freeze=False)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.emb(input_ids))


def _heldout(p: list[float], n: int) -> list:
    """n one-position records with the target distribution p, record i scored on the draft's row i."""
    return [make_record([i], [0], [0], torch.tensor([p])) for i in range(n)]


def _scores(rows, p):
    q, pt = torch.tensor(rows), torch.tensor(p)
    return float(torch.minimum(q, pt).sum(-1).mean()), float((q.argmax(-1) == pt.argmax()).float().mean())


def test_a_draft_whose_greedy_agreement_drops_is_refused_even_when_alpha_hat_rises():
    """alpha-hat is what sampled requests accept, greedy agreement what greedy ones do: a candidate
    that spreads its mass closer to the target's but ranks another id first is a worse draft for
    every greedy request. A guard that checked alpha-hat alone published it."""
    p = [0.5, 0.4, 0.1]
    serving = _Table([[0.9, 0.05, 0.05]] * 50)  # alpha-hat 0.6, greedy 1.0
    candidate = _Table([[0.45, 0.5, 0.05]] * 50)  # alpha-hat 0.9, greedy 0.0
    v = check(candidate, serving, _heldout(p, 50), 3, GuardConfig())
    assert v.candidate["expected_acceptance"] > v.serving["expected_acceptance"] + 0.25
    assert not v.publish and v.reason.startswith("greedy agreement"), v.reason


def test_the_greedy_agreement_allowance_is_one_standard_error_of_the_mean():
    """A drop within one standard error (sqrt(p(1-p)/n)) of the serving draft's greedy agreement is
    noise and publishes; one past it is a worse draft and is refused. An allowance of one standard
    deviation (without the /n) published a candidate that agreed on 80% of 400 positions against 90%."""
    p = [0.5, 0.3, 0.2]
    agree, disagree = [0.9, 0.05, 0.05], [0.05, 0.9, 0.05]
    serving = _Table([agree] * 360 + [disagree] * 40)  # greedy 0.90 over 400: one standard error 0.015
    exact, swapped = [0.5, 0.3, 0.2], [0.3, 0.5, 0.2]
    worse = _Table([exact] * 320 + [swapped] * 80)  # greedy 0.80, alpha-hat far higher (0.96)
    within = _Table([exact] * 356 + [swapped] * 44)  # greedy 0.89: 0.01 below, within the noise
    held = _heldout(p, 400)
    for draft, publish in ((worse, False), (within, True)):
        a, g = _scores(draft.emb.weight.exp().tolist(), p)
        assert a > _scores(serving.emb.weight.exp().tolist(), p)[0]  # alpha-hat never decides here
        v = check(draft, serving, held, 3, GuardConfig())
        assert v.publish is publish, (g, v.reason)
        assert v.candidate["greedy_agreement"] == pytest.approx(g) and v.serving["greedy_agreement"] == pytest.approx(0.9)


# ---- which records the guard holds out --------------------------------------------------------------
def test_the_guard_holds_out_the_newest_guard_samples_and_trains_on_the_older_ones():
    """The held-out slice is what the next requests will look like: the newest guard samples, as
    many as heldout_fraction of the records (here 10 of 40), and the older guard samples train."""
    flags = [i % 2 == 0 for i in range(40)]  # guard samples at 0, 2, ..., 38
    train, held = split_for_guard(flags, GuardConfig())
    assert held == list(range(20, 40, 2))
    assert train == [i for i in range(40) if i not in held] and {0, 2, 18} <= set(train)


def test_the_held_out_slice_is_capped_at_max_heldout():
    """A whole buffer's worth of guard samples would be stale, and each costs a draft forward per update."""
    train, held = split_for_guard([True] * 400, GuardConfig())
    assert held == list(range(368, 400)) and train == list(range(368))
    assert len(split_for_guard([True] * 400, GuardConfig(max_heldout=5))[1]) == 5


def test_records_that_would_all_be_held_out_leave_nothing_to_train_on():
    """When the guard samples wanted are every record, there is no update to make (None), not one
    that trains on nothing and reports a refusal."""
    assert split_for_guard([True, True], GuardConfig()) is None
    assert split_for_guard([True] * 3, GuardConfig(min_heldout=3)) is None
    assert split_for_guard([True] * 8, GuardConfig()) == (list(range(6)), [6, 7])


# ---- what the distiller compares against, reverts to and swaps in ------------------------------------
class _Scripted(DistillTrainer):
    """Each update 'trains' the student to the next state of ``script`` (one step): which candidate
    the guard is given is then known, whatever the tiny models would have learnt."""

    script: list

    def train(self, records, steps=None, progress=False):
        with torch.no_grad():
            self.student.load_state_dict(self.script.pop(0), strict=False)
        return [0.0]


def _state(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in b)


@pytest.fixture(scope="module")
def drafts(models):
    """Three drafts of the shared target, from worst to best on its traffic."""
    target, weak = models
    return _state(weak), _state(perturbed(target, 0.06, seed=2)), _state(perturbed(target, 0.02, seed=3))


def _scripted(models, tok, script, trigger_records=10**6):
    target, weak = models
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    trainer = _Scripted(eng.draft, TrainConfig(mode="full"))
    trainer.script = list(script)
    dist = OnlineDistiller(eng, trainer, ReplayBuffer(BufferConfig(trigger_records=trigger_records)),
                           VersionStore(tempfile.mkdtemp()), GuardConfig())
    eng.generate(_prompts(len(tok), 16, 21), SP)  # 16 records, 4 of them guard samples; no update runs
    return dist


def _serves(dist, state) -> bool:
    """The engine serves ``state`` once a step has applied any pending swap."""
    dist.engine.generate(_prompts(8, 1, 5), SamplingParams(max_tokens=2))
    return _same(dist.engine.draft.state_dict(), state)


def test_after_a_publish_the_guard_compares_with_the_published_draft_and_a_refusal_keeps_it(models, tok, drafts):
    """weak serves; an update publishes good (v1); the next candidate, mid, is better than weak but
    worse than good. The guard's copy of what serves must be good by then (a stale copy published mid
    over good), and the refused student must go back to good, the last published weights (not to
    weak, nor stay at mid), with the engine still serving good. The size trigger is spent by an update."""
    weak, mid, good = drafts
    dist = _scripted(models, tok, [good, mid], trigger_records=8)
    assert dist.due() == {"default": "size"}
    first = dist.update()
    assert first.published and first.version == 1 and dist.due() == {}
    second = dist.update()
    assert not second.published and second.reason.startswith("alpha-hat"), second.reason
    assert second.serving["expected_acceptance"] == pytest.approx(first.candidate["expected_acceptance"])
    assert _same(dist.serving.state_dict(), good) and _same(dist.trainer.serving_state(), good)
    assert dist.store.versions == [0, 1] and dist.store.current == 1 and _serves(dist, good)


def test_after_a_rollback_the_guard_and_the_student_start_from_the_version_rolled_back_to(models, tok, drafts):
    """good is published (v1) and rolled back to weak (v0). The student and the guard's copy must be
    weak again: a refused update then reverts to weak (not to good, published before the rollback),
    and mid, better than weak though worse than good, publishes as v2 with v0 as its parent."""
    weak, mid, good = drafts
    nan = {n: torch.full_like(t, math.nan) if t.is_floating_point() else t for n, t in good.items()}
    dist = _scripted(models, tok, [good, nan, mid])
    assert dist.update().published and dist.rollback() == 0
    assert _same(dist.trainer.serving_state(), weak) and _same(dist.serving.state_dict(), weak)
    refused = dist.update()
    assert not refused.published and refused.reason == "non-finite weights"
    assert _same(dist.trainer.serving_state(), weak)
    third = dist.update()
    assert third.published and third.version == 2 and dist.store.parent(2) == 0, third.reason
    assert _serves(dist, mid)


def test_a_version_that_could_not_be_written_is_never_served(models, tok, drafts, monkeypatch):
    """The store's write fails (a full disk): the engine must go on serving the last published draft,
    as version 0, and the student restart from it. A swap issued before the write served weights no
    version holds, which a restart or a rollback could never bring back."""
    weak, mid, good = drafts
    dist = _scripted(models, tok, [good])

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dist.store, "publish", full_disk)
    with pytest.raises(OSError, match="No space"):
        dist.update()
    assert "No space" in dist.error and dist.updates[-1].reason.startswith("error:")
    assert _serves(dist, weak) and dist.engine.draft_version == 0 and dist.store.versions == [0]
    assert _same(dist.trainer.serving_state(), weak) and _same(dist.serving.state_dict(), weak)


def test_guard_samples_a_published_update_trained_on_are_never_held_out_again(models, tok, drafts):
    """Of 4 guard samples, a cap of 2 holds out the newest 2 and the update trains on the older 2. Once
    it publishes, the draft that serves has fitted those 2, so a later split (here a raised cap, as a
    redeploy can bring) must not score the guard on them; a refused update trained nothing that lasts."""
    weak, mid, good = drafts
    nan = {n: torch.full_like(t, math.nan) if t.is_floating_point() else t for n, t in good.items()}
    dist = _scripted(models, tok, [nan, good, mid])
    dist.guard = GuardConfig(max_heldout=2)
    guard_samples = [r for r in dist.buffer.shard("default").records if r.heldout]
    assert len(guard_samples) == 4
    refused = dist.update()
    assert not refused.published and all(r.heldout for r in guard_samples)
    first = dist.update()
    assert first.published and first.heldout_records == 2
    assert [r.heldout for r in guard_samples] == [False, False, True, True]
    dist.guard = GuardConfig(max_heldout=4)
    second = dist.update()
    assert second.heldout_records == 2 and second.train_records == 14


def test_a_long_running_distiller_keeps_only_the_newest_update_results(models, tok, drafts, monkeypatch):
    """An update every few seconds for weeks: the distiller keeps the newest results, counts them all
    (/admin/experts), and on_update (telemetry, replay's full log) still sees every one."""
    monkeypatch.setattr(OnlineDistiller, "MAX_UPDATES_KEPT", 2)
    weak, mid, good = drafts
    dist = _scripted(models, tok, [mid, good, good])
    seen = []
    dist.on_update = seen.append
    results = [dist.update() for _ in range(3)]
    assert list(dist.updates) == results[1:] and seen == results and dist.n_updates == 3
