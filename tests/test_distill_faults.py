"""Online distillation under faults: a failed update leaves nothing half-done, a record with a broken
distribution cannot stall distillation, and the reservoir buffer really keeps a uniform sample."""

from __future__ import annotations

import copy
import random
import tempfile
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import perturbed
from tests.test_distill import _prompts, models  # noqa: F401  (models: the same target and weak draft fixture)

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.distill.guard import GuardConfig
from osd_serve.distill.online import OnlineDistiller
from osd_serve.distill.recorder import RecordConfig, Recorder
from osd_serve.distill.replay import BufferConfig, ReplayBuffer, make_record
from osd_serve.distill.trainer import DistillTrainer, TrainConfig
from osd_serve.distill.versions import VersionStore, draft_fingerprint
from osd_serve.engine import SpecEngine

SP = SamplingParams(max_tokens=12, num_speculative_tokens=3)


def _distiller(models, tok, steps=4, record=None):
    target, weak = models
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    trainer = DistillTrainer(eng.draft, TrainConfig(mode="full", lr=3e-3, steps_per_update=steps))
    buffer = ReplayBuffer(BufferConfig(trigger_records=10**6))  # updates only when the test calls them
    return OnlineDistiller(eng, trainer, buffer, VersionStore(tempfile.mkdtemp()), GuardConfig(tolerance=1.0), record)


def test_a_failed_admin_update_reverts_the_student_and_is_recorded(models, tok):
    """Only the background loop reverted a failed update: an admin update that raised after some
    optimizer steps left the student half-trained (and its AdamW moments) for the next update, with
    no error and no entry in ``updates``."""
    dist = _distiller(models, tok)
    dist.engine.generate(_prompts(len(tok), 16, 1), SP)
    trainer, real = dist.trainer, dist.trainer.train
    published = {n: t.clone() for n, t in trainer._published.items()}

    def fails_after_three_steps(records, steps=None, progress=False):
        real(records, 3)
        raise RuntimeError("CUDA out of memory (simulated)")

    trainer.train = fails_after_three_steps
    with pytest.raises(RuntimeError, match="out of memory"):
        dist.update()
    drift = max(float((p.detach() - published[n]).abs().max()) for n, p in trainer.student.named_parameters() if n in published)
    assert drift == 0.0 and not trainer.optimizer.state
    assert "out of memory" in dist.error and not dist.training.is_set()
    assert len(dist.updates) == 1 and not dist.updates[0].published and dist.updates[0].reason.startswith("error:")
    assert dist.store.versions == [0] and dist.engine.draft_version == 0
    trainer.train = real
    assert dist.update().published  # the next update trains from the published draft and goes through


def test_a_record_with_a_non_finite_distribution_does_not_stall_distillation(models, tok):
    """A NaN in one record's target probabilities made every minibatch holding it step AdamW on a NaN
    loss: all weights NaN, and the guard refused every such update ("non-finite weights")."""
    dist = _distiller(models, tok, steps=8, record=RecordConfig("all"))
    dist.engine.generate(_prompts(len(tok), 24, 2), SP)
    shard = dist.buffer.shard("default")
    r = shard.records[5]
    shard.records[5] = make_record(r.prompt_ids, r.response_ids, r.positions,
                                   r.probs.float().index_fill(1, torch.tensor([7]), float("nan")))
    results = [dist.update() for _ in range(3)]
    assert all(u.published for u in results), [u.reason for u in results]
    assert dist.trainer.skipped_steps > 0  # the poisoned record was drawn, and its steps were skipped
    assert all(torch.isfinite(t).all() for t in dist.trainer.student.state_dict().values())


