"""One prefill forward (``BatchKV.forward``) computing every position's logits against the last one's only
(``keep=1``, transformers' logits_to_keep), same model and prompts, timed in interleaved rounds so drift
of a shared machine hits both alike. The engine's prefill reads none of these logits.

    python benchmarks/prefill_logits.py --model DIR [--model DIR ...] [--random-vocab 151936]

``--random-vocab V`` adds a random Qwen2-shaped model (Qwen2.5-0.5B's widths, 4 layers) with V entries:
the default pair's vocabulary is 4,096, real ones reach 152k, and the lm_head's share grows with it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import interleaved  # noqa: E402
from osd_serve.kv import BatchKV, make_hole_safe  # noqa: E402


def _random_model(vocab: int):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


@torch.inference_mode()
def _prefill(model, ids: torch.Tensor, keep: int | None) -> float:
    kv = BatchKV(model, ids.shape[0], ids.device)
    t0 = time.perf_counter()
    kv.forward(ids, torch.ones_like(ids, dtype=torch.bool), keep=keep)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--random-vocab", type=int, default=0)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="append the rows to this .jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = [(m, AutoModelForCausalLM.from_pretrained(m, attn_implementation="sdpa").eval()) for m in args.model]
    if args.random_vocab:
        models.append((f"random qwen2-shaped, 4 layers, vocab {args.random_vocab}", _random_model(args.random_vocab)))
    rows = []
    for name, model in models:
        make_hole_safe(model)
        vocab = model.get_output_embeddings().weight.shape[0]
        params = sum(p.numel() for p in model.parameters())
        for b in args.batch:
            ids = torch.randint(3, vocab, (b, args.prompt), generator=torch.Generator().manual_seed(0))  # [B, T]
            times = interleaved({"all_logits": functools.partial(_prefill, model, ids, None),
                                 "keep_1": functools.partial(_prefill, model, ids, 1)}, args.rounds)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"model": name, "params": params, "vocab": vocab, "batch": b, "prompt_tokens": args.prompt,
                   "all_logits_s": round(med["all_logits"], 4), "keep_1_s": round(med["keep_1"], 4),
                   "speedup": round(med["all_logits"] / med["keep_1"], 3),
                   # the logits tensor a prefill no longer makes (its dtype's bytes)
                   "logits_bytes_saved": b * (args.prompt - 1) * vocab * model.dtype.itemsize,
                   "rounds": args.rounds, "threads": args.threads}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
