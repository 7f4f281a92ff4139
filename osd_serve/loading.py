"""Load a (target, draft) pair of Hugging Face causal LMs, by local directory or hub id."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str) -> str:
    """The device setting's form (ModelConfig and the serve app's config): auto, cpu, cuda or cuda:N."""
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device


@dataclass
class ModelConfig:
    target: str
    draft: str
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    # name -> directory of a peft LoRA adapter (adapter_config.json + adapter_model.safetensors)
    draft_adapters: dict[str, str] = field(default_factory=dict)
    attn_implementation: str = "auto"  # auto | flash_attention_2 | sdpa | eager
    cpu_packed_linear: bool = True  # on CPU, the target's linears on oneDNN prepacked weights and the skinny kernel (kernels/cpu_linear.py)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attn_implementation not in ("auto", "flash_attention_2", "sdpa", "eager"):
            raise ValueError(f"attn_implementation must be auto, flash_attention_2, sdpa or eager, got {self.attn_implementation!r}")
        check_device(self.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: CUDA is not available on this machine (torch {torch.__version__})")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def attention_backend(device: torch.device, requested: str = "auto") -> str:
    """flash-attention-2 on CUDA when flash_attn is importable, otherwise PyTorch SDPA."""
    if requested != "auto":
        if requested == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ValueError("attn_implementation flash_attention_2 needs flash-attn: pip install 'osd-serve[gpu]'")
        return requested
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _is_local(name: str) -> bool:
    return Path(name).expanduser().is_dir()


def _load_error(name: str, role: str, err: Exception) -> ValueError:
    if _is_local(name):
        return ValueError(f"{role} model directory {name!r} could not be loaded: {err}")
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached or has no such repo"
    return ValueError(
        f"{role} model {name!r} is not a local directory and could not be fetched ({why}). "
        f"Pass a local directory, or run `osd-serve bootstrap` for the embedded default pair."
    )


def load_tokenizer(name: str, role: str = "target"):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise _load_error(name, role, e) from e


def load_model(name: str, role: str, device: torch.device, dtype: torch.dtype, attn: str = "auto"):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attention_backend(device, attn))
    except (OSError, ValueError) as e:
        raise _load_error(name, role, e) from e
    return model.to(device).eval()


def max_positions(config) -> int:
    """The longest sequence a model's config allows (unbounded if it names no limit)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 1 << 30


def pair_limits(target: str, draft: str, max_model_len: int) -> tuple[int, int]:
    """(vocab, max_model_len) of a pair from its configs alone: what a process that runs neither model
    (the router, a draft-only replica) needs to validate prompts and size the draft's logits."""
    from transformers import AutoConfig

    t, d = AutoConfig.from_pretrained(target), AutoConfig.from_pretrained(draft)
    t, d = getattr(t, "text_config", t), getattr(d, "text_config", d)
    return t.vocab_size, min(max_model_len, max_positions(t), max_positions(d))


def check_same_vocab(target_tok, draft_tok) -> None:
    """Speculative decoding compares token ids: both models must use the same vocabulary."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        only_d = len(set(dv.items()) - set(tv.items()))
        raise ValueError(
            f"target and draft tokenizers do not share a vocabulary ({len(tv)} vs {len(dv)} tokens; "
            f"{only_t} target entries and {only_d} draft entries differ). Use a draft trained with the target's tokenizer."
        )


def attach_adapter(draft, name: str, path: str):
    """Attach a LoRA adapter to the draft with peft. safetensors only: a pickled adapter is refused
    (peft prefers adapter_model.safetensors when it exists, and we refuse directories without one)."""
    from peft import PeftModel

    p = Path(path)
    if not (p / "adapter_model.safetensors").is_file():
        raise ValueError(f"adapter {name!r} at {path!r} has no adapter_model.safetensors (pickled adapters are refused)")
    if isinstance(draft, PeftModel):
        draft.load_adapter(str(p), adapter_name=name)
        return draft
    return PeftModel.from_pretrained(draft, str(p), adapter_name=name).eval()


def pack_target(target, cfg: ModelConfig) -> int:
    """The target never trains, so on CPU its linear layers can keep a prepacked copy of their weights
    for oneDNN, which multiplies the 16-48-row inputs of a verification 1.1-2.3x faster than MKL's sgemm
    (kernels/cpu_linear.py); float32 calls of <= 48 rows take kernels/cpu_skinny.cpp on AVX-512. The draft
    does not: it is distilled, and every update would repack it."""
    if not cfg.cpu_packed_linear or cfg.resolved_device().type != "cpu":
        return 0
    from kernels.cpu_linear import pack_linears

    return pack_linears(target)


def load_pair(cfg: ModelConfig):
    """Returns (target, draft, tokenizer). Fails before anything is served if the pair is unusable."""
    device, dtype = cfg.resolved_device(), cfg.resolved_dtype()
    ttok, dtok = load_tokenizer(cfg.target, "target"), load_tokenizer(cfg.draft, "draft")
    check_same_vocab(ttok, dtok)
    target = load_model(cfg.target, "target", device, dtype, cfg.attn_implementation)
    pack_target(target, cfg)
    draft = load_model(cfg.draft, "draft", device, dtype, cfg.attn_implementation)
    for name, path in cfg.draft_adapters.items():
        draft = attach_adapter(draft, name, path)
    return target, draft, ttok
