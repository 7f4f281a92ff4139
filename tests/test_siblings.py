"""A local-backend replica in a fresh versions slot starts from what its sibling replicas learned
(osd_serve/distill/siblings.py): a scale-up, or a rolling redeploy with a surge (max_surge_percent > 0), which
starts the new replica before the old one lets go of its slot. Before, it served the configured draft (version 0)
and learned everything again."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json

import torch

from deployments.config import AppConfig

from osd_serve.distill import online
from osd_serve.distill.guard import Verdict
from osd_serve.distill.siblings import newest_sibling
from osd_serve.distill.versions import VersionStore
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed
from tests.test_local_spill import PROMPTS, _make, _serve


def _published(monkeypatch):
    monkeypatch.setattr(online, "check", lambda *a, **k: Verdict(True, "published by the test", {}, {}))


def _update(svc) -> int:
    svc.distillers["default"].engine.recorder.cfg.guard_every = 1  # every record a guard sample: enough to split
    asyncio.run(_serve(svc, PROMPTS[:4]))
    res = asyncio.run(svc.admin_update("default"))
    assert res["published"], res
    return svc.distillers["default"].store.current


def _serving(svc):
    dist = svc.distillers["default"]
    return dist.store, dist.engine


@contextlib.contextmanager
def _replica(make, tag: str):
    """A replica (it claims the lowest free slot) for the with-block, closed after it (its slot let go)."""
    svc = make(tag)
    try:
        yield svc
    finally:
        svc.close()


@contextlib.contextmanager
def _learned(tok, tmp_path, monkeypatch, **distill):
    """(make, a): a replica in slot-0 that has published version 1, for the with-block; updates always publish."""
    _published(monkeypatch)
    make = _make(tok, tmp_path, **distill)
    with _replica(make, "a") as a:
        _update(a)
        yield make, a


def _same_weights(model, state) -> bool:
    have = model.state_dict()
    return all(torch.equal(have[n], t.to(have[n].dtype)) for n, t in state.items())


def test_a_replica_in_a_fresh_slot_starts_from_its_siblings_newest_version(tok, tmp_path, monkeypatch):
    with _learned(tok, tmp_path, monkeypatch) as (make, old):
        learned = old.distillers["default"].store.current
        want = VersionStore(tmp_path / "replicas" / "slot-0" / "default").load(learned)
        with _replica(make, "new") as new:  # a surge's or a scale-up's replica, started while the old one serves: slot-1
            store, engine = _serving(new)
            assert store.root.parent.name == "slot-1" and store.versions == [0, 1] and store.current == 1
            assert store.meta(1)["reason"] == "inherited" and store.meta(1)["from"] == f"slot-0 version {learned}"
            asyncio.run(_serve(new, PROMPTS[:1]))
            assert engine.draft_version == 1 and _same_weights(engine.draft, want)  # serves it, from its first request
            assert _same_weights(new.distillers["default"].serving, want)  # and guards against it
            assert store.parent(1) == 0  # a rollback reaches the configured draft
            seen = asyncio.run(new.admin_experts())["experts"]["default"]
            assert (seen["serving_version"], seen["inherited_from"]) == (1, f"slot-0 version {learned}")
            assert asyncio.run(old.admin_experts())["experts"]["default"]["inherited_from"] is None  # learned there


def test_a_restarted_replica_takes_a_newer_sibling_version_but_not_its_own_back(tok, tmp_path, monkeypatch):
    with _learned(tok, tmp_path, monkeypatch) as (make, a):
        make("b").close()  # slot-1: inherits slot-0's version 1
        newer = _update(a)  # slot-0 learns on while slot-1 is down
        with _replica(make, "b2") as b:  # slot-1 again: its own current is older than slot-0's
            store, engine = _serving(b)
            assert store.current == 2 and store.meta(2)["from"] == f"slot-0 version {newer}" and engine.draft_version == 2
    with _replica(make, "a2") as a:  # slot-0 again: slot-1's newest is its own version, under its own publish time
        store, _ = _serving(a)
        assert store.current == newer and "from" not in store.meta(newer)  # its own, not taken back as a copy


def test_a_rollback_is_not_undone_by_an_older_sibling_version(tok, tmp_path, monkeypatch):
    with _learned(tok, tmp_path, monkeypatch) as (make, _):
        with _replica(make, "b") as b:  # slot-1, inherited version 1
            asyncio.run(b.admin_rollback("default", 0))  # an operator went back to the configured draft
        with _replica(make, "b2") as b:
            assert _serving(b)[0].current == 0 and _serving(b)[1].draft_version == 0


def test_only_a_sibling_of_the_same_pair_and_draft_counts(tok, tmp_path, monkeypatch):
    with _learned(tok, tmp_path, monkeypatch) as (_, a):
        mine = tmp_path / "replicas" / "slot-1"
        pair = a.spill.writer.disk.pair()
        draft = VersionStore(tmp_path / "replicas" / "slot-0" / "default").manifest["draft"]
        assert newest_sibling(mine, "default", draft, None, pair) is not None
        assert newest_sibling(mine, "default", draft, None, [*pair[:2], "another target's weights"]) is None
        assert newest_sibling(mine, "default", "another draft", None, pair) is None
        assert newest_sibling(mine, "sql", draft, None, pair) is None  # an expert no sibling has
        assert newest_sibling(tmp_path / "replicas" / "slot-0", "default", draft, None, pair) is None  # itself
        (tmp_path / "replicas" / "slot-0" / "default" / "v000001" / "draft.safetensors").unlink()  # pruned meanwhile
        assert newest_sibling(mine, "default", draft, None, pair) is None


def test_a_siblings_later_rollback_is_followed(tok, tmp_path, monkeypatch):
    """Copied into every new slot, a version an operator rolled back on one replica came back from the others'."""
    with _learned(tok, tmp_path, monkeypatch) as (make, a):
        make("b").close()  # slot-1 took version 1
        asyncio.run(a.admin_rollback("default", 0))  # then the operator went back to the configured draft on slot-0
        with _replica(make, "c") as c:  # slot-1 again: its copy of version 1 is older than that choice
            store, engine = _serving(c)
            assert store.current == 0 and engine.draft_version == 0
        _update(a)  # slot-0 learns version 2, and goes back to version 1 (no longer the newest published)
        asyncio.run(a.admin_rollback("default", 1))
        with _replica(make, "d") as d:  # slot-1: slot-0's choice is the latest, not the newest number
            store, _ = _serving(d)
            assert store.meta(store.current)["from"] == "slot-0 version 1"


