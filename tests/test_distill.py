"""Online distillation: records at verification, the trainer moves the draft, the guard refuses
corrupted updates, versions are atomic, and swaps keep the output lossless under concurrency."""

from __future__ import annotations

import copy
import json
import math
import random
import tempfile
import threading
import time

import pytest
import torch
from tests.conftest import llama, perturbed

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.distill.guard import GuardConfig, check, evaluate, split_for_guard
from osd_serve.distill.online import OnlineDistiller
from osd_serve.distill.recorder import RecordConfig, Recorder
from osd_serve.distill.replay import RECORD_OVERHEAD, BufferConfig, ReplayBuffer, make_record
from osd_serve.distill.trainer import DistillTrainer, TrainConfig
from osd_serve.distill.versions import VersionStore, VersionWatcher
from osd_serve.engine import SpecEngine

N_TOK = 12


def _prompts(vocab, n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 10))] for _ in range(n)]


@pytest.fixture(scope="module")
def models(tok):
    target = llama(len(tok), seed=0)
    weak = perturbed(target, 0.2)  # a poor draft (alpha-hat ~0.1 on held-out): room to learn
    return target, weak


def _records(target, draft, tok, prompts, keep="all", topk=0, k=4):
    recs = []
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=8),
                     Recorder(RecordConfig(keep, topk), on_finish=lambda r, t: r is not None and recs.append(r)))
    outs = eng.generate(prompts, SamplingParams(max_tokens=N_TOK, num_speculative_tokens=k))
    return recs, outs


@torch.inference_mode()
def test_records_hold_the_targets_distribution_at_verified_positions(models, tok):
    target, weak = models
    prompts = _prompts(len(tok), 6, 0)
    recs, outs = _records(target, weak, tok, prompts, keep="all")
    by_prompt = {tuple(r.prompt_ids.tolist()): r for r in recs}
    for p, c in zip(prompts, outs):
        r = by_prompt[tuple(p)]
        assert r.response_ids.tolist() == c.token_ids
        assert r.positions.tolist() == list(range(len(c.token_ids)))  # every emitted token was verified
        logits = target(torch.tensor([p + c.token_ids])).logits[0]
        want = torch.softmax(logits[len(p) - 1 + r.positions], -1)  # raw, not the one-hot greedy verifies with
        assert torch.allclose(r.dense_probs(len(tok)), want, atol=2e-3)
    mism, outs = _records(target, weak, tok, prompts, keep="mismatch")
    # mismatch keeps exactly the corrected positions: one per step that rejected a draft token
    n_rejections = sum(min(1, c.proposed - c.accepted) for c in outs)  # at least one reject when any
    assert 0 < sum(len(r.positions) for r in mism) <= sum(len(c.token_ids) for c in outs)
    assert n_rejections > 0
    topk, _ = _records(target, weak, tok, prompts, keep="all", topk=4)
    data = lambda rs: sum(r.nbytes - RECORD_OVERHEAD for r in rs)  # noqa: E731  the tensors' bytes
    assert data(topk) < data(recs) / 3


def test_distillation_raises_heldout_expected_acceptance(models, tok):
    target, weak = models
    train, _ = _records(target, weak, tok, _prompts(len(tok), 32, 1))
    held, _ = _records(target, weak, tok, _prompts(len(tok), 12, 2))
    vocab = len(tok)
    before = evaluate(weak, held, vocab)
    tr = DistillTrainer(weak, TrainConfig(mode="full", lr=3e-3, batch_size=8))
    losses = tr.train(train, steps=60)
    after = evaluate(tr.student, held, vocab)
    assert losses[-1] < losses[0]
    assert after["expected_acceptance"] > before["expected_acceptance"] + 0.04, (before, after)
    assert torch.equal(next(weak.parameters()), next(weak.parameters()))  # serving copy untouched
    lora = DistillTrainer(weak, TrainConfig(mode="lora", lr=1e-2, batch_size=8))
    lora.train(train, steps=60)
    merged = copy.deepcopy(weak)
    merged.load_state_dict(lora.serving_state(), strict=False)
    assert evaluate(merged, held, vocab)["expected_acceptance"] > before["expected_acceptance"] + 0.03
    assert evaluate(merged, held, vocab)["expected_acceptance"] == pytest.approx(evaluate(lora.student, held, vocab)["expected_acceptance"], abs=1e-4)