def test_the_recorder_keeps_no_position_whose_target_distribution_is_not_finite():
    """A target logit at inf (float16 overflow) serves greedily but has a NaN softmax: such a position
    must not reach the buffer, nor its NaN overlap the request's expected acceptance (which replay and
    W&B average over traces). One step of two rows, k = 2, every position kept (keep='all')."""
    records, traces = [], []
    rec = Recorder(RecordConfig("all"), on_finish=lambda r, t: (records.append(r), traces.append(t)))
    logits = torch.randn(2, 3, 8)  # [B, k+1, V]
    logits[0, 1, 5] = float("inf")  # row 0's second position overflowed
    p, q = torch.softmax(logits, -1), torch.softmax(torch.randn(2, 2, 8), -1)
    rec.observe_probs([("a", "default"), ("b", "default")], p, q, n_acc=[2, 2], k_rows=[2, 2], before=[0, 0],
                      versions=[0, 0])
    for rid in ("a", "b"):
        rec.finish(SimpleNamespace(request_id=rid, prompt_ids=[1, 2], output_ids=[3, 4, 5]))
    assert records[0].positions.tolist() == [0, 2] and records[1].positions.tolist() == [0, 1, 2]
    assert all(torch.isfinite(r.probs.float()).all() for r in records)
    overlap = torch.minimum(p[:, :2], q).sum(-1)  # [B, k]
    assert traces[0].expected_acceptance == pytest.approx(float(overlap[0, 0]))  # position 1 is not scored
    assert traces[1].expected_acceptance == pytest.approx(float(overlap[1].mean()))
    assert traces[0].greedy_acceptance == traces[1].greedy_acceptance == 1.0


def test_reservoir_keeps_a_uniform_sample_when_records_differ_in_size():
    """Records that fit into the space a larger victim left entered without the keep test, and a kept
    record larger than its victim pushed out the oldest: the oldest tenth of the stream was never kept."""
    rng = random.Random(0)
    stream = [make_record([1, 2, 3], list(range(5)), list(range(n)), torch.full((n, 8), 0.125))
              for n in (rng.randint(1, 9) for _ in range(200))]
    capacity = 20 * make_record([1, 2, 3], list(range(5)), list(range(5)), torch.full((5, 8), 0.125)).nbytes
    kept = [0] * len(stream)
    for trial in range(300):
        buf = ReplayBuffer(BufferConfig(max_bytes=capacity, eviction="reservoir", trigger_records=10**9, seed=trial))
        for r in stream:
            buf.add(r)
        held = {id(r) for r in buf.shard("default").records}
        for i, r in enumerate(stream):
            kept[i] += id(r) in held
        assert buf.shard("default").nbytes <= capacity
    oldest, newest = sum(kept[:40]), sum(kept[-40:])
    assert 0.75 < oldest / newest < 1.33, (oldest, newest)  # was 0 against ~2,400


def test_a_smaller_reservoir_drops_uniformly_chosen_records():
    stream = [make_record([1], [2], [0], torch.full((1, 4), 0.25)) for _ in range(100)]
    survivors = [0] * 100
    for trial in range(200):
        buf = ReplayBuffer(BufferConfig(max_bytes=100 * stream[0].nbytes, eviction="reservoir", seed=trial))
        for r in stream:
            buf.add(r)
        buf.reconfigure(BufferConfig(max_bytes=10 * stream[0].nbytes, eviction="reservoir"))
        held = {id(r) for r in buf.shard("default").records}
        assert len(held) == 10
        for i, r in enumerate(stream):
            survivors[i] += id(r) in held
    assert sum(survivors[:50]) > 0.7 * sum(survivors[50:])  # FIFO would keep only the newest ten


def test_a_drafts_fingerprint_survives_a_bfloat16_load_and_is_recorded_on_an_old_store(models, tok, tmp_path):
    """The fingerprint hashed float32 values, so the same draft loaded in bfloat16 (dtype auto on a GPU
    node) cleared its own versions; and a store from before fingerprints never got one, so a later
    redeploy with another draft resumed it."""
    target, weak = models
    state = weak.state_dict()
    assert draft_fingerprint(state) == draft_fingerprint({n: t.to(torch.bfloat16) for n, t in state.items()})
    assert draft_fingerprint(state) != draft_fingerprint(perturbed(target, 0.2, seed=9).state_dict())
    store = VersionStore(tmp_path)
    store.publish({n: t.clone() for n, t in state.items()}, {"reason": "initial draft"})  # no fingerprint
    store.publish({n: t.clone() for n, t in state.items()}, {"reason": "an update"})
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=2))
    OnlineDistiller(eng, DistillTrainer(eng.draft, TrainConfig(mode="full")), ReplayBuffer(), store)
    assert eng.draft_version == 1 and VersionStore(tmp_path).manifest["draft"] == draft_fingerprint(state)


