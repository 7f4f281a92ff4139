"""Load a (target, draft) pair of Hugging Face causal LMs, by local directory or hub id."""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str) -> str:
    """The device setting's form (ModelConfig and the serve app's config): auto, cpu, cuda or cuda:N."""
    # a torch.device (the Python API) raised re's TypeError, which named nothing
    # [0-9], no leading zero: torch refuses "cuda:01" and non-ASCII digits, which \d took, in the replica
    if not isinstance(device, str) or device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:(0|[1-9][0-9]*)", device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device


@dataclass
class ModelConfig:
    target: str
    draft: str
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    draft_dtype: str = "auto"  # auto: the target's, except float32 for a bfloat16/float16 target on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    # name -> directory of a peft LoRA adapter (adapter_config.json + adapter_model.safetensors)
    draft_adapters: dict[str, str] = field(default_factory=dict)
    attn_implementation: str = "auto"  # auto | flash_attention_2 | sdpa | eager
    cpu_packed_linear: bool = True  # on CPU, the target's linears on oneDNN prepacked weights and the skinny kernel (kernels/cpu_linear.py)

    def __post_init__(self) -> None:
        for name in ("dtype", "draft_dtype"):
            value = getattr(self, name)
            if value != "auto" and value not in DTYPES:
                raise ValueError(f"{name} must be one of auto, {', '.join(DTYPES)}, got {value!r}")
        if self.attn_implementation not in ("auto", "flash_attention_2", "sdpa", "eager"):
            raise ValueError(f"attn_implementation must be auto, flash_attention_2, sdpa or eager, got {self.attn_implementation!r}")
        check_device(self.device)
        if len(self.draft_adapters) > 1:  # peft loaded the second but kept the first active: one was ignored unsaid
            raise ValueError(f"draft_adapters: one draft takes one adapter, got {len(self.draft_adapters)} "
                             f"({', '.join(self.draft_adapters)}); serve several as the serve config's experts")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: CUDA is not available on this machine (torch {torch.__version__})")
        # cuda:N past the visible devices failed only at model.to(), after the weights loaded, with torch's
        # "invalid device ordinal". A Ray replica sees just its own GPUs (CUDA_VISIBLE_DEVICES): cuda:0 there.
        if self.device.startswith("cuda:") and int(self.device[5:]) >= (n := torch.cuda.device_count()):
            raise ValueError(f"device {self.device!r}: this process sees {n} CUDA device(s), cuda:0 to cuda:{n - 1}"
                             f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolved_draft_dtype(self) -> torch.dtype:
        """Why float32 under a half-precision target on CPU: a small model's forward there is mostly
        per-call work, and half precision adds to it (F.linear reorders a bfloat16 weight on every call,
        elementwise ops convert). Beside a bfloat16 target on the AMX host, the default and data pairs'
        drafts cost c = 0.15 of a target forward in bfloat16 and 0.11 in float32 at batch 1, and the
        engine ran 1.05-1.09x faster at batch 1 and 1.00-1.03x at batch 8 with the float32 draft
        (benchmarks/draft_dtype.py, results/draft_dtype_*_amx.json). A draft that streams its weights is
        the other way: the big random pair's 31M draft ran the engine 1.07x faster at batch 1 and 1.26x at
        batch 8 in bfloat16 (results/draft_dtype_big_random_pair_amx.json); two sizes do not place a
        threshold, so auto keeps float32 and such a draft sets draft_dtype. The target still verifies every
        token; only the proposals change (and with them a greedy output at the target's near-ties, and a
        seeded sample's exact tokens)."""
        if self.draft_dtype != "auto":
            return DTYPES[self.draft_dtype]
        dtype = self.resolved_dtype()
        if self.resolved_device().type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            return torch.float32
        return dtype


def expand(name: str) -> str:
    """A model or adapter given as ``~/...`` names a directory (no hub id starts with ``~``); transformers
    would take it for a malformed hub id. Every loader here expands what it is given."""
    return os.path.expanduser(name)


@functools.cache
def flash_attn_importable() -> bool:
    """Importable, not merely installed: a flash-attn wheel built against another torch is found on
    disk but fails to import (an undefined symbol), and must not be chosen."""
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def attention_backend(device: torch.device, requested: str = "auto") -> str:
    """flash-attention-2 on CUDA when flash_attn is importable, otherwise PyTorch SDPA."""
    if requested == "flash_attention_2":
        if device.type != "cuda":
            raise ValueError(f"attn_implementation flash_attention_2 runs on CUDA only, not on {device}")
        if not flash_attn_importable():
            raise ValueError("attn_implementation flash_attention_2 needs an importable flash-attn: pip install 'osd-serve[gpu]'")
    if requested != "auto":
        return requested
    return "flash_attention_2" if device.type == "cuda" and flash_attn_importable() else "sdpa"


def _is_local(name: str) -> bool:
    return Path(name).expanduser().is_dir()


def not_a_hub_id(name: str) -> str | None:
    """Why ``name`` cannot be a Hugging Face Hub id (huggingface_hub's own rule), or None if it can be."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        return str(e).split(": '")[0].rstrip(".")  # its reason, without the id echoed back
    return None


def _load_error(name: str, role: str, err: Exception) -> ValueError:
    """A ValueError naming the model and its role. transformers reports a hub id it could not resolve
    or fetch as an OSError; any other error (an unknown architecture, corrupt weights, a missing
    package) is the model's own, and is passed on rather than blamed on the network."""
    if _is_local(name):
        return ValueError(f"{role} model directory {name!r} could not be loaded: {err}")
    # Written as a path (no hub id starts so), or a file: the Hub is not to blame. It said "could not be
    # fetched (... Repo id must use alphanumeric chars ...)" for a mistyped path and for a model's config.json.
    if name.startswith(("/", ".", "~")) or os.path.exists(name):
        return ValueError(f"{role} model directory {name!r} {'is not a directory' if os.path.exists(name) else 'does not exist'}")
    if why := not_a_hub_id(name):  # "models/llama/draft", a relative path that is not there
        return ValueError(f"{role} model {name!r} is neither a local directory nor a hub id ({why})")
    if not isinstance(err, OSError):
        return ValueError(f"{role} model {name!r} could not be loaded: {err}")
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub could not be reached or has no such repo"
    return ValueError(
        f"{role} model {name!r} is not a local directory and could not be fetched ({why}: {str(err).splitlines()[0]}). "
        f"Pass a local directory, or run `osd-serve bootstrap` for the embedded default pair."
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name: str, role: str = "target"):
    from transformers import AutoTokenizer

    name = expand(name)
    local = Path(name)
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{role} model directory {name!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
                         f"target and draft must share one tokenizer, so copy the target's into it")
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # corrupt files, a missing package: one error naming the model, not a traceback
        raise _load_error(name, role, e) from e


def _takes_flash_attn(config, dtype: torch.dtype) -> bool:
    """Whether flash-attention-2 can run this model at this dtype: "auto" must not fail where SDPA
    works. flash-attn computes in float16/bfloat16 only, and transformers refuses it for the
    architectures that lack it (Bloom, CodeGen, MPT, ...) before loading a weight."""
    from transformers import AutoModelForCausalLM

    if dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:  # not in transformers' registry: let from_pretrained decide
        return True
    return bool(getattr(cls, "_supports_flash_attn", False))


def load_model(name: str, role: str, device: torch.device, dtype: torch.dtype, attn: str = "auto"):
    from transformers import AutoConfig, AutoModelForCausalLM

    from .kv import sliding_window

    name, impl = expand(name), attention_backend(device, attn)  # a bad attention choice is its own error
    try:
        config = AutoConfig.from_pretrained(name)
        # auto without flash-attn, for a sliding-window model (its window comes as a 4D mask, which
        # flash-attn does not take, kv.window_masks) or one flash-attn cannot run: let transformers pick SDPA where the model has it
        # and eager where it has not (Bloom, GPT-J, CodeGen, Gemma2 refuse an explicit "sdpa")
        if attn == "auto" and (impl == "sdpa" or sliding_window(config) or not _takes_flash_attn(config, dtype)):
            impl = None
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype, attn_implementation=impl)
    except Exception as e:  # truncated safetensors, unknown architectures: named, not a traceback
        raise _load_error(name, role, e) from e
    return model.to(device).eval()