def test_student_sampled_training_uses_the_target_and_moves_the_draft(models, tok):
    target, weak = models
    train, _ = _records(target, weak, tok, _prompts(len(tok), 16, 6))
    held, _ = _records(target, weak, tok, _prompts(len(tok), 12, 2))
    with pytest.raises(ValueError, match="teacher"):
        DistillTrainer(weak, TrainConfig(student_fraction=1.0))
    tr = DistillTrainer(weak, TrainConfig(lr=3e-3, student_fraction=1.0), teacher=target)
    tr.train(train, steps=40)
    before, after = evaluate(weak, held, len(tok)), evaluate(tr.student, held, len(tok))
    assert after["expected_acceptance"] > before["expected_acceptance"] + 0.03, (before, after)


def test_chunked_loss_path_trains_like_the_plain_one(models, tok):
    target, weak = models
    train, _ = _records(target, weak, tok, _prompts(len(tok), 8, 3))
    a = DistillTrainer(weak, TrainConfig(lr=1e-3, seed=1))
    b = DistillTrainer(weak, TrainConfig(lr=1e-3, seed=1, chunk_size=7))
    la, lb = a.train(train, steps=3), b.train(train, steps=3)
    assert la == pytest.approx(lb, rel=1e-4)


class _ShuffledTeacher(DistillTrainer):
    """A corrupted update: trained on the records with each teacher distribution permuted."""

    def train(self, records, steps=None, progress=False):
        g = torch.Generator().manual_seed(0)
        bad = []
        for r in records:
            perm = torch.randperm(r.probs.shape[-1], generator=g)
            bad.append(type(r)(r.prompt_ids, r.response_ids, r.positions, r.probs[:, perm]))
        return super().train(bad, steps=80)


class _NaNUpdate(DistillTrainer):
    def train(self, records, steps=None, progress=False):
        out = super().train(records, steps=1)
        with torch.no_grad():
            next(self.student.parameters()).view(-1)[0] = float("nan")
        return out


@pytest.mark.parametrize("bad", [_ShuffledTeacher, _NaNUpdate], ids=["shuffled-teacher", "nan-weights"])
def test_guard_refuses_a_corrupted_update(models, tok, tmp_path, bad):
    target, weak = models
    draft = perturbed(target, 0.02)  # a good draft: a corrupted update can only make it worse
    eng = SpecEngine(target, draft, tok)
    store = VersionStore(tmp_path / "v")
    dist = OnlineDistiller(eng, bad(draft, TrainConfig(lr=3e-3)), ReplayBuffer(), store, GuardConfig())
    eng.generate(_prompts(len(tok), 12, 4), SamplingParams(max_tokens=N_TOK, num_speculative_tokens=3))
    before = {n: t.clone() for n, t in draft.state_dict().items()}
    res = dist.update()
    assert res is not None and not res.published
    assert store.current == 0 and store.versions == [0] and eng.draft_version == 0
    eng.generate(_prompts(len(tok), 1, 5), SamplingParams(max_tokens=2))  # a step applies any pending swap
    assert all(torch.equal(before[n], t) for n, t in draft.state_dict().items())


def test_versions_are_atomic_pruned_and_roll_back(tmp_path, models):
    _, weak = models
    store = VersionStore(tmp_path, keep_last=2)
    states = [{n: t + i for n, t in weak.state_dict().items()} for i in range(4)]
    for i, s in enumerate(states):
        assert store.publish(s, {"i": i}) == i
    # v1 is pruned; v0, the draft as configured, is always kept: with full-weight versions (ray_train)
    # it went after keep_last, and `rollback?to=0` was a 404
    assert store.versions == [0, 2, 3] and store.current == 3
    assert not (tmp_path / "v000001").exists() and not list(tmp_path.glob(".tmp-*"))
    assert json.loads((tmp_path / "manifest.json").read_text())["current"] == 3
    v, st = store.rollback()
    assert v == 2 and VersionStore(tmp_path).current == 2  # the manifest on disk says so too
    assert all(torch.equal(st[n], states[2][n]) for n in st)
    with pytest.raises(KeyError):
        store.load(1)
    assert [p.suffix for p in (tmp_path / "v000002").iterdir() if p.is_file()] .count(".bin") == 0
    # v2's parent, v1, is pruned: a rollback without `to` says so (it was KeyError "not kept", a 404 naming
    # `to` that the admin call never sent), and changes nothing
    with pytest.raises(ValueError, match=r"^version 2 was trained from version 1, which is no longer kept \(kept: \[0, 2, 3\]\)"):
        store.rollback()
    assert store.current == 2
    for s in states:  # many publishes later, v0 is still there to go back to
        store.publish(s)
    assert store.versions == [0, 6, 7] and torch.equal(store.rollback(0)[1]["lm_head.weight"], states[0]["lm_head.weight"])


