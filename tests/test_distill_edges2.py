"""Distillation edge cases from a bug hunt: versions under a full disk, a damaged file or a power
loss; a reservoir emptied by a smaller bound; an update that trained nothing; bad trainer settings."""

from __future__ import annotations

import copy
import os
import tempfile
import threading

import pytest
import torch
from tests.test_distill import _prompts, models  # noqa: F401  (models: the shared target and weak draft)

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.distill.guard import GuardConfig
from osd_serve.distill.online import OnlineDistiller
from osd_serve.distill.recorder import RecordConfig
from osd_serve.distill.replay import BufferConfig, ReplayBuffer, make_record
from osd_serve.distill.trainer import DistillTrainer, TrainConfig
from osd_serve.distill.versions import VersionStore, VersionWatcher
from osd_serve.engine import SpecEngine


def _rec(vocab: int) -> object:
    return make_record([1, 2], [3, 4], [0], torch.softmax(torch.randn(1, vocab), -1))


def test_a_reservoir_emptied_by_a_smaller_bound_takes_records_again():
    """A redeploy that shrank the buffer below every record's size emptied the shard but left it
    'full': each new record was then kept with probability len(records)/seen = 0, for good."""
    buf = ReplayBuffer(BufferConfig(max_bytes=200_000, eviction="reservoir"))
    big = _rec(20000)
    for _ in range(2000):
        buf.add(big)  # ~43 kB each: the shard fills and turns to reservoir sampling
    small = _rec(100)  # ~3.3 kB (its data and its fixed cost as objects)
    buf.reconfigure(BufferConfig(max_bytes=8 * small.nbytes, eviction="reservoir"))
    shard = buf.shard("default")
    assert not shard.records
    kept = [buf.add(small) for _ in range(500)]
    # A uniform sample of the 500 keeps each later record with probability ~(held)/(offered so far):
    # ~25 of the last 480 expected. Dividing by the 2000 offered before the shrink kept none of them.
    assert kept[0] and sum(kept[20:]) >= 5 and shard.nbytes <= 8 * small.nbytes, sum(kept[20:])


def test_a_publish_whose_manifest_write_fails_leaves_no_version_behind(tmp_path, monkeypatch):
    """A full disk at the manifest write: the store object went on listing the version no reader
    saw (and /admin/experts showed it), and its directory, a whole draft, stayed on disk for good."""
    store = VersionStore(tmp_path, keep_last=5)
    st = {"w": torch.zeros(2)}
    store.publish(st)  # v0
    store.publish(st)  # v1
    with monkeypatch.context() as m:
        m.setattr(store, "_write_manifest", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        with pytest.raises(OSError, match="No space"):
            store.publish(st)
    assert store.versions == [0, 1] and store.current == 1 and store.parent(2) is None
    assert not store.path(2).exists()
    assert store.publish(st) == 2 and store.load(2)["w"].tolist() == [0.0, 0.0]
    # a failure inside the manifest write itself: its temporary file went on filling the full disk
    replace = os.replace
    with monkeypatch.context() as m:
        m.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(28, "No space left on device"))
                  if str(b).endswith("manifest.json") else replace(a, b))
        with pytest.raises(OSError, match="No space"):
            store.publish(st)
    assert store.versions == [0, 1, 2] and not list(tmp_path.glob(".manifest-*")) and not store.path(3).exists()


def test_every_file_of_a_version_reaches_the_disk_before_the_manifest_names_it(tmp_path, monkeypatch):
    """Nothing was fsynced: after a power loss the manifest could name a version whose
    draft.safetensors never left the page cache (empty), and a restart failed loading it."""
    store = VersionStore(tmp_path)
    events, fsync, replace = [], os.fsync, os.replace

    def rec_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def rec_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return replace(src, dst)

    monkeypatch.setattr(os, "fsync", rec_fsync)
    monkeypatch.setattr(os, "replace", rec_replace)
    store.publish({"w": torch.ones(3)}, adapter_writer=lambda d: (os.makedirs(d), open(os.path.join(d, "a.bin"), "wb").close()))
    version_move = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(store.path(0)))
    tmp = os.path.realpath(events[version_move][1])  # /proc's links name resolved paths
    synced = {e[1] for e in events[:version_move] if e[0] == "fsync"}
    assert {f"{tmp}/draft.safetensors", f"{tmp}/meta.json", f"{tmp}/adapter/a.bin", tmp} <= synced
    manifest_move = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith("manifest.json"))
    assert ("fsync", os.path.realpath(events[manifest_move][1])) in events[version_move:manifest_move]