def max_positions(config) -> int:
    """The longest sequence a model's config allows (unbounded if it names no limit), and for longrope
    models (Phi-3-128k, Phi-3.5, Phi-4-mini) their original_max_position_embeddings: past it transformers
    switches every position's rotary frequencies by the largest position in the forward's batch, so a
    row's keys would depend on its batch-mates and on the window verified, and HF's own generate
    recomputes its cache there. No batched output could then match the target's own decoding."""
    c = getattr(config, "text_config", config)
    limit = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 1 << 30
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    sets = [rope] if "rope_type" in rope or "type" in rope else [r for r in rope.values() if isinstance(r, dict)]  # per layer type
    for r in sets:
        if (r.get("rope_type") or r.get("type")) == "longrope":
            limit = min(limit, int(r.get("original_max_position_embeddings") or getattr(c, "original_max_position_embeddings", limit)))
    return limit


def pair_limits(target: str, draft: str, max_model_len: int) -> tuple[int, int]:
    """(vocab, max_model_len) of a pair from its configs alone: what a process that runs neither model
    (the router, a draft-only replica) needs to validate prompts and size the draft's logits."""
    from transformers import AutoConfig

    configs = []
    for name, role in ((expand(target), "target"), (expand(draft), "draft")):
        try:
            configs.append(AutoConfig.from_pretrained(name))
        except Exception as e:
            raise _load_error(name, role, e) from e
    t, d = (getattr(c, "text_config", c) for c in configs)
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