def test_a_rollback_then_an_update_keeps_the_known_good_version(tmp_path, models):
    """Roll back from a bad v2 to v0, train from v0 and publish v3: pruning by publish order deleted
    v0 (v3's parent), and the default rollback re-served the bad v2."""
    _, weak = models
    store = VersionStore(tmp_path, keep_last=3)
    states = [{n: t + i for n, t in weak.state_dict().items()} for i in range(5)]
    for i in range(3):
        store.publish(states[i])
    assert store.rollback(0)[0] == 0
    assert store.publish(states[3]) == 3 and store.parent(3) == 0
    assert 0 in store.versions and (tmp_path / "v000000").exists()
    v, st = store.rollback()  # back to what v3 was trained from
    assert v == 0 and torch.equal(st["lm_head.weight"], states[0]["lm_head.weight"])
    store.publish(states[4])  # v4, from v0
    assert store.versions == [0, 2, 3, 4] and store.rollback()[0] == 0
    with pytest.raises(ValueError, match="no older version"):
        store.rollback()  # v0 was published first: it has no parent


def test_watcher_swaps_in_what_another_process_publishes(tmp_path, models):
    """The ray_train backend's hot-swap path: a replica watches the shared store, the controller publishes."""
    _, weak = models
    base = {n: t.clone() for n, t in weak.state_dict().items()}
    applied, swaps = [], []
    w = VersionWatcher(tmp_path, lambda e, st, v: applied.append((e, v, st)), poll_s=3600,  # polled by hand
                       on_swap=lambda e, v: swaps.append(v))
    assert w.watch("sql", lambda: base) == (0, None)  # an empty store: the draft as configured is version 0
    w.poll()
    assert applied == []
    trained = {n: t + 1 for n, t in base.items()}
    assert VersionStore(tmp_path / "sql").publish(trained) == 1  # the controller, another process
    w.poll()
    assert [(e, v) for e, v, _ in applied] == [("sql", 1)] and torch.equal(applied[0][2]["lm_head.weight"], trained["lm_head.weight"])
    w.poll()
    assert len(applied) == 1  # once per version
    assert w.rollback("sql") == 0  # an admin rollback goes through the shared store, swapped in here at once...
    assert [(e, v) for e, v, _ in applied] == [("sql", 1), ("sql", 0)] and w.serving["sql"] == 0
    w.poll()
    assert len(applied) == 2 and swaps == [1]  # ...not again at the poll; the caller logs the rollback as its event
    other_replica = VersionWatcher(tmp_path, lambda e, st, v: applied.append((e, v, st)), poll_s=3600)
    other_replica.stores["sql"], other_replica.serving["sql"] = VersionStore(tmp_path / "sql"), 1
    other_replica.poll()
    assert [(e, v) for e, v, _ in applied][-1] == ("sql", 0)  # ...and every other watcher follows
    # A replica started later serves the store's current version from the start.
    late = VersionWatcher(tmp_path, None, poll_s=3600)
    v, st = late.watch("sql", lambda: base)
    assert v == 0 and torch.equal(st["lm_head.weight"], base["lm_head.weight"])
    # A candidate trained from version 1 is not published over the rollback to 0.
    assert VersionStore(tmp_path / "sql").publish(trained, expect_current=1) is None
    # Publishing after a rollback numbers on (2): v1 is still kept, and a rollback to it stays possible.
    assert VersionStore(tmp_path / "sql").publish(trained, expect_current=0) == 2
    # A redeploy with another draft of the same shapes does not serve the old draft's versions: the
    # store is cleared and the new draft is version 0 (it served the old one's current version before).
    other = {n: t * 2 for n, t in base.items()}
    redeployed = VersionWatcher(tmp_path, None, poll_s=3600)
    assert redeployed.watch("sql", lambda: other) == (0, None)
    assert torch.equal(VersionStore(tmp_path / "sql").load()["lm_head.weight"], other["lm_head.weight"])
    for x in (w, late, redeployed):
        x.close()


@pytest.fixture(scope="module")
def reference(models, tok):
    target, _ = models
    prompts = _prompts(len(tok), 24, 9)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    return prompts, refs