def test_a_version_learned_for_another_target_is_not_inherited(tok, tmp_path, monkeypatch):
    """A slot's versions outlive a change of its target (its records do not): the pair its .pair.json names
    is its new owner's, not the one a version learned from."""
    _published(monkeypatch)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "mode": "full", "trigger_records": 1000,
                             "trigger_age_s": 3600}, wandb={"mode": "disabled"})
    old_target = llama(len(tok), seed=3)
    draft, new_target = perturbed(old_target, 0.05), perturbed(old_target, 0.01, seed=5)

    def on(target):
        return lambda tag: SpecService(cfg, models=(target, copy.deepcopy(draft), tok), replica_tag=tag,
                                       private_versions=True)

    with _replica(on(old_target), "a") as a:
        _update(a)
    with _replica(on(new_target), "x") as x:  # the retrained target's replica takes slot-0 over, version 1 with it
        assert _serving(x)[0].current == 1
        with _replica(on(new_target), "y") as y:  # slot-1: version 1 was learned for the old target
            assert _serving(y)[0].versions == [0] and _serving(y)[1].draft_version == 0


def test_lora_updates_over_an_inherited_version_keep_it_as_their_base(tok, tmp_path, monkeypatch):
    """LoRA mode: a version's adapter is a delta over its base version, which pruning must keep."""
    with _learned(tok, tmp_path, monkeypatch, mode="lora", keep_versions=1) as (make, _):
        with _replica(make, "b") as b:  # slot-1: version 1, inherited as full weights
            store, _ = _serving(b)
            assert store.meta(1)["reason"] == "inherited"
            _update(b)
            _update(b)
            assert store.current == 3 and store.meta(3)["adapter_base_version"] == 1
            assert 1 in store.versions and torch.is_tensor(next(iter(store.load(1).values())))  # kept though keep_versions=1


def test_a_store_without_version_0_starts_when_a_sibling_rolled_back_to_it(tok, tmp_path, monkeypatch):
    """A store an older osd-serve pruned version 0 from could not follow a sibling's rollback to it: rollback(to=0)
    raised in the replica's constructor, at every restart (the sibling's choice stays on disk)."""
    with _learned(tok, tmp_path, monkeypatch) as (make, a):
        make("b").close()  # slot-1: versions [0, 1], 1 inherited
        make("b2").close()  # the inheritor restarted: nothing newer, no version added
        manifest = tmp_path / "replicas" / "slot-1" / "default" / "manifest.json"
        m = json.loads(manifest.read_text())
        assert m["versions"] == [0, 1]
        manifest.write_text(json.dumps({**m, "versions": [1], "parents": {"1": None}}))  # as old pruning left it
        asyncio.run(a.admin_rollback("default", 0))
        with _replica(make, "b3") as b:
            store, engine = _serving(b)
            assert store.current == 1 and engine.draft_version == 1  # its own, as before inheritance existed