# peft types whose adapters merge_and_unload folds into a draft's weights (each checked on a tiny Llama)
MERGEABLE_PEFT_TYPES = frozenset({"LORA", "ADALORA", "IA3", "LOHA", "LOKR", "OFT", "BOFT", "VERA", "FOURIERFT", "HRA",
                                  "LN_TUNING"})


def adapter_dir_problem(path: str) -> str | None:
    """Why ``path`` is not a peft LoRA directory this project loads (safetensors only), or None.
    Asked at `serve run` (deployments.config) and again where the adapter loads."""
    p = Path(expand(path))
    if not p.is_dir():
        return "is not a directory (a peft LoRA adapter directory)"
    if not (p / "adapter_model.safetensors").is_file():
        return "has no adapter_model.safetensors (pickled adapters are refused)"
    if not (p / "adapter_config.json").is_file():  # peft needs it too: its own error read "does not fit the draft"
        return "has no adapter_config.json (save the adapter with peft's save_pretrained)"
    try:
        kind = json.loads((p / "adapter_config.json").read_text()).get("peft_type")
    except (ValueError, OSError, AttributeError) as e:
        return f"has an unreadable adapter_config.json ({e})"
    # An expert's adapter is merged into its draft. Prompt-learning adapters have no weights to merge
    # (an AttributeError in the replica), and Poly, Lily, ShadowPEFT and bias-only BEFT raise in
    # merge_and_unload: only types seen to merge pass.
    if not isinstance(kind, str) or kind not in MERGEABLE_PEFT_TYPES:  # a list is unhashable: a traceback at serve run
        return f"has peft_type {kind!r}, whose adapters cannot be merged into the draft (allowed: " \
               f"{', '.join(sorted(MERGEABLE_PEFT_TYPES))})"
    return None