def test_swaps_under_concurrent_generation_stay_lossless(models, tok, reference):
    target, _ = models
    prompts, refs = reference
    draft = perturbed(target, 0.05)
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=5))
    candidates = [{n: t.clone() for n, t in perturbed(target, s, seed=i).state_dict().items()} for i, s in enumerate([0.01, 0.2, 0.0, 0.5])]
    stop, swaps = threading.Event(), [0]

    def swapper():  # publishes from another thread as fast as it can, like the trainer would
        while not stop.is_set():
            eng.swap_draft(candidates[swaps[0] % len(candidates)], swaps[0] + 1)
            swaps[0] += 1
            stop.wait(0.002)

    th = threading.Thread(target=swapper)
    th.start()
    try:
        outs = eng.generate(prompts, SamplingParams(max_tokens=20, num_speculative_tokens=4, ignore_eos=True))
    finally:
        stop.set()
        th.join()
    assert swaps[0] > 5 and eng.draft_version > 0
    assert [c.token_ids for c in outs] == refs


def test_swap_recomputes_the_draft_cache(models, tok, reference):
    """Swap a bad draft for the target's own weights mid-generation: every later step must accept
    all k (a draft cache left from the old weights would make it reject)."""
    target, _ = models
    prompts, refs = reference
    eng = SpecEngine(target, perturbed(target, 0.5), tok, EngineConfig(max_batch_size=8))
    params = SamplingParams(max_tokens=20, num_speculative_tokens=3, ignore_eos=True)
    reqs = eng.submit(prompts[:8], params)
    stats = []
    for _ in range(2):
        stats.append(eng.step()[1])
    eng.swap_draft({n: t.clone() for n, t in target.state_dict().items()}, 1)
    while eng.has_unfinished():
        _, st = eng.step()
        if st is not None:
            stats.append(st)
    assert sum(s.accepted for s in stats[:2]) < sum(s.proposed for s in stats[:2])
    assert all(s.accepted == s.proposed for s in stats[2:])
    assert [r.output_ids for r in reqs] == refs[:8]


def test_online_distiller_in_background_publishes_and_stays_lossless(models, tok, reference, tmp_path):
    target, weak = models
    prompts, refs = reference
    eng = SpecEngine(target, perturbed(target, 0.08), tok, EngineConfig(max_batch_size=4))
    trainer = DistillTrainer(eng.draft, TrainConfig(lr=2e-3, steps_per_update=4))
    dist = OnlineDistiller(eng, trainer, ReplayBuffer(BufferConfig(trigger_records=4)), VersionStore(tmp_path),
                           GuardConfig(tolerance=0.05))
    dist.start()
    try:
        outs = eng.generate(prompts + prompts, SamplingParams(max_tokens=20, num_speculative_tokens=4, ignore_eos=True))
    finally:
        dist.stop()
    assert [c.token_ids for c in outs] == refs + refs
    assert dist.updates, "no update ran"
    # "publishes": without one, the checks below would hold at version 0 with the initial draft
    assert any(u.published for u in dist.updates), [u.reason for u in dist.updates]
    # a version published after the last step is applied at the next one
    assert eng.generate([prompts[0]], SamplingParams(max_tokens=20, num_speculative_tokens=4, ignore_eos=True))[0].token_ids == refs[0]
    assert eng.draft_version == dist.store.current


@pytest.mark.parametrize("topk", [0, 4])
def test_a_draft_with_a_smaller_vocabulary_serves_and_distils(tok, topk):
    """A target whose embedding has rows the draft lacks (Qwen2.5-7B 152064, 0.5B 151936): ids only
    the target has reach the draft (a prompt here; a target may emit them too), yet serving stays the
    target's greedy decoding and distillation trains over the ids the draft has."""
    target = llama(len(tok) + 8, seed=0)
    draft = llama(len(tok), seed=1)
    prompts = [p + [len(tok) + 3] for p in _prompts(len(tok), 8, 11)]
    with torch.inference_mode():
        refs = []
        for p in prompts:
            ids = torch.tensor([p])
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOK, min_new_tokens=N_TOK, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    recs, outs = _records(target, draft, tok, prompts, topk=topk, k=3)
    assert [c.token_ids for c in outs] == refs
    if topk:  # a top-k record can hold ids the draft lacks (this random target rarely ranks them high)
        p = torch.zeros(1, len(tok) + 8)
        p[0, [2, len(tok) + 1, len(tok) + 7]] = torch.tensor([0.5, 0.3, 0.2])
        recs.append(make_record([1, 2], [3], [0], p, topk=topk))
    vocab = len(tok) + 8
    before = evaluate(draft, recs, vocab)
    # vocab: the target's (as replay passes) or, unset, the draft's own (as serving does)
    tr = DistillTrainer(draft, TrainConfig(mode="full", lr=3e-3, batch_size=8), vocab=None if topk else vocab)
    losses = tr.train(recs, steps=30)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    assert evaluate(tr.student, recs, vocab)["expected_acceptance"] > before["expected_acceptance"]


