"""A larger random-weight (target, draft) pair for the engine bench (issue 2): the GPU's, and on the CPU
a target past the cache (benchmarks/run_engine_bench.sh's big_random_pair).

Speed depends on sizes and acceptance, not on what the weights know, so random weights are fine for
speed (the issue allows them). Defaults are TinyLlama-1.1B's shape. The draft is a layer-skip draft:
the target's first ``--draft-layers`` layers with its embeddings, final norm and LM head. Plain random
layers would make it agree with the target almost never (α = 0 measured at small sizes), so the
target's deeper layers have their residual outputs (o_proj, down_proj) scaled by ``--deep-scale``:
they still cost a full forward but move the logits less, and the scale sets how often the draft
agrees. α is measured by the bench, never assumed. The tokenizer is a byte-level BPE trained here in seconds on the standard
library, as the embedded pair's is; prompts.jsonl (held-out stdlib snippets) sits beside the pair,
where `osd-serve bench` looks for it.

    python benchmarks/gpu_pair.py --out /tmp/gpu-pair   # last line: {"target": DIR, "draft": DIR}
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path

import torch


def build(out: Path, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, draft_layers: int,
          vocab: int, dtype: torch.dtype, deep_scale: float, seed: int = 0) -> dict:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from osd_serve.bootstrap import PRESETS, train_tokenizer
    from osd_serve.corpus import load_corpus, make_prompts, split_heldout

    if not 1 <= draft_layers < layers:
        raise SystemExit(f"error: --draft-layers must be in [1, {layers - 1}], got {draft_layers}")
    cfg = PRESETS["default"]
    docs = load_corpus(None, replace(cfg, corpus_max_bytes=4_000_000))
    train, held = split_heldout(docs, 64, seed)
    tok = train_tokenizer(train, vocab)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, **special)
    torch.manual_seed(seed)
    # Not osd_serve.bootstrap.make_model: it zeroes every residual output (a bigram model at init),
    # which would make the layer-skip draft equal to the target.
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(deep_scale)
            layer.mlp.down_proj.weight.mul_(deep_scale)
    target = target.to(dtype)
    target.generation_config = GenerationConfig(**special)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:draft_layers]
    draft.config.num_hidden_layers = draft_layers
    dirs = {"target": out / "target", "draft": out / "draft"}
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    prompts = make_prompts(held, 64, seed)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    n = {name: sum(p.numel() for p in m.parameters()) for name, m in (("target", target), ("draft", draft))}
    print(f"target {n['target'] / 1e6:.0f}M params, draft {n['draft'] / 1e6:.0f}M ({draft_layers}/{layers} layers), "
          f"vocab {len(tok)}, {dtype}")
    return {k: str(v) for k, v in dirs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary to train (the corpus may give fewer)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--deep-scale", type=float, default=0.1, help="scale of the non-draft layers' residual outputs")
    a = ap.parse_args()
    dirs = build(a.out, a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads, a.draft_layers, a.vocab,
                 getattr(torch, a.dtype), a.deep_scale)
    print(json.dumps(dirs))


if __name__ == "__main__":
    main()