def attach_adapter(draft, name: str, path: str):
    """Attach a LoRA adapter to the draft with peft. safetensors only: a pickled adapter is refused
    (peft prefers adapter_model.safetensors when it exists, and we refuse directories without one)."""
    from peft import PeftConfig, PeftModel, get_peft_model

    if why := adapter_dir_problem(path):
        raise ValueError(f"adapter {name!r}: {path!r} {why}")
    p = Path(expand(path))
    peft_name = name.replace(".", "_")  # peft names modules after it and refuses a dot; expert names may hold one
    if isinstance(draft, PeftModel) and peft_name in draft.peft_config:  # "a.b" after "a_b" replaced it
        raise ValueError(f"adapter {name!r}: the draft already has an adapter named {peft_name!r}")
    try:
        if not isinstance(draft, PeftModel):  # what PeftModel.from_pretrained does, keeping load_adapter's result
            config = PeftConfig.from_pretrained(str(p))
            config.inference_mode = True  # as from_pretrained forces: a config saying false made the adapter trainable
            with warnings.catch_warnings():  # from_pretrained does not say its base path was another's either
                warnings.filterwarnings("ignore", message=".*base_model_name_or_path.*")
                draft = get_peft_model(draft, config, adapter_name=peft_name)
        loaded = draft.load_adapter(str(p), adapter_name=peft_name)
    except Exception as e:  # e.g. a LoRA trained on another base: peft's size-mismatch RuntimeError
        lines = str(e).splitlines() or [type(e).__name__]
        why = next((ln.strip() for ln in lines if "size mismatch" in ln), lines[0])  # the first line names no tensor
        raise ValueError(f"adapter {name!r} at {path!r} does not fit the draft: {why}") from e
    # peft loads non-strictly: an adapter of a deeper base (same widths) lost its extra layers' tensors
    # without a word, and a shallower one left layers at their initial weights with only a warning.
    if loaded.unexpected_keys or loaded.missing_keys:
        extra, missing = loaded.unexpected_keys, loaded.missing_keys
        raise ValueError(f"adapter {name!r} at {path!r} does not fit the draft: {len(extra)} of its tensors have no "
                         f"place in it{f' (e.g. {extra[0]})' if extra else ''} and {len(missing)} of the draft's adapter "
                         f"weights are not in it{f' (e.g. {missing[0]})' if missing else ''}: was it trained on another base?")
    return draft.eval()


def pack_target(target, cfg: ModelConfig) -> int:
    """The target never trains, so on CPU its linear layers can keep a prepacked copy of their weights
    for oneDNN, which multiplies the 16-48-row inputs of a verification 1.1-2.3x faster than MKL's sgemm
    (kernels/cpu_linear.py); float32 calls of <= 48 rows take kernels/cpu_skinny.cpp on AVX-512. The draft
    does not: it is distilled, and every update would repack it."""
    if not cfg.cpu_packed_linear or cfg.resolved_device().type != "cpu":
        return 0
    from kernels.cpu_linear import pack_linears

    return pack_linears(target)


def check_vocab_rows(model, n_tokens: int, role: str) -> None:
    """A model needs an embedding row for every id of its tokenizer's vocabulary. A target short of rows
    refused ordinary prompts one request at a time; a draft short of rows had its missing ids
    clamped to its last row (kv.py), a wrong input no error named. More rows than tokens is a
    padded vocabulary, and fine."""
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < n_tokens:  # n_tokens: the base vocabulary (see load_pair)
        raise ValueError(f"{role} model has {rows} embedding rows, fewer than the {n_tokens} tokens of its tokenizer's "
                         f"vocabulary: it was not trained with this tokenizer")


def load_pair(cfg: ModelConfig):
    """Returns (target, draft, tokenizer). Fails before anything is served if the pair is unusable."""
    device, dtype = cfg.resolved_device(), cfg.resolved_dtype()
    ttok, dtok = load_tokenizer(cfg.target, "target"), load_tokenizer(cfg.draft, "draft")
    check_same_vocab(ttok, dtok)
    target = load_model(cfg.target, "target", device, dtype, cfg.attn_implementation)
    # The base vocabulary, not len(): added specials may sit past the embedding and never occur in text
    # (Gemma-3 1B: 262144 rows, 262145 tokens with <image_soft_token>; Llama-2 finetunes' <pad>)
    check_vocab_rows(target, ttok.vocab_size, "target")
    pack_target(target, cfg)
    draft = load_model(cfg.draft, "draft", device, cfg.resolved_draft_dtype(), cfg.attn_implementation)
    check_vocab_rows(draft, ttok.vocab_size, "draft")
    for name, path in cfg.draft_adapters.items():
        draft = attach_adapter(draft, name, path)
    return target, draft, ttok