@torch.inference_mode()
def test_the_guard_scores_guard_samples_not_the_drafts_own_mistakes(tok):
    """keep='mismatch' records only positions where the serving draft was wrong: there its greedy
    agreement is 0 by construction, so a guard scoring those published a worse draft. Every fourth
    request is a guard sample that keeps every verified position; the guard scores only those."""
    target = llama(len(tok), seed=0)
    serving, worse = perturbed(target, 0.03, seed=1), perturbed(target, 0.035, seed=3)
    prompts = _prompts(len(tok), 32, 0)
    recs, outs = _records(target, serving, tok, prompts, keep="mismatch")
    _, worse_outs = _records(target, worse, tok, prompts, keep="mismatch")
    rate = lambda cs: sum(c.accepted for c in cs) / sum(c.proposed for c in cs)  # noqa: E731
    assert rate(worse_outs) < rate(outs) - 0.015  # the candidate really is worse on this traffic (0.122 < 0.145)
    guard = [r for r in recs if r.heldout]
    assert len(guard) == 8 and all(r.positions.tolist() == list(range(len(r.response_ids))) for r in guard)
    train, held = split_for_guard([r.heldout for r in recs], GuardConfig())
    assert [recs[i] for i in held] == guard and not set(train) & set(held)
    assert not check(worse, serving, guard, len(tok), GuardConfig()).publish
    # what the guard scored before: the newest records, the serving draft's mistakes only
    mistakes = [r for r in recs if not r.heldout][-8:]
    assert check(worse, serving, mistakes, len(tok), GuardConfig()).publish


def test_a_failed_update_is_reported_and_distillation_goes_on(models, tok, monkeypatch):
    """One exception in an update (an OOM, a full disk) ended the distiller thread for good, silently."""
    target, weak = models
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    trainer = DistillTrainer(eng.draft, TrainConfig(mode="full", lr=3e-3, steps_per_update=4))
    store = VersionStore(tempfile.mkdtemp())
    dist = OnlineDistiller(eng, trainer, ReplayBuffer(BufferConfig(trigger_records=4)), store, GuardConfig(tolerance=1.0))
    real, calls = trainer.train, []

    def flaky(records, steps=None, progress=False):
        calls.append(len(records))
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(records, steps, progress)

    monkeypatch.setattr(trainer, "train", flaky)
    from osd_serve.distill.replay import Backoff

    dist.backoff = Backoff(base_s=0.0)  # retried at the next wake, not 5 s later
    dist.start()
    try:
        deadline, i = time.time() + 120, 0
        while len(dist.updates) < 2 and time.time() < deadline:  # updates fire as records arrive
            eng.generate(_prompts(len(tok), 8, 10 + i), SamplingParams(max_tokens=N_TOK, num_speculative_tokens=3))
            i += 1
            time.sleep(0.2)
    finally:
        dist.stop()
    assert dist.updates[0].reason.startswith("error: RuntimeError('CUDA out of memory") and not dist.updates[0].published
    assert "out of memory" in dist.error
    assert len(dist.updates) >= 2 and dist.updates[1].published  # the next trigger trained and published


@torch.inference_mode()
def test_a_state_the_draft_cannot_take_fails_the_swap_not_the_next_step(models, tok):
    """A version of another draft (same names, other shapes: a stale versions_dir) was accepted, then
    failed the next step for every request in it, after half the tensors had been copied in."""
    target, weak = models
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    before = {n: t.clone() for n, t in eng.draft.state_dict().items()}
    bad = {n: torch.zeros(t.shape[0] + 1, *t.shape[1:]) if n.endswith("q_proj.weight") else t.clone()
           for n, t in before.items()}
    with pytest.raises(ValueError, match="shape"):
        eng.swap_draft(bad, 7)
    prompts = _prompts(len(tok), 4, 5)
    outs = eng.generate(prompts, SamplingParams(max_tokens=N_TOK, num_speculative_tokens=3))
    assert all(c.finish_reason == "length" for c in outs) and eng.draft_version == 0
    assert all(torch.equal(t, before[n]) for n, t in eng.draft.state_dict().items())


