"""Loading and the serve config, from a review: values the config passed that failed in the replica (or
loaded wrongly without a word) are refused where they are given, naming the field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from deployments.config import parse_config
from osd_serve.loading import ModelConfig, adapter_dir_problem, attach_adapter, check_device
from osd_serve.service import model_paths
from tests.conftest import char_tokenizer, llama


def _adapter(path, layers: int, hidden: int = 32):
    from peft import LoraConfig, get_peft_model

    base = llama(len(char_tokenizer()), hidden=hidden, layers=layers, seed=1)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).save_pretrained(path)
    return str(path)


def test_device_strings_torch_refuses_are_refused_at_the_config():
    """\\d took "cuda:01" and non-ASCII digits; torch refused them in the replica, naming no setting."""
    for bad in ("cuda:01", "cuda:\u0661", "cuda:-1"):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            check_device(bad)
        with pytest.raises(ValueError, match="device"):
            parse_config({"device": bad})
    assert check_device("cuda:0") == "cuda:0" and check_device("cuda:10") == "cuda:10"


def test_a_peft_type_that_is_not_a_string_is_named(tmp_path):
    """A list raised TypeError (unhashable) past pydantic: a traceback at serve run."""
    path = _adapter(tmp_path / "a", layers=1)
    cfg = tmp_path / "a" / "adapter_config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"peft_type": ["LORA"]}))
    assert "has peft_type ['LORA'], whose adapters cannot be merged" in adapter_dir_problem(path)


def test_an_adapter_of_another_depth_is_refused_not_half_loaded(tmp_path):
    """peft loads non-strictly: an adapter trained on a deeper base of the same widths lost its extra layers'
    tensors without a word, and one of a shallower base left layers untouched with a warning only."""
    draft = lambda: llama(len(char_tokenizer()), hidden=32, layers=2, seed=1)  # noqa: E731
    deeper, shallower = _adapter(tmp_path / "deep", layers=4), _adapter(tmp_path / "shallow", layers=1)
    with pytest.raises(ValueError, match=r"'x' .* does not fit the draft: 8 of its tensors have no place in it \(e\.g\. .*layers\.[23]\."):
        attach_adapter(draft(), "x", deeper)
    with pytest.raises(ValueError, match=r"does not fit the draft: 0 of its tensors .* and 4 of the draft's adapter weights are not in it"):
        attach_adapter(draft(), "x", shallower)
    same_dir = _adapter(tmp_path / "same", layers=2)
    cfg = tmp_path / "same" / "adapter_config.json"  # as from_pretrained, served adapters never train
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"inference_mode": False}))
    same = attach_adapter(draft(), "x", same_dir)
    assert sum("lora_A" in n for n, _ in same.named_parameters()) == 4
    assert not any(p.requires_grad for p in same.parameters())
    wider = _adapter(tmp_path / "wide", layers=2, hidden=64)  # a real shape mismatch names the tensor, not peft's header line
    with pytest.raises(ValueError, match="does not fit the draft: size mismatch for .*lora_A"):
        attach_adapter(draft(), "x", wider)


def test_two_draft_adapters_are_refused(tmp_path):
    """peft loaded the second adapter but kept the first active: it was ignored without a word."""
    with pytest.raises(ValueError, match="draft_adapters: one draft takes one adapter, got 2 \\(a, b\\)"):
        ModelConfig(target="t", draft="d", device="cpu", draft_adapters={"a": "x", "b": "y"})


def test_a_model_that_is_neither_a_directory_nor_a_hub_id_is_refused_at_parse(tmp_path, monkeypatch):
    """A relative path written without ./ that is not there (or a name with a space) passed, and the replica
    blamed the Hub for it."""
    monkeypatch.chdir(tmp_path)
    for bad in ("models/llama/target", "my model", " "):
        with pytest.raises(ValueError, match=f"target: {bad!r} is neither a directory nor a hub id"):
            parse_config({"target": bad, "draft": "gpt2"})
    with pytest.raises(ValueError, match=r"\(Cannot have -- or \.\. in repo_id\)"):  # the reason whole
        parse_config({"target": "org/na--me", "draft": "gpt2"})
    assert parse_config({"target": "meta-llama/Llama-3.1-8B", "draft": "gpt2"}).target == "meta-llama/Llama-3.1-8B"
    (tmp_path / "models" / "llama" / "target").mkdir(parents=True)  # there after all: a local directory
    assert parse_config({"target": "models/llama/target", "draft": "gpt2"}).target == "models/llama/target"


def test_model_paths_are_expanded_for_every_loader(monkeypatch, tmp_path):
    """The Ray distill controller called from_pretrained on "~/models/d", which transformers reads as a bad hub id."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_paths(SimpleNamespace(target="~/t", draft="~/d")) == (str(tmp_path / "t"), str(tmp_path / "d"))
    assert model_paths(SimpleNamespace(target="org/t", draft="org/d")) == ("org/t", "org/d")


@pytest.mark.parametrize("name", ["controller.json", "ray_train", "replicas"])
def test_expert_names_that_collide_with_the_controllers_files_are_refused(name):
    """versions_dir/<app>/ holds controller.json, ray_train/ and replicas/ beside one folder per expert."""
    with pytest.raises(ValueError, match="experts.0.name"):
        parse_config({"experts": [{"name": name}], "default_expert": name})
