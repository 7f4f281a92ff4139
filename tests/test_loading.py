"""Loading through the real from_pretrained path, on tiny models saved in a temp dir."""

from __future__ import annotations

import json

import pytest
import torch

from osd_serve.config import SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.loading import ModelConfig, attention_backend, load_pair
from tests.conftest import char_tokenizer, llama


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("pair")
    target, draft = llama(len(tok), seed=0), llama(len(tok), hidden=32, layers=1, seed=1)
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root, target


def test_load_pair_from_directories(saved_pair):
    root, original = saved_pair
    target, draft, tok = load_pair(ModelConfig(target=str(root / "target"), draft=str(root / "draft"), device="cpu"))
    assert target.dtype == torch.float32 and target.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(target(ids).logits, original(ids).logits)
    out = SpecEngine(target, draft, tok).generate(["abc"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


def test_target_linears_packed_on_cpu_only_when_asked(saved_pair):
    """The frozen target gets oneDNN-prepacked linears (kernels/cpu_linear.py); the distilled draft never."""
    root, _ = saved_pair
    kinds = lambda m: {type(x).__name__ for x in m.modules() if isinstance(x, torch.nn.Linear)}  # noqa: E731
    target, draft, _ = load_pair(ModelConfig(target=str(root / "target"), draft=str(root / "draft"), device="cpu"))
    assert kinds(target) == {"PackedLinear"} and kinds(draft) == {"Linear"}
    target, _, _ = load_pair(ModelConfig(target=str(root / "target"), draft=str(root / "draft"), device="cpu",
                                         cpu_packed_linear=False))
    assert kinds(target) == {"Linear"}


def test_dtype_from_config(saved_pair):
    """draft_dtype auto follows the target's dtype, except float32 under a half-precision target on CPU."""
    root, _ = saved_pair
    pair = lambda **kw: load_pair(ModelConfig(target=str(root / "target"), draft=str(root / "draft"), device="cpu", **kw))  # noqa: E731
    target, draft, _ = pair(dtype="bfloat16")
    assert (target.dtype, draft.dtype) == (torch.bfloat16, torch.float32)
    target, draft, _ = pair(dtype="bfloat16", draft_dtype="bfloat16")
    assert (target.dtype, draft.dtype) == (torch.bfloat16, torch.bfloat16)
    target, draft, _ = pair()
    assert (target.dtype, draft.dtype) == (torch.float32, torch.float32)
    cfg = ModelConfig(target="t", draft="d", device="cpu", dtype="float16")
    assert cfg.resolved_draft_dtype() == torch.float32
    cfg.device = "cuda"  # where a GPU is (not checked past __post_init__): the draft keeps the target's dtype
    assert (cfg.resolved_dtype(), cfg.resolved_draft_dtype()) == (torch.float16, torch.float16)
    with pytest.raises(ValueError, match="draft_dtype must be one of"):
        ModelConfig(target="t", draft="d", device="cpu", draft_dtype="int8")
    # the app config reaches both topologies' loaders through service.model_config
    from deployments.config import AppConfig
    from osd_serve.service import model_config

    app = AppConfig(target=str(root / "target"), draft=str(root / "draft"), device="cpu", dtype="bfloat16", draft_dtype="bfloat16")
    assert model_config(app).resolved_draft_dtype() == torch.bfloat16
    assert model_config(app.model_copy(update={"draft_dtype": "auto"})).resolved_draft_dtype() == torch.float32


def test_unreachable_hub_id_is_named(saved_pair):
    root, _ = saved_pair
    with pytest.raises(ValueError, match="no-such-org/no-such-model"):
        load_pair(ModelConfig(target="no-such-org/no-such-model", draft=str(root / "draft"), device="cpu"))


def test_different_vocabularies_are_refused(saved_pair, tmp_path):
    root, _ = saved_pair
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    other = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    llama(3, hidden=32, layers=1).save_pretrained(tmp_path / "d")
    other.save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="do not share a vocabulary"):
        load_pair(ModelConfig(target=str(root / "target"), draft=str(tmp_path / "d"), device="cpu"))
    # The disaggregated replicas load each model alone, and never compared the tokenizers.
    pytest.importorskip("ray.serve")
    from deployments.config import AppConfig
    from deployments.disagg import _load

    cfg = AppConfig(target=str(root / "target"), draft=str(tmp_path / "d"), device="cpu", topology="disaggregated",
                    distill={"backend": "ray_train"})
    for role in ("target", "draft"):
        with pytest.raises(ValueError, match="do not share a vocabulary"):
            _load(cfg, role)


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(target="t", draft="d", dtype="float8")
    with pytest.raises(ValueError, match="attn_implementation"):
        ModelConfig(target="t", draft="d", attn_implementation="magic")


@pytest.mark.parametrize("flash_installed", [True, False])
def test_attention_backend_choice(monkeypatch, flash_installed):
    """The choice itself, on any machine (tests/test_cuda.py runs the chosen kernels on a GPU):
    flash-attention-2 on CUDA when flash_attn is importable, else SDPA (whose flash kernel CUDA picks)."""
    from osd_serve import loading

    monkeypatch.setattr(loading, "flash_attn_importable", lambda: flash_installed)
    assert attention_backend(torch.device("cuda")) == ("flash_attention_2" if flash_installed else "sdpa")
    assert attention_backend(torch.device("cpu")) == "sdpa"
    assert attention_backend(torch.device("cuda"), "sdpa") == "sdpa"  # an explicit choice wins
    with pytest.raises(ValueError, match="CUDA only"):  # flash-attn has no CPU kernels
        attention_backend(torch.device("cpu"), "flash_attention_2")
    if not flash_installed:
        with pytest.raises(ValueError, match="flash-attn"):
            attention_backend(torch.device("cuda"), "flash_attention_2")


def test_auto_attention_keeps_sliding_window_models_off_flash_attn(monkeypatch, tmp_path, tok):
    """Their window comes as a 4D mask over logical positions (kv.window_masks), which flash-attn does
    not take: where auto would pick flash_attention_2, a sliding-window model gets transformers' choice."""
    from transformers import MistralConfig, MistralForCausalLM

    from osd_serve import loading

    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    MistralForCausalLM(cfg).save_pretrained(tmp_path / "m")
    requested = []
    monkeypatch.setattr(loading, "attention_backend", lambda device, attn: requested.append(attn) or "flash_attention_2")
    model = loading.load_model(str(tmp_path / "m"), "target", torch.device("cpu"), torch.float32)
    assert requested == ["auto"] and model.config._attn_implementation == "sdpa"


def test_a_flash_attn_that_fails_to_import_is_not_chosen(monkeypatch, tmp_path):
    """A flash-attn wheel built against another torch is installed but fails to import (an undefined
    symbol): found on disk, it was chosen, and every model load then failed."""
    import sys

    from osd_serve import loading

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert loading.flash_attn_importable.__wrapped__() is False


def test_load_errors_name_the_model_and_keep_their_cause(saved_pair, tmp_path, monkeypatch):
    """Every way a pair fails to load is one ValueError naming the model (the CLI prints one line):
    truncated weights raised safetensors' own error; a draft directory without tokenizer files blamed
    missing packages; a cached hub model of an unknown architecture was reported as not fetched."""
    import shutil

    root, _ = saved_pair
    target = str(root / "target")
    cut = tmp_path / "cut"
    shutil.copytree(root / "draft", cut)
    w = cut / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"draft model directory '{cut}' could not be loaded"):
        load_pair(ModelConfig(target=target, draft=str(cut), device="cpu"))
    bare = tmp_path / "bare"
    llama(8, hidden=32, layers=1).save_pretrained(bare)
    with pytest.raises(ValueError, match="no tokenizer files.*copy the target's"):
        load_pair(ModelConfig(target=target, draft=str(bare), device="cpu"))
    from osd_serve.loading import _load_error

    err = _load_error("acme/new-arch", "draft", ValueError("model type brand_new_arch is not recognised"))
    assert "brand_new_arch" in str(err) and "fetched" not in str(err)
    err = _load_error("acme/gone", "draft", OSError("We couldn't connect to 'https://huggingface.co'"))
    assert "could not be fetched" in str(err) and "couldn't connect" in str(err)