@torch.inference_mode()
def test_a_reset_engine_drops_the_recorders_requests(models, tok):
    target, weak = models
    rec = Recorder(RecordConfig("all"))
    eng = SpecEngine(target, weak, tok, EngineConfig(max_batch_size=8), rec)
    for p in _prompts(len(tok), 3, 6):
        eng.add_request(p, SamplingParams(max_tokens=N_TOK, num_speculative_tokens=3))
    eng.step()
    assert len(rec.traces) == 3 and all(t.probs and t.probs[0].dtype == torch.float16 for t in rec.traces.values())
    eng.reset()  # a step raised: these requests end with an error and never finish here
    assert rec.traces == {}


def test_a_draft_with_a_larger_padded_vocabulary_distils(tok):
    """A draft whose embedding is padded past the target's: serving cuts its logits to the target's
    ids; training and the guard must too (every training step failed on the width mismatch)."""
    target = llama(len(tok), seed=0)
    draft = llama(len(tok) + 5, seed=1)
    recs, outs = _records(target, draft, tok, _prompts(len(tok), 8, 12), k=3)
    assert recs and all(c.finish_reason in ("length", "stop") for c in outs)
    before = evaluate(draft, recs, len(tok) + 5)  # the draft's width, as the cluster controller passes
    for vocab in (None, len(tok)):  # unset (the cluster's Ray Train workers) and the target's (serving)
        tr = DistillTrainer(draft, TrainConfig(mode="full", lr=3e-3, batch_size=8), vocab=vocab)
        losses = tr.train(recs, steps=30)
        assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
        assert evaluate(tr.student, recs, len(tok) + 5)["expected_acceptance"] > before["expected_acceptance"]


@torch.inference_mode()
def test_a_restart_on_its_store_serves_and_trains_from_the_current_version(models, tok, tmp_path):
    """A distiller started on a store it published into before labelled the draft with the store's
    version while serving (and training from) the draft it was given."""
    target, weak = models
    store = VersionStore(tmp_path)
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    OnlineDistiller(eng, DistillTrainer(eng.draft, TrainConfig(mode="full")), ReplayBuffer(), store)
    trained = {n: t + 0.01 for n, t in weak.state_dict().items()}
    assert store.publish(trained) == 1
    eng2 = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    trainer = DistillTrainer(eng2.draft, TrainConfig(mode="full"))
    dist = OnlineDistiller(eng2, trainer, ReplayBuffer(), VersionStore(tmp_path))
    eng2.generate(_prompts(len(tok), 1, 5), SamplingParams(max_tokens=2))  # a step applies the swap
    assert eng2.draft_version == 1
    for got in (eng2.draft.state_dict(), dist.serving.state_dict(), trainer.serving_state()):
        assert all(torch.equal(got[n], trained[n]) for n in trained)


def test_lora_versions_name_the_weights_their_adapter_applies_over(models, tok, tmp_path):
    """After a rollback the student is a fresh LoRA on that version's merged weights: its adapters
    are deltas over that version, not over the draft as configured, and the meta must say so."""
    from osd_serve.loading import attach_adapter

    target, weak = models
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    trainer = DistillTrainer(eng.draft, TrainConfig(mode="lora", lr=1e-2, steps_per_update=4))
    store = VersionStore(tmp_path)
    dist = OnlineDistiller(eng, trainer, ReplayBuffer(), store, GuardConfig(tolerance=1.0))
    recs, _ = _records(target, weak, tok, _prompts(len(tok), 16, 3), keep="all")
    for r in recs:
        dist.buffer.add(r)
    assert dist.update().version == 1 and dist.update().version == 2
    dist.rollback(1)
    assert dist.update().version == 3
    assert [store.meta(v)["adapter_base_version"] for v in (1, 2, 3)] == [0, 0, 1]
    for v in (1, 2, 3):
        base = copy.deepcopy(weak)
        base.load_state_dict(store.load(store.meta(v)["adapter_base_version"]), strict=False)
        merged = attach_adapter(base, "v", str(store.path(v) / "adapter")).merge_and_unload().state_dict()
        want = store.load(v)
        assert max(float((merged[n] - want[n]).abs().max()) for n in want) < 1e-5
