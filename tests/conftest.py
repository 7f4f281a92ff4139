"""Tiny models and a tokenizer built in code, seeded: no download, seconds to build."""

from __future__ import annotations

import os
import string

# Never let a test reach for the Hub: a hub id must fail at once with our error, not hang on a network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

# Triton reads TRITON_INTERPRET when triton itself is first imported (osd_serve.spec imports kernels),
# so it must be set here, before any test module is collected, for the kernels to run on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHARS = string.ascii_letters + string.digits + " .,:;()[]=+-*/_'\"\n"


def char_tokenizer():
    """A real PreTrainedTokenizerFast over single characters, with <eos> and <pad>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import decoders

    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def byte_fallback_tokenizer(words=("▁The", "▁is", "a", "▁a")):
    """A SentencePiece-style tokenizer with byte fallback (Llama-2, Mistral, Gemma): <0xXX> byte tokens
    for text outside its pieces, decoded by ByteFallback, which gives one U+FFFD per byte of a run that
    is not valid UTF-8 as a whole. Ids: 0-2 <unk> <s> </s>, 3-258 the bytes, then ``words``."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + list(words)
    tk = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                              fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def _finish(model, eos_id):
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = 0
    return model.eval()


def llama(vocab: int, hidden: int = 64, layers: int = 2, seed: int = 0, eos_id=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # initializer_range 0.3 (not 0.02) gives peaked logits, so greedy near-ties are rare.
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, max_position_embeddings=256,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=eos_id, pad_token_id=0,
    )
    return _finish(LlamaForCausalLM(cfg), eos_id)


def gpt2(vocab: int, hidden: int = 64, layers: int = 2, seed: int = 0, eos_id=None):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, initializer_range=0.3,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=eos_id, pad_token_id=0,
    )
    return _finish(GPT2LMHeadModel(cfg), eos_id)


def perturbed(model, noise: float, seed: int = 1):
    """A draft that agrees with the target often but not always: every weight plus Gaussian noise."""
    import copy

    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return d


def save_pair_dir(out, prompts, seed: int):
    """A directory laid out as `osd-serve bootstrap` writes one (target/, draft/, prompts.jsonl): a tiny Llama
    target of the char tokenizer and a perturbed draft, for benchmarks that load a pair by its directory."""
    import json

    tok = char_tokenizer()
    target = llama(len(tok), seed=seed)
    for name, m in (("target", target), ("draft", perturbed(target, 0.05))):
        m.save_pretrained(out / name)
        tok.save_pretrained(out / name)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return out


@pytest.fixture(scope="session")
def tok():
    return char_tokenizer()


@pytest.fixture
def no_env_keys(monkeypatch):
    """Keys come from the config alone: a developer's exported OSD_API_KEY / OSD_ADMIN_KEY would fill them."""
    monkeypatch.delenv("OSD_API_KEY", raising=False)
    monkeypatch.delenv("OSD_ADMIN_KEY", raising=False)


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def pair(request, tok):
    """(arch, target, draft) with a partially agreeing draft, and no EOS so lengths are fixed."""
    build = llama if request.param == "llama" else gpt2
    target = build(len(tok), seed=0)
    return request.param, target, perturbed(target, 0.015)
