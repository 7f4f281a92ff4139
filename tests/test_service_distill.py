"""A colocated service's local distillation set-up (SpecService without HTTP): a replaced replica
resumes its slot's versions, record_topk reaches the recorders, and /admin/experts shows a swap not yet applied."""

from __future__ import annotations

import asyncio
import copy

import pytest

from deployments.config import AppConfig
from osd_serve.config import SamplingParams
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed


def test_a_replica_that_replaces_another_resumes_its_versions(tok, tmp_path):
    """Local backend: a Ray Serve replica kept its versions under versions_dir/<replica id>; a restarted
    replica (new id) started again from version 0, and a killed one's directory stayed on disk for
    good. Now a replica holds a slot while it lives and the next one takes it over with its versions,
    unless the draft changed. Admin answers name the replica that acted."""
    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "mode": "full"}, wandb={"mode": "disabled"})
    draft = perturbed(target, 0.05)
    make = lambda tag, d=draft: SpecService(cfg, models=(target, copy.deepcopy(d), tok), replica_tag=tag,  # noqa: E731
                                            private_versions=True)
    first, second = make("r1"), make("r2")
    try:
        assert asyncio.run(first.admin_update("default"))["replica"] == "r1"
        assert asyncio.run(first.admin_experts())["replica"] == "r1"
        assert first.distillers["default"].store.root == tmp_path / "replicas" / "slot-0" / "default"
        assert second.distillers["default"].store.root == tmp_path / "replicas" / "slot-1" / "default"  # a live one's slot is not shared
        dist = first.distillers["default"]
        dist.store.publish(dist.trainer.serving_state(), {"reason": "as an update would"})
        published = dist.store.versions
        assert published == [0, 1]
    finally:
        first.close()
    third = make("r3")  # takes slot-0 over: serves and distils on from its current version
    try:
        assert third.distillers["default"].store.versions == published
        assert third.server.engines["default"].draft_version == published[-1]
    finally:
        third.close()
    other = make("r4", perturbed(target, 0.07, seed=5))  # a redeploy with another draft: slot-0's versions are not its own
    try:
        assert other.distillers["default"].store.versions == [0] and other.server.engines["default"].draft_version == 0
    finally:
        other.close()
        second.close()
    assert sorted(p.name for p in (tmp_path / "replicas").iterdir()) == ["slot-0", "slot-1"]


def test_record_topk_reaches_the_recorders(tok, tmp_path):
    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "record_topk": 8, "train_time_limit_s": 45},
                    wandb={"mode": "disabled"})
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    try:
        out = asyncio.run(_collect(svc.stream("default", "def f(x):", SamplingParams(max_tokens=8, temperature=0))))
        assert out and svc.server.engines["default"].recorder.cfg.topk == 8
        assert svc.distillers["default"].trainer.cfg.time_limit_s == 45  # the local backend's updates too
        recs = list(svc.distillers["default"].buffer.shard("default").records)
        assert recs and all(r.topk_ids is not None and r.probs.shape[-1] == 8 for r in recs)
    finally:
        svc.close()
    with pytest.raises(ValueError, match="record_topk"):
        AppConfig(distill={"record_topk": -1})


async def _collect(gen):
    return [d async for d in gen]


def test_admin_experts_shows_a_rollback_on_an_idle_replica(tok, tmp_path):
    """A swap applies at the next engine step: an idle replica's /admin/experts kept the old
    serving_version after a rollback (whose own answer gave the new one) until traffic came."""
    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "mode": "full"}, wandb={"mode": "disabled"})
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    try:
        eng, dist = svc.server.engines["default"], svc.distillers["default"]
        state = dist.trainer.serving_state()
        version = dist.store.publish(state, {"reason": "as an update would"})
        eng.swap_draft(state, version)
        assert asyncio.run(svc.admin_experts())["experts"]["default"]["serving_version"] == version == 1
        assert asyncio.run(svc.admin_rollback("default", None))["serving_version"] == 0
        assert asyncio.run(svc.admin_experts())["experts"]["default"]["serving_version"] == 0  # no step between
        asyncio.run(_collect(svc.stream("default", "x", SamplingParams(max_tokens=2, temperature=0))))
        assert eng.draft_version == 0 and eng.next_draft_version == 0
    finally:
        svc.close()


def _version_rows(svc) -> list[dict]:
    svc.telemetry.maybe_log(force=True)
    return [{k.split("/")[0]: v for k, v in r.items() if k.endswith("/default")} for r in svc.telemetry.recent()
            if "version/default" in r]


def test_a_rollback_is_one_event_row_whichever_backend(tok, tmp_path):
    """Colocated with ray_train (versions watched in the shared store), a rollback logged its row and then
    the watcher's swap of the same version logged another, where the local backend logs one. It is now
    swapped in by the rollback itself: one row, {version, rollback}, and the next poll has nothing to do."""
    from osd_serve.distill.versions import VersionStore

    target = llama(len(tok), seed=3)
    cfg = AppConfig(distill={"versions_dir": str(tmp_path), "backend": "ray_train"}, wandb={"mode": "disabled"})
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok), record_sink=lambda rec: None, versions_dir=tmp_path)
    try:
        eng = svc.server.engines["default"]
        trained = {n: t + 0.01 for n, t in eng.draft.state_dict().items()}
        assert VersionStore(tmp_path / "default").publish(trained, {"reason": "the controller"}) == 1
        svc.watcher.poll()
        assert asyncio.run(svc.admin_rollback("default", None))["serving_version"] == 0
        assert eng.next_draft_version == 0  # swapped in by the rollback, not at a later poll
        svc.watcher.poll()
        assert _version_rows(svc) == [{"version": 0}, {"version": 1}, {"version": 0, "rollback": 1}]
    finally:
        svc.close()