def test_a_damaged_version_file_is_skipped_and_the_watch_goes_on(tmp_path):
    """safetensors raises its own SafetensorError (no OSError) on a damaged file: poll let it out,
    which ended the watch thread, and no later version was ever swapped in."""
    applied = []
    w = VersionWatcher(tmp_path, lambda e, s, v: applied.append((v, s["w"][0].item())), poll_s=3600)
    w.watch("default", lambda: {"w": torch.zeros(3)})
    other = VersionStore(tmp_path / "default")
    v1 = other.publish({"w": torch.ones(3)})
    (other.path(v1) / "draft.safetensors").write_bytes(b"\0" * 10)  # what a crash before fsync leaves
    w.poll()  # raised SafetensorError
    assert applied == [] and ("default", v1) in w.failed
    v2 = other.publish({"w": torch.full((3,), 2.0)})
    w.poll()
    assert applied == [(v2, 2.0)]
    w.close()


def test_a_version_read_before_its_expert_reloaded_is_not_swapped_into_it(tmp_path):
    """A draft pool evicts experts and loads them again (watch(), which gives the store's current version).
    A poll that was reading a version meanwhile swapped it in afterwards: the reloaded draft served an
    older version than the store's (a bad one an admin had just rolled back from, say) until a later poll."""
    applied = []
    w = VersionWatcher(tmp_path, lambda e, s, v: applied.append(v), poll_s=3600)
    w.watch("a", lambda: {"w": torch.zeros(3)})
    store = VersionStore(tmp_path / "a")
    store.publish({"w": torch.ones(3)})  # v1, bad
    read = w.stores["a"].load

    def reload_while_reading(v):
        state = read(v)
        store.rollback(0)  # the admin rolls the bad version back...
        assert w.watch("a", lambda: {"w": torch.zeros(3)})[0] == 0  # ...and the evicted expert loads again
        return state

    w.stores["a"].load = reload_while_reading
    w.poll()
    assert applied == [] and w.serving["a"] == 0
    w.poll()
    assert applied == []
    w.close()


def test_a_failing_swap_callback_does_not_end_the_watch_thread(tmp_path):
    """Any exception out of poll (on_swap's, here) ended the thread silently: no swap after it."""
    swapped, done = [], threading.Event()

    def on_swap(expert, v):
        swapped.append(v)
        if len(swapped) == 1:
            raise RuntimeError("telemetry down")
        done.set()

    w = VersionWatcher(tmp_path, lambda e, s, v: None, poll_s=0.01, on_swap=on_swap)
    w.watch("default", lambda: {"w": torch.zeros(3)})
    other = VersionStore(tmp_path / "default")
    other.publish({"w": torch.ones(3)})
    for _ in range(500):  # bounded: a watcher that never swaps fails below, not at pytest's timeout
        if swapped:
            break
        threading.Event().wait(0.01)
    assert swapped
    other.publish({"w": torch.full((3,), 2.0)})
    assert done.wait(5.0), swapped
    w.close()


def test_an_update_that_took_no_step_publishes_nothing(models, tok):
    """Every step skipped for a non-finite gradient left the candidate equal to the serving draft;
    the guard passed it as no worse and each such update published a copy, pushing the distinct
    versions a rollback needs out of keep_last (here the initial draft, after two)."""
    target, weak = models
    eng = SpecEngine(target, copy.deepcopy(weak), tok, EngineConfig(max_batch_size=8))
    trainer = DistillTrainer(eng.draft, TrainConfig(mode="full", lr=3e-3, steps_per_update=2))
    dist = OnlineDistiller(eng, trainer, ReplayBuffer(BufferConfig(trigger_records=10**6)),
                           VersionStore(tempfile.mkdtemp(), keep_last=2), GuardConfig(), RecordConfig("all"))
    eng.generate(_prompts(len(tok), 12, 1), SamplingParams(max_tokens=8, num_speculative_tokens=3))
    shard = dist.buffer.shard("default")
    for i, r in enumerate(shard.records):  # every training record broken; the guard samples intact
        if not r.heldout:
            shard.records[i] = make_record(r.prompt_ids, r.response_ids, r.positions, torch.full_like(r.probs.float(), float("nan")))
    results = [dist.update() for _ in range(3)]
    assert trainer.skipped_steps == 6 and not any(u.published for u in results)
    assert results[0].reason.startswith("no training step")
    assert dist.store.versions == [0] and eng.draft_version == 0


@pytest.mark.parametrize("field,value", [("max_grad_norm", 0.0), ("max_grad_norm", float("nan")), ("recent_window", 0)])
def test_train_settings_that_silently_break_training_are_refused(field, value):
    """max_grad_norm 0 clipped every gradient to zero (nothing trained), NaN made every weight NaN;
    recent_window 0 drew the 'recent' share from the whole buffer (records[-0:])."""
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})
    TrainConfig(max_grad_norm=float("inf"))  # no clipping stays allowed



