"""What a step records, how the buffer holds and triggers on it, what the trainer optimises and which
expert a watched version goes to, found by mutation testing: each test here failed on a plausible
slip (the accepted positions kept instead of the corrected one, the age trigger counting from the
newest record, an oversized record evicting the shard, the newest records' recency share drawn from
the oldest, beta ignored, one expert's unreadable version blocking another's) that the existing
end-to-end tests passed, as the tiny models' outcomes came out the same."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import llama

from osd_serve.distill.losses import forward_kl, generalized_jsd, reverse_kl, total_variation
from osd_serve.distill.recorder import RecordConfig, Recorder
from osd_serve.distill.replay import BufferConfig, ReplayBuffer, make_record
from osd_serve.distill.trainer import DistillTrainer, TrainConfig
from osd_serve.distill.versions import VersionStore, VersionWatcher


# ---- the recorder -----------------------------------------------------------------------------------
def test_mismatch_keeps_the_corrected_position_and_traces_count_what_the_target_tested():
    """One step, k = 3, three requests: g (the first seen: a guard sample, every verified position
    kept), a (one draft token accepted, the second rejected) and b (all three accepted). keep='mismatch'
    keeps a's position 1, where the target corrected the draft, with the target's distribution there,
    and nothing of b (the draft was right everywhere). A trace counts the accepted positions and the
    first rejected one as tested, never the bonus token, and a finished trace holds no distributions."""
    V, k = 8, 3
    torch.manual_seed(0)
    p, q = torch.softmax(torch.randn(3, k + 1, V), -1), torch.softmax(torch.randn(3, k, V), -1)
    done = {}
    rec = Recorder(RecordConfig("mismatch", guard_every=1000), on_finish=lambda r, t: done.update({t.request_id: (r, t)}))
    rec.observe_probs([("g", "default"), ("a", "default"), ("b", "default")], p, q, n_acc=[3, 1, 3], k_rows=[k] * 3,
                      before=[0, 0, 0], versions=[0] * 3)
    for rid, n in (("g", 4), ("a", 2), ("b", 4)):
        rec.finish(SimpleNamespace(request_id=rid, prompt_ids=[1, 2], output_ids=[5] * n))
    (g, _), (a, ta), (b, tb) = done["g"], done["a"], done["b"]
    assert g.heldout and g.positions.tolist() == [0, 1, 2, 3]
    assert not a.heldout and a.positions.tolist() == [1] and torch.equal(a.probs[0], p[1, 1].half())
    assert b is None
    assert (ta.tested, ta.accepted, ta.emitted) == (2, 1, 2) and (tb.tested, tb.accepted, tb.emitted) == (3, 3, 4)
    assert tb.greedy_acceptance == 1.0 and ta.expected == pytest.approx(float(torch.minimum(p[1, :2], q[1, :2]).sum()))
    assert all(t.positions == [] and t.probs == [] and t.nbytes == 0 for _, t in done.values())


def test_guard_every_1_makes_every_request_a_guard_sample():
    """guard_every is 'every Nth request': at 1 every request is held out with all its positions."""
    out = []
    rec = Recorder(RecordConfig("mismatch", guard_every=1), on_finish=lambda r, t: out.append(r))
    p, q = torch.softmax(torch.randn(3, 3, 8), -1), torch.softmax(torch.randn(3, 2, 8), -1)
    rec.observe_probs([(f"r{i}", "default") for i in range(3)], p, q, [2, 0, 1], [2] * 3, [0] * 3, [0] * 3)
    for i in range(3):
        rec.finish(SimpleNamespace(request_id=f"r{i}", prompt_ids=[1], output_ids=[5] * 3))
    assert [r.heldout for r in out] == [True] * 3 and [r.positions.tolist() for r in out] == [[0, 1, 2], [0], [0, 1]]


def test_positions_a_stop_or_max_tokens_cut_off_are_not_recorded():
    """A step verifies k + 1 positions, but max_tokens (or a stop string) can end the request after
    the first few: a record must hold the target's distributions for the response it has, never for
    a token that was cut (it would train the draft to predict past the end of the response). Nor does
    the trace count the cut tokens as emitted: tokens per target forward is what was output."""
    out, traces = [], []
    rec = Recorder(RecordConfig("all"), on_finish=lambda r, t: (out.append(r), traces.append(t)))
    p, q = torch.softmax(torch.randn(1, 4, 8), -1), torch.softmax(torch.randn(1, 3, 8), -1)
    rec.observe_probs([("a", "default")], p, q, [3], [3], [0], [0])  # 4 positions verified
    rec.finish(SimpleNamespace(request_id="a", prompt_ids=[1], output_ids=[5, 6]))  # 2 kept by max_tokens
    assert out[0].positions.tolist() == [0, 1] and out[0].response_ids.tolist() == [5, 6]
    assert torch.equal(out[0].probs, p[0, :2].half())
    assert traces[0].summary()["tokens_per_target_forward"] == 2.0 and traces[0].greedy_acceptance == 1.0


# ---- the buffer -------------------------------------------------------------------------------------
def _rec(n: int = 2) -> object:
    return make_record([1, 2, 3], [4, 5, 6], list(range(n)), torch.full((n, 50), 0.02))


def test_the_age_trigger_counts_from_the_oldest_record_not_yet_trained_on():
    """A steady trickle of records (fewer than trigger_records) must not postpone the update for
    ever: the age is the oldest new record's. After an update the clock restarts at the next record."""
    buf = ReplayBuffer(BufferConfig(trigger_records=100, trigger_age_s=10.0))
    for t in (100.0, 104.0, 108.0):
        buf.add(_rec(), now=t)
    assert buf.due(now=109.9) == {} and buf.due(now=110.0) == {"default": "age"}
    buf.shard("default").mark_updated()
    assert buf.due(now=500.0) == {}  # nothing new since the update
    buf.add(_rec(), now=501.0)
    assert buf.due(now=510.0) == {} and buf.due(now=511.0) == {"default": "age"}