def test_a_home_relative_path_is_a_directory(saved_pair, tmp_path, monkeypatch):
    """"~/models/target" exists, but transformers took it for a malformed hub id."""
    root, _ = saved_pair
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").symlink_to(root)
    from osd_serve.loading import pair_limits

    target, _, _ = load_pair(ModelConfig(target="~/models/target", draft="~/models/draft", device="cpu"))
    assert target.config.vocab_size == pair_limits("~/models/target", "~/models/draft", 64)[0]


def test_sampling_params_of_the_wrong_type_name_the_field():
    """A string or None compared with a number raised TypeError; True passed for an integer."""
    from osd_serve.config import EngineConfig

    for bad, field in (({"temperature": "0.7"}, "temperature"), ({"temperature": None}, "temperature"),
                       ({"top_p": "1"}, "top_p"), ({"max_tokens": True}, "max_tokens"),
                       ({"num_speculative_tokens": True}, "num_speculative_tokens"), ({"seed": False}, "seed")):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingParams(**bad)
    for bad, field in (({"max_batch_size": True}, "max_batch_size"), ({"compact_hole_fraction": None}, "compact_hole_fraction")):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            EngineConfig(**bad)


def test_lora_adapter_attaches_from_safetensors_and_pickle_is_refused(saved_pair, tmp_path):
    from peft import LoraConfig, get_peft_model

    root, _ = saved_pair
    base = llama(len(char_tokenizer()), hidden=32, layers=1, seed=1)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "expert")  # safetensors by default
    assert (tmp_path / "expert" / "adapter_model.safetensors").is_file()
    cfg = ModelConfig(target=str(root / "target"), draft=str(root / "draft"), device="cpu", draft_adapters={"code": str(tmp_path / "expert")})
    _, draft, _ = load_pair(cfg)
    assert "code" in draft.peft_config
    # A directory with only a pickled adapter is refused before torch.load can run.
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text(json.dumps(lora.peft_config["default"].to_dict(), default=list))
    torch.save({}, tmp_path / "pickled" / "adapter_model.bin")
    cfg.draft_adapters = {"bad": str(tmp_path / "pickled")}
    with pytest.raises(ValueError, match="safetensors"):
        load_pair(cfg)
    # An expert of the serve config: the base draft with the adapter merged in, the base untouched.
    from osd_serve.service import expert_draft

    plain = llama(len(char_tokenizer()), hidden=32, layers=1, seed=1)
    merged = expert_draft(plain, str(tmp_path / "expert"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, lora(ids).logits, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, plain(ids).logits, atol=1e-3)
    with pytest.raises(ValueError, match="safetensors"):
        expert_draft(plain, str(tmp_path / "pickled"))
    # Errors name the expert and say what is wrong: no such directory, or a LoRA of another base.
    with pytest.raises(ValueError, match="adapter 'sql': .* is not a directory"):
        expert_draft(plain, str(tmp_path / "missing"), "sql")
    wide = get_peft_model(llama(len(char_tokenizer()), hidden=64, layers=1), LoraConfig(r=4, target_modules=["q_proj"]))
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match="adapter 'sql' at .*wide' does not fit the draft"):
        expert_draft(plain, str(tmp_path / "wide"), "sql")
