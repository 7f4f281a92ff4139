"""A replica that runs on CUDA without reserving a GPU (ray_actor_options.num_gpus) is warned about:
Ray counts that GPU as free and puts other replicas and the distiller's training workers on it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

import ray  # noqa: E402
import ray.serve  # noqa: E402
import torch  # noqa: E402

from deployments.config import AppConfig, check_gpu_reservation  # noqa: E402


def _in_replica(monkeypatch, reserved: list) -> None:
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(app_name="osd"))
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: reserved)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)


def _warnings(caplog, device: str, deployment: str = "SpecServer") -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deployments.config"):
        check_gpu_reservation(AppConfig(device=device), deployment)
    return [r.getMessage() for r in caplog.records if r.name == "deployments.config"]


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_reserved_gpu_warns_naming_the_fix(monkeypatch, caplog, device):
    _in_replica(monkeypatch, [])
    (msg,) = _warnings(caplog, device, "Verifier")
    assert "reserved no GPU" in msg and "num_gpus" in msg and "Verifier's ray_actor_options" in msg
    assert repr(device) in msg


def test_auto_warns_only_where_it_resolves_to_cuda(monkeypatch, caplog):
    _in_replica(monkeypatch, [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _warnings(caplog, "auto") == []  # resolves to the CPU: nothing to reserve
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert len(_warnings(caplog, "auto")) == 1


def test_no_warning_with_a_reservation_on_cpu_or_outside_a_replica(monkeypatch, caplog):
    _in_replica(monkeypatch, [0])
    assert _warnings(caplog, "cuda") == []  # num_gpus given (a fraction also yields its GPU's id)
    _in_replica(monkeypatch, [])
    assert _warnings(caplog, "cpu") == []
    monkeypatch.undo()  # the real get_replica_context raises outside a replica: a script or a test
    assert _warnings(caplog, "cuda") == []


def test_a_stand_in_replica_context_never_starts_ray(monkeypatch, caplog):
    """Tests stand a replica context in for Serve's; asking Ray for the replica's GPUs there started a
    local Ray cluster (ray.get_gpu_ids initialises one), which a later ray.init with logical GPUs joined."""
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(app_name="osd"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: pytest.fail("asked Ray, which starts a cluster"))
    assert _warnings(caplog, "cuda") == []


def test_every_deployment_checks_before_loading(monkeypatch):
    """SpecServer, DraftPool and Verifier each check before their models load (a load takes minutes)."""
    import deployments.app as app
    import deployments.disagg as dd

    seen = []

    class Checked(Exception):
        pass

    def check(cfg, deployment):
        seen.append(deployment)
        raise Checked

    monkeypatch.setattr(app, "check_gpu_reservation", check)
    monkeypatch.setattr(dd, "check_gpu_reservation", check)
    import osd_serve.service as service

    monkeypatch.setattr(service, "model_config", lambda cfg: pytest.fail("loaded before the check"))
    cfg = AppConfig(distill={"enabled": False}).model_dump()
    with pytest.raises(Checked):
        app.SpecServer.func_or_class(cfg)
    for role in ("draft", "target"):
        with pytest.raises(Checked):
            dd._load(AppConfig(distill={"enabled": False}), role)
    assert seen == ["SpecServer", "DraftPool", "Verifier"]
