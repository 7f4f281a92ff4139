"""Config edges: values that passed validation and failed later, in a replica or deep in torch."""

from __future__ import annotations

import pytest
import torch

from deployments.config import parse_config
from osd_serve.loading import ModelConfig


def test_an_adapter_without_its_config_is_refused_when_the_config_is_read(tmp_path):
    """adapter_model.safetensors alone passed `serve run`; peft then failed in every replica start
    ("Can't find 'adapter_config.json'"), reported as a LoRA that "does not fit the draft"."""
    from tests.conftest import llama
    from osd_serve.service import expert_draft

    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"experts\.1\.adapter: .*no adapter_config\.json"):
        parse_config({"experts": [{"name": "default"}, {"name": "sql", "adapter": str(tmp_path)}]})
    with pytest.raises(ValueError, match="adapter 'sql': .* has no adapter_config.json"):
        expert_draft(llama(8, hidden=32, layers=1), str(tmp_path), "sql")


def test_a_cuda_index_past_the_visible_devices_is_refused_at_config_time(monkeypatch):
    """device cuda:1 on a one-GPU process (every Ray replica with num_gpus 1 sees only cuda:0) passed the
    config and failed at model.to() after the weights loaded, with torch's "invalid device ordinal"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device 'cuda:1': this process sees 1 CUDA device"):
        ModelConfig(target="t", draft="d", device="cuda:1")
    assert ModelConfig(target="t", draft="d", device="cuda:0").device == "cuda:0"
    assert ModelConfig(target="t", draft="d", device="cuda").device == "cuda"


@pytest.mark.parametrize("args, field", [({"target": "", "draft": ""}, "target"),
                                         ({"distill": {"versions_dir": ""}}, r"distill\.versions_dir")])
def test_an_empty_path_is_refused_at_config_time(args, field):
    """target: "" validated, then loaded the replica's working directory ("no tokenizer files" at each
    start); versions_dir: "" put every process's versions in its own working directory."""
    with pytest.raises(ValueError, match=f"{field}: String should have at least 1 character"):
        parse_config(args)


def test_a_device_that_is_not_a_string_names_the_field():
    """ModelConfig(device=torch.device("cpu")) raised re's TypeError ("expected string or bytes-like
    object"), naming no field."""
    with pytest.raises(ValueError, match=r"device must be auto, cpu, cuda or cuda:N, got device\(type='cpu'\)"):
        ModelConfig(target="t", draft="d", device=torch.device("cpu"))
