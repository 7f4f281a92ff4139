"""Loading edges: adapters the serve config accepted that failed in the replica, flash-attn chosen by
"auto" where it cannot run, and models without an embedding row for every token."""

from __future__ import annotations

import json

import pytest
import torch

from osd_serve.loading import ModelConfig, load_pair
from tests.conftest import char_tokenizer, llama


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    path = tmp_path_factory.mktemp("lora") / "expert"
    base = llama(len(char_tokenizer()), hidden=32, layers=1, seed=1)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(path)
    return path, lora


def test_an_expert_name_with_a_dot_takes_its_adapter(lora_dir):
    """The config allows "code.v2"; peft refuses a dot in an adapter name, and the replica failed to start."""
    from osd_serve.service import expert_draft

    path, lora = lora_dir
    merged = expert_draft(llama(len(char_tokenizer()), hidden=32, layers=1, seed=1), str(path), "code.v2")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, lora(ids).logits, atol=1e-5)


def test_a_prompt_tuning_adapter_is_refused_at_serve_run(tmp_path):
    """Its files are all there, so the config passed it; merge_and_unload then raised a bare AttributeError
    in the replica. The serve config's check now names the field and the adapter's type."""
    from peft import PromptTuningConfig, get_peft_model

    from deployments.config import parse_config
    from osd_serve.loading import adapter_dir_problem

    base = llama(len(char_tokenizer()), hidden=32, layers=1, seed=1)
    get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)).save_pretrained(tmp_path / "p")
    assert "has peft_type 'PROMPT_TUNING', whose adapters cannot be merged" in adapter_dir_problem(str(tmp_path / "p"))
    with pytest.raises(ValueError, match=r"experts\.0\.adapter.*PROMPT_TUNING"):
        parse_config({"experts": [{"name": "p", "adapter": str(tmp_path / "p")}], "default_expert": "p"})
    (tmp_path / "p" / "adapter_config.json").write_text("{not json")
    assert "unreadable adapter_config.json" in adapter_dir_problem(str(tmp_path / "p"))


def test_auto_attention_leaves_flash_attn_off_where_it_cannot_run(monkeypatch, tmp_path):
    """Where flash-attn imports, "auto" asked for it for every model: transformers refuses it for
    architectures without it (Bloom, CodeGen, ...), so those failed to load instead of taking SDPA or
    eager; and flash-attn computes in float16/bfloat16 only."""
    from transformers import BloomConfig, BloomForCausalLM, LlamaConfig

    from osd_serve import loading

    assert loading._takes_flash_attn(LlamaConfig(), torch.bfloat16)
    assert not loading._takes_flash_attn(LlamaConfig(), torch.float32)
    assert not loading._takes_flash_attn(BloomConfig(), torch.bfloat16)
    cfg = BloomConfig(vocab_size=32, hidden_size=32, n_layer=1, n_head=4)
    BloomForCausalLM(cfg).save_pretrained(tmp_path / "bloom")
    monkeypatch.setattr(loading, "attention_backend", lambda device, attn: "flash_attention_2")  # as on CUDA with flash-attn
    model = loading.load_model(str(tmp_path / "bloom"), "draft", torch.device("cpu"), torch.bfloat16)
    assert model.config._attn_implementation != "flash_attention_2"


@pytest.mark.parametrize("short", ["target", "draft"])
def test_a_model_short_of_embedding_rows_is_refused_at_load(tmp_path, short):
    """A target with fewer rows than its tokenizer has tokens refused ordinary prompts one request at a time
    ("token ids must be in [0, 63)"); a draft's missing ids were clamped to its last row, silently."""
    tok = char_tokenizer()
    for role in ("target", "draft"):
        rows = len(tok) - 20 if role == short else len(tok) + 3  # more rows than tokens (a padded vocabulary) is fine
        llama(rows, hidden=32, layers=1, seed=0).save_pretrained(tmp_path / role)
        tok.save_pretrained(tmp_path / role)
    why = f"{short} model has {len(tok) - 20} embedding rows, fewer than the {len(tok)} tokens of its tokenizer's vocabulary"
    with pytest.raises(ValueError, match=why):
        load_pair(ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), device="cpu"))
    from deployments.config import AppConfig
    from deployments.disagg import _load  # the disaggregated topology's verifier and draft pool load one model each

    with pytest.raises(ValueError, match=why):
        _load(AppConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), device="cpu"), short)


def test_a_padded_vocabulary_loads(tmp_path):
    tok = char_tokenizer()
    for role in ("target", "draft"):
        llama(len(tok) + 3, hidden=32, layers=1, seed=0).save_pretrained(tmp_path / role)
        tok.save_pretrained(tmp_path / role)
    target, draft, _ = load_pair(ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), device="cpu"))
    assert target.get_input_embeddings().weight.shape[0] == len(tok) + 3
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["vocab_size"] == len(tok) + 3


def test_added_special_tokens_past_the_embedding_load(tmp_path):
    """Gemma-3 1B has 262144 rows and 262145 tokens (<image_soft_token>), Llama-2 finetunes a <pad> past
    32000: such specials never occur in text, and those pairs serve. Only the base vocabulary needs rows."""
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    assert len(tok) == tok.vocab_size + 1
    for role in ("target", "draft"):
        llama(tok.vocab_size, hidden=32, layers=1, seed=0).save_pretrained(tmp_path / role)
        tok.save_pretrained(tmp_path / role)
    target, _, _ = load_pair(ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), device="cpu"))
    assert target.get_input_embeddings().weight.shape[0] == len(tok) - 1


@pytest.mark.parametrize("kind", ["IA3", "LOHA", "POLY"])
def test_weight_adapters_other_than_lora_still_merge(tmp_path, kind):
    """IA3, LoHa and the other types that merge serve as before; Poly raises NotImplementedError in
    merge_and_unload, so it is refused at serve run (it had failed the replica's start)."""
    import peft

    from osd_serve.loading import adapter_dir_problem
    from osd_serve.service import expert_draft

    config = {"IA3": peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
              "LOHA": peft.LoHaConfig(r=2, target_modules=["q_proj"], init_weights=False),
              "POLY": peft.PolyConfig(r=2, target_modules=["q_proj"], n_tasks=1)}[kind]
    made = peft.get_peft_model(llama(len(char_tokenizer()), hidden=32, layers=1, seed=1), config)
    made.save_pretrained(tmp_path / kind)
    if kind == "POLY":
        assert "has peft_type 'POLY', whose adapters cannot be merged" in adapter_dir_problem(str(tmp_path / kind))
        return
    assert adapter_dir_problem(str(tmp_path / kind)) is None
    merged = expert_draft(llama(len(char_tokenizer()), hidden=32, layers=1, seed=1), str(tmp_path / kind), "e")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, made(ids).logits, atol=1e-5)


def test_two_adapter_names_that_map_to_one_peft_name_are_refused(lora_dir):
    """peft refuses a dot, so "a.b" is attached as "a_b": after an "a_b" it replaced that one, silently."""
    from osd_serve.loading import attach_adapter

    path, _ = lora_dir
    draft = attach_adapter(llama(len(char_tokenizer()), hidden=32, layers=1, seed=1), "a_b", str(path))
    with pytest.raises(ValueError, match="already has an adapter named 'a_b'"):
        attach_adapter(draft, "a.b", str(path))