@pytest.mark.parametrize("age", [float("nan"), float("inf"), 0.0])
def test_the_age_trigger_must_be_a_positive_finite_time(age):
    """A NaN age passed the `<= 0` check (replay --trigger-age-s nan), and the age trigger never fired."""
    with pytest.raises(ValueError, match="trigger_age_s"):
        BufferConfig(trigger_age_s=age)


def test_a_request_in_flight_holds_only_what_its_record_will():
    """With topk the recorder compresses each kept position as it comes (a [V] row per position made a
    long guard sample hold 32 MB for a 31 KB record), and the record is what compressing at the end
    gives; max_record_bytes caps what one request holds."""
    V, k, steps = 512, 3, 20
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(steps, k + 1, V) * 3, -1)  # [steps, k+1, V]
    q = torch.softmax(torch.randn(k, V), -1)[None]  # [1, k, V]

    def run(cfg):
        out = []
        rec = Recorder(cfg, on_finish=lambda r, t: out.append(r))
        for s in range(steps):  # every draft accepted: k+1 positions a step
            rec.observe_probs([("a", "default")], p[s][None], q, [k], [k], [s * (k + 1)], [0])
        held = rec.traces["a"].nbytes
        rec.finish(SimpleNamespace(request_id="a", prompt_ids=[1, 2], output_ids=[3] * steps * (k + 1)))
        return out[0], held

    r, held = run(RecordConfig("all", topk=8))
    want = make_record([1, 2], [3] * steps * (k + 1), list(range(steps * (k + 1))), p.reshape(-1, V), topk=8)
    assert torch.equal(r.probs, want.probs) and torch.equal(r.topk_ids, want.topk_ids) and torch.equal(r.rest_mass, want.rest_mass)
    assert held == steps * (k + 1) * (8 * 6 + 2) < V * 2 * 4  # the whole request held less than 4 full rows
    capped, held = run(RecordConfig("all", max_record_bytes=10 * V * 2))
    assert capped.positions.tolist() == list(range(10)) and held == 10 * V * 2  # the first 10 positions, no more


def test_lora_versions_keep_the_version_their_adapters_apply_over(tmp_path):
    """Pruning kept the newest keep_last versions and the current one's parent, and deleted the base a
    LoRA series applies over after a rollback: every kept adapter/ was a delta over lost weights."""
    store = VersionStore(tmp_path, keep_last=2)
    st = {"w": torch.zeros(2)}
    store.publish(st, {"reason": "initial draft"})  # v0
    store.publish(st, {"adapter_base_version": 0})  # v1
    store.rollback(1)
    for _ in range(3):  # a new LoRA series over v1
        store.publish(st, {"adapter_base_version": 1})
    assert store.versions == [0, 1, 3, 4] and torch.equal(store.load(1)["w"], st["w"])  # v0: always kept


def test_student_sampling_never_feeds_the_target_an_id_it_lacks(tok):
    """A draft padded wider than the target sampled ids past the target's vocabulary, and scoring them
    with the target raised IndexError in every student-sampled update."""
    from tests.conftest import llama

    target, draft = llama(len(tok), seed=0), llama(len(tok) + 64, seed=1)
    rec = make_record([5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], list(range(8)), torch.softmax(torch.randn(8, len(tok)), -1))
    tr = DistillTrainer(draft, TrainConfig(student_fraction=1.0, steps_per_update=1, batch_size=1), teacher=target, vocab=len(tok))
    torch.manual_seed(0)
    losses = tr.train([rec] * 2, steps=20)
    assert len(losses) == 20 and all(l == l for l in losses)  # noqa: E741  (no NaN)