def test_the_lora_adapter_starts_from_the_configured_seed_whatever_drew_before(models):
    """peft draws lora_A from the global RNG, so two data-parallel ranks built their adapters from
    whatever their processes had drawn before (their averaged gradients then moved different
    adapters). The seed fixes it, and building leaves the caller's RNG stream as it was."""
    _, draft = models

    def lora_a(seed, draws):
        torch.manual_seed(1234)
        torch.rand(draws)  # another user of the global RNG, before the trainer is built
        t = DistillTrainer(draft, TrainConfig(mode="lora", seed=seed))
        after = torch.rand(1)
        return [p.detach().clone() for n, p in t.student.named_parameters() if "lora_A" in n], after

    (a, after_a), (b, after_b), (c, _) = lora_a(0, 1), lora_a(0, 7), lora_a(1, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) > 0
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    torch.manual_seed(1234)
    torch.rand(1)
    assert torch.equal(after_a, torch.rand(1))  # the build drew nothing from the caller's stream


def test_a_rollback_during_a_polls_read_does_not_end_on_the_version_it_left(tmp_path):
    """A poll reading version 1 (a whole draft: seconds) while an admin rolled back to 0: the rollback swapped
    0 in, then the poll swapped 1 in over it, and the replica served the version rolled back from (and
    logged it) until its next poll. Swaps are one at a time: the rollback waits for the poll's."""
    import time

    applied = []
    w = VersionWatcher(tmp_path, lambda e, st, v: applied.append(v), poll_s=3600)
    assert w.watch("sql", lambda: {"w": torch.zeros(2)}) == (0, None)
    VersionStore(tmp_path / "sql").publish({"w": torch.ones(2)})  # v1, by the controller
    store, reading, release = w.stores["sql"], threading.Event(), threading.Event()
    real_load = store.load

    def slow_load(version=None):
        if threading.current_thread().name == "poll":
            reading.set()
            release.wait(10)
        return real_load(version)

    store.load = slow_load
    poll = threading.Thread(target=w.poll, name="poll")
    poll.start()
    assert reading.wait(10)  # the poll has read the manifest (v1 current) and is loading v1
    rollback = threading.Thread(target=lambda: w.rollback("sql", 0))
    rollback.start()
    time.sleep(0.3)  # unlocked, the rollback swapped 0 in here, before the poll's 1
    release.set()
    poll.join(10)
    rollback.join(10)
    assert applied == [1, 0] and w.serving["sql"] == 0 and store.current == 0


def test_a_rollback_this_replica_cannot_swap_in_changes_nothing(tmp_path):
    """A ray_train rollback moved the shared store first, then failed to swap the version in here: the
    admin got a 500 while every other replica followed the store to the version, and the controller trained
    on from it. Swapped in first, the refusal leaves the store where it was; a publish meanwhile is a 409,
    and this replica's next poll swaps the newer version in."""
    applied = []

    def apply(expert, state, v):
        if float(state["w"][0]) == 0.5:  # a version this draft refuses
            raise RuntimeError("size mismatch")
        applied.append(v)

    w = VersionWatcher(tmp_path, apply, poll_s=3600)
    w.watch("sql", lambda: {"w": torch.zeros(2)})
    store = VersionStore(tmp_path / "sql")
    store.publish({"w": torch.full((2,), 0.5)})  # v1, which this replica cannot take
    store.publish({"w": torch.ones(2)})  # v2, from v1
    w.poll()
    assert applied == [2] and w.serving["sql"] == 2
    with pytest.raises(RuntimeError, match="nothing changed, version 2 is still current"):
        w.rollback("sql", 1)
    assert store.refresh() == 2 and w.serving["sql"] == 2 and applied == [2]
    real_apply = w.apply

    def publish_meanwhile(expert, state, v):
        real_apply(expert, state, v)
        VersionStore(tmp_path / "sql").publish({"w": torch.full((2,), 3.0)})  # v3, by the controller

    w.apply = publish_meanwhile
    with pytest.raises(ValueError, match="published meanwhile"):
        w.rollback("sql", 0)
    w.apply = real_apply
    assert store.refresh() == 3 and applied == [2, 0]
    w.poll()
    assert applied == [2, 0, 3] and w.serving["sql"] == 3
    real_load = w.stores["sql"].load

    def pruned_meanwhile(version=None):  # a publish pruned it after this rollback read the manifest
        (store.path(version) / "draft.safetensors").unlink()
        return real_load(version)

    w.stores["sql"].load = pruned_meanwhile
    with pytest.raises(KeyError, match="not kept"):  # a 404, not a 500
        w.rollback("sql", 1)
    assert store.refresh() == 3 and w.serving["sql"] == 3
    w.close()