@pytest.mark.parametrize("eviction", ["fifo", "reservoir"])
def test_a_record_larger_than_the_shard_is_refused_and_evicts_nothing(eviction):
    """A record that can never fit (a long guard sample over a large vocabulary) must not empty the
    shard making room for it, nor be kept past the byte bound, nor count towards the size trigger."""
    size = _rec().nbytes
    buf = ReplayBuffer(BufferConfig(max_bytes=3 * size, eviction=eviction, trigger_records=4))
    held = [_rec() for _ in range(3)]
    for r in held:
        assert buf.add(r)
    assert not buf.add(_rec(200))  # 20 kB of distributions, over the 3 records' bound
    shard = buf.shard("default")
    assert list(shard.records) == held and buf.nbytes == 3 * size and shard.new_since_update == 3 and buf.due() == {}


# ---- the trainer ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft():
    return llama(40, seed=3)


def test_the_recent_share_of_a_minibatch_comes_from_the_newest_records(draft):
    """records are oldest first: recent_fraction of each minibatch must be drawn from the newest
    recent_window of them, which after a shift are the new domain's."""
    records = [_rec() for _ in range(30)]
    tr = DistillTrainer(draft, TrainConfig(batch_size=4, recent_fraction=0.5, recent_window=2))
    for _ in range(20):
        batch = [next(i for i, x in enumerate(records) if x is r) for r in tr._minibatch(records)]
        assert len(batch) == 4 and {28, 29} <= set(batch), batch


def _student_logits(model, rec):
    ids = torch.cat([rec.prompt_ids, rec.response_ids]).long()[None]
    return model(input_ids=ids).logits[0, len(rec.prompt_ids) - 1 + rec.positions]


@pytest.mark.parametrize("cfg,fn", [
    ({"loss": "forward_kl"}, forward_kl), ({"loss": "forward_kl", "chunk_size": 2}, forward_kl),
    ({"loss": "reverse_kl"}, reverse_kl), ({"loss": "tvd"}, total_variation),
    ({"loss": "jsd", "beta": 0.1}, functools.partial(generalized_jsd, beta=0.1)),
], ids=["forward_kl", "forward_kl-chunked", "reverse_kl", "tvd", "jsd-0.1"])
def test_the_trainer_optimises_the_configured_loss_at_the_kept_positions(draft, cfg, fn):
    """batch_loss is the configured loss (with its beta) between the draft's logits that predict the
    kept response tokens and the record's target distributions; a wider target row (ids the draft
    lacks) is cut to the draft's ids and renormalised (the fused path takes probabilities as given)."""
    g = torch.Generator().manual_seed(1)
    rec = make_record([5, 6, 7], [8, 9, 10, 11], [0, 2, 3], torch.softmax(torch.randn(3, 40, generator=g), -1))
    wide = make_record([5, 6], [8, 9], [1], torch.softmax(torch.randn(1, 48, generator=g), -1))
    tr = DistillTrainer(draft, TrainConfig(**cfg))
    with torch.no_grad():
        for r in (rec, wide):
            p = r.dense_probs(40)[:, :40]
            want = fn(_student_logits(tr.student, r), (p / p.sum(-1, keepdim=True)).log())
            assert float(tr.batch_loss([r])) == pytest.approx(float(want), rel=1e-4, abs=1e-6), (cfg, r is wide)


# ---- the version watcher ----------------------------------------------------------------------------
def test_an_unreadable_version_of_one_expert_does_not_block_the_same_number_of_another(tmp_path):
    """Experts have their own stores and numberings: a damaged v1 of expert a is skipped for a alone,
    and b's v1 is swapped into b, with b's weights."""
    applied = []
    w = VersionWatcher(tmp_path, lambda e, s, v: applied.append((e, v, s["w"][0].item())), poll_s=3600)
    for e in ("a", "b"):
        assert w.watch(e, lambda: {"w": torch.zeros(3)}) == (0, None)
    a, b = VersionStore(tmp_path / "a"), VersionStore(tmp_path / "b")
    assert a.publish({"w": torch.ones(3)}) == 1 and b.publish({"w": torch.full((3,), 2.0)}) == 1
    (a.path(1) / "draft.safetensors").write_bytes(b"\0" * 10)
    w.poll()
    assert applied == [("b", 1, 2.0)] and w.serving == {"a": 0, "b": 1} and w.failed == {("a", 1)}
    w.close()