def test_a_publish_that_dies_mid_way_leaves_every_listed_version_loadable(tmp_path, monkeypatch):
    """Pruning deleted versions before the manifest stopped listing them: a crash in between left the
    manifest naming a version without files. A killed publisher's temp directory is swept by the next."""
    store = VersionStore(tmp_path, keep_last=2)
    st = {"w": torch.zeros(2)}
    store.publish(st)  # v0
    store.publish(st)  # v1
    (tmp_path / ".tmp-vkilled").mkdir()  # a publisher killed while writing
    monkeypatch.setattr(store, "_write_manifest", lambda: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        store.publish(st)  # v2 prunes v0, then dies before its manifest is written
    again = VersionStore(tmp_path, keep_last=2)
    assert again.versions == [0, 1] and all(torch.equal(again.load(v)["w"], st["w"]) for v in again.versions)
    # The failed publish removed its own directory (test_distill_edges2), so its number is free again;
    # one a killed publisher left after its rename is not, and numbering goes above it.
    assert not (tmp_path / "v000002").exists() and again.publish(st) == 2 and not list(tmp_path.glob(".tmp-v*"))
    (tmp_path / "v000005").mkdir()
    assert again.publish(st) == 6


def test_a_failed_update_leaves_its_trigger_due_and_the_loop_backs_off_per_expert(models, tok, monkeypatch):
    """The trigger window closed before training: after a failed update (an OOM) the next one waited for
    trigger_records new records, or never at low traffic. Retried at once instead, a fault that repeats
    would train and fail every few seconds on the cores serving needs: its retries wait 5, 10, 20 ... s.
    Per expert: another expert's updates neither wait on it nor reset its wait."""
    from osd_serve.distill.replay import Backoff

    dist = _distiller(models, tok)
    dist.buffer.cfg.trigger_records = 8
    dist.engine.generate(_prompts(len(tok), 16, 1), SP)
    assert dist.due() == {"default": "size"}

    def oom(records, steps=None, progress=False):
        raise RuntimeError("CUDA out of memory (simulated)")

    dist.trainer.train = oom
    with pytest.raises(RuntimeError):
        dist.update("default", "size")
    assert dist.due() == {"default": "size"}  # still due: the loop retries it

    now, calls = [0.0], []

    def update(expert, why):
        calls.append((now[0], expert))
        if expert == "a":
            raise RuntimeError("CUDA out of memory (simulated)")

    dist.backoff = Backoff(clock=lambda: now[0])  # 5 s doubling to 300 s
    polls = iter([False] * 40)
    monkeypatch.setattr(dist, "due", lambda: {"a": "size", "b": "size"})
    monkeypatch.setattr(dist, "update", update)
    monkeypatch.setattr(dist, "_stop", SimpleNamespace(is_set=lambda: next(polls, True)))
    monkeypatch.setattr(dist, "_wake", SimpleNamespace(wait=lambda timeout: now.__setitem__(0, now[0] + 1.0),
                                                       clear=lambda: None))
    dist._loop()
    assert [t for t, e in calls if e == "a"] == [1.0, 6.0, 16.0, 36.0]
    assert [t for t, e in calls if e == "b"] == [float(t) for t in range(1, 41)]  # every poll, never held up


def test_a_late_clear_keeps_what_a_replica_of_the_same_draft_published(tmp_path, monkeypatch):
    """Two replicas of a new draft both saw the old draft's store. The first cleared it and published, and a
    version was trained from that; the second's clear, which checked outside the lock, then deleted both and
    restarted the numbering under watchers serving those numbers."""
    from osd_serve.distill.versions import VersionWatcher

    old, new = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    VersionStore(tmp_path / "e").publish(old, draft=draft_fingerprint(old))
    real_clear, raced = VersionStore.clear, []

    def clear_after_the_other_replica(self, unless_draft=None):
        if not raced:  # the first replica to clear: the other one gets in between its check and its clear
            raced.append(True)
            first = VersionWatcher(tmp_path, None, poll_s=3600)
            assert first.watch("e", lambda: new)[0] == 0
            first.close()
            trained = VersionStore(tmp_path / "e").publish({"w": torch.full((4,), 2.0)}, expect_current=0,
                                                           expect_draft=draft_fingerprint(new))
            assert trained == 1
        return real_clear(self) if unless_draft is None else real_clear(self, unless_draft)

    monkeypatch.setattr(VersionStore, "clear", clear_after_the_other_replica)
    second = VersionWatcher(tmp_path, None, poll_s=3600)
    version, state = second.watch("e", lambda: new)
    second.close()
    assert version == 1 and torch.equal(state["w"], torch.full((4,), 2.0))
    assert VersionStore(tmp_path / "e").versions == [0, 1]


def test_a_version_a_killed_publisher_left_unlisted_is_removed(tmp_path):
    """Killed between its rename and its manifest write (or before deleting what it pruned), a publisher
    left a whole draft's directory that no manifest lists, so no prune ever removed it."""
    store = VersionStore(tmp_path, keep_last=1)
    store.publish({"w": torch.zeros(4)})
    (tmp_path / "v000007").mkdir()  # the killed publisher's renamed version
    (tmp_path / "v000007" / "draft.safetensors").write_bytes(b"x" * 100)
    assert store.publish({"w": torch.ones(4)}) == 8  # numbered above it: no number goes back
    # v0 stays as v8's parent (the version a rollback goes to); the orphan goes
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000000", "v000008"] and store.versions == [0, 8]


def test_a_rollback_that_fails_building_the_student_changes_nothing(models, tok, monkeypatch):
    """The store's manifest moved first and the trainer's new student (a copy, an upcast, peft: out of
    memory on a GPU) was built after: a failure there left the store and the guard's copy on the old
    version while the engine served, and the trainer trained, the newer one; the next update then
    recorded the wrong parent."""
    dist = _distiller(models, tok)
    dist.engine.generate(_prompts(len(tok), 16, 1), SP)
    assert dist.update().published and dist.store.current == 1
    v1 = {n: t.clone() for n, t in dist.store.load(1).items()}
    serving_before = {n: t.clone() for n, t in dist.serving.state_dict().items()}
    real = dist.trainer.build_student

    def oom(state):
        raise RuntimeError("CUDA out of memory building the student (simulated)")

    monkeypatch.setattr(dist.trainer, "build_student", oom)
    with pytest.raises(RuntimeError, match="out of memory"):
        dist.rollback(0)
    assert dist.store.current == 1 and VersionStore(dist.store.root).current == 1  # in memory and on disk
    dist.engine._apply_swap()  # what the next step swaps in (the update's v1, nothing newer)
    assert dist.engine.draft_version == 1
    assert all(torch.equal(dist.engine.draft.state_dict()[n], t) for n, t in v1.items())
    assert all(torch.equal(dist.serving.state_dict()[n], t) for n, t in serving_before.items())
    monkeypatch.setattr(dist.trainer, "build_student", real)
    assert dist.rollback(0) == 0 and dist.store.current == 0
    dist.engine._apply_swap()
    assert dist.engine.draft_version == 0
    v0 = dist.store.load(0)
    assert all(torch.equal(dist.engine.draft.state_dict()[n], t) for n, t in v0.items())
    assert all(torch.equal(dist.serving.state_dict()[n], t) for n, t in v0.items())


def test_a_rollback_raced_by_another_writers_publish_changes_nothing(models, tok, monkeypatch):
    """rollback_target and make_current take the store's lock apart (the student is built between): a
    version another writer of the same store published in between was rolled over as if it were not
    there. The rollback now fails, naming it, and nothing changes."""
    dist = _distiller(models, tok)
    dist.engine.generate(_prompts(len(tok), 16, 1), SP)
    assert dist.update().published and dist.store.current == 1
    real = dist.trainer.build_student

    def meanwhile(state):
        other = VersionStore(dist.store.root)  # another process's handle on the same store
        other.publish(other.load(1), {"reason": "another writer"})
        return real(state)

    monkeypatch.setattr(dist.trainer, "build_student", meanwhile)
    with pytest.raises(ValueError, match="draft version 2 was published meanwhile"):
        dist.rollback(0)
    assert VersionStore(dist.store.root).current == 2
    dist.engine._apply_swap()
    assert dist.engine.draft_version == 1  # what it served; the watcher-less store's v2 is not swapped by a failed rollback
