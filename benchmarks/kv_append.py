"""One decode forward with Hugging Face's concatenating ``DynamicCache`` against osd-serve's in-place
``GrowingLayer`` cache (osd_serve/kv.py), same model, batch and cached context, timed in interleaved
rounds so drift of a shared machine hits both alike. The ratio is the point, not the absolute times.

    python benchmarks/kv_append.py --model "$(osd-serve bootstrap | tail -n 1 | python -c 'import json,sys; print(json.load(sys.stdin)["target"])')"
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from osd_serve.kv import new_cache


@torch.inference_mode()
def _filled(model, make_cache, batch: int, context: int, vocab: int):
    cache = make_cache(model.config)
    g = torch.Generator().manual_seed(0)
    for start in range(0, context, 256):  # chunked prefill keeps the prefill's own memory small
        ids = torch.randint(3, vocab, (batch, min(256, context - start)), generator=g)
        model(ids, past_key_values=cache, use_cache=True)
    return cache


@torch.inference_mode()
def _step(model, cache, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(ids, past_key_values=cache, use_cache=True)
    dt = time.perf_counter() - t0
    cache.crop(-ids.shape[1])  # keep the cached context fixed
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[100, 500, 1500])
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per row per forward (k+1 for a verification)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    vocab = model.config.vocab_size
    rows = []
    for b in args.batch:
        for ctx in args.context:
            caches = {"dynamic_cache": _filled(model, lambda c: DynamicCache(config=c), b, ctx, vocab),
                      "growing_cache": _filled(model, new_cache, b, ctx, vocab)}
            ids = torch.randint(3, vocab, (b, args.tokens))
            times = {name: [] for name in caches}
            for r in range(args.rounds + 2):
                for name, cache in caches.items():
                    dt = _step(model, cache, ids)
                    if r >= 2:  # warm-up
                        times[name].append(dt)
            ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            row = {"batch": b, "context": ctx, "tokens": args.tokens} | {f"{n}_ms": round(v, 2) for n, v in ms.items()}
            row["dynamic_over_growing"] = round(ms["dynamic_cache"] / ms["growing_cache"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
