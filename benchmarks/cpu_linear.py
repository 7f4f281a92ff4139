"""PyTorch's ``F.linear`` (MKL sgemm for float32) against oneDNN on a prepacked weight and, for
float32 on AVX-512, kernels/cpu_skinny.cpp (kernels/cpu_linear.py), per weight matrix and row count,
then every linear of a target through the kernel in turn (its weights streamed as in a forward), and
one whole target forward plain, with ``pack_linears(skinny=False)`` (the libraries) and with
``pack_linears`` (the libraries and the kernel) at the row counts a decode step (k=0) and a verification (k+1 tokens per
row) have. Interleaved rounds, medians: the ratios are the point, not the absolute times.

    python benchmarks/cpu_linear.py --model "$(osd-serve bootstrap | tail -n 1 | python -c 'import json,sys; print(json.load(sys.stdin)["target"])')"
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kernels.cpu_linear import SKINNY_MAX_ROWS, pack_linears, skinny_kernel
from osd_serve.kv import new_cache


def _median_us(fns: dict, rounds: int) -> dict:
    times = {name: [] for name in fns}
    for r in range(rounds + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


@torch.inference_mode()
def matrices(shapes, rows, dtypes, rounds: int) -> None:
    for dtype in dtypes:
        for out_f, in_f in shapes:
            w = torch.randn(out_f, in_f).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 12)
            # one matrix in a loop stays in cache: the skinny kernel's gain, streaming a model's
            # weights from memory, shows in the forward table, not here
            kernel = skinny_kernel() if dtype == torch.float32 else None
            for m in rows:
                x = torch.randn(m, in_f).to(dtype)
                fns = {"linear": lambda: F.linear(x, w),
                       "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
                if kernel is not None and m <= SKINNY_MAX_ROWS:
                    fns["kernel"] = lambda: kernel(x, w)
                us = _median_us(fns, rounds)
                print(json.dumps({"kind": "matrix", "dtype": str(dtype).removeprefix("torch."), "weight": [out_f, in_f],
                                  "rows": m, "linear_us": round(us["linear"], 1), "packed_us": round(us["packed"], 1),
                                  "linear_over_packed": round(us["linear"] / us["packed"], 2)}
                                 | ({"kernel_us": round(us["kernel"], 1), "linear_over_kernel": round(us["linear"] / us["kernel"], 2)}
                                    if "kernel" in us else {})), flush=True)


def forwards(path: str, batches, tokens, dtypes, context: int, rounds: int) -> None:
    for dtype in dtypes:
        # loaded outside inference mode: pack_linears leaves inference tensors alone
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
        models = {"plain": plain, "packed": copy.deepcopy(plain)}
        n = pack_linears(models["packed"], skinny=False)
        if dtype == torch.float32 and skinny_kernel() is not None:
            models["kernel"] = copy.deepcopy(plain)  # packed, and <= 48 rows on kernels/cpu_skinny.cpp
            pack_linears(models["kernel"])
        _forwards(models, n, dtype, batches, tokens, context, rounds)


@torch.inference_mode()
def _forwards(models: dict, n: int, dtype, batches, tokens, context: int, rounds: int) -> None:
    vocab = models["plain"].config.vocab_size
    g = torch.Generator().manual_seed(0)
    for b in batches:
        prompt = torch.randint(3, vocab, (b, context), generator=g)
        caches = {}
        for name, model in models.items():
            caches[name] = new_cache(model.config)
            model(prompt, past_key_values=caches[name], use_cache=True)
        for t in tokens:
            ids = torch.randint(3, vocab, (b, t), generator=g)

            def step(model, cache):
                model(ids, past_key_values=cache, use_cache=True)
                cache.crop(-t)  # keep the cached context fixed

            us = _median_us({name: (lambda m=m, c=caches[name]: step(m, c)) for name, m in models.items()}, rounds)
            print(json.dumps({"kind": "forward", "dtype": str(dtype).removeprefix("torch."), "linears_packed": n,
                              "batch": b, "tokens_per_row": t, "context": context,
                              "plain_ms": round(us["plain"] / 1e3, 2), "packed_ms": round(us["packed"] / 1e3, 2),
                              "plain_over_packed": round(us["plain"] / us["packed"], 2)}
                             | ({"kernel_ms": round(us["kernel"] / 1e3, 2), "plain_over_kernel": round(us["plain"] / us["kernel"], 2)}
                                if "kernel" in us else {})), flush=True)


@torch.inference_mode()
def streamed(path: str, rows, rounds: int) -> None:
    """Every linear weight of a model through kernels/cpu_skinny.cpp in turn, as a forward meets them:
    a model past the CPU's cache streams its weights from memory on each pass, which one matrix in a
    loop (the matrix table) never does."""
    kernel = skinny_kernel()
    if kernel is None:
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ws = [m.weight.detach().contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    mb = sum(w.numel() for w in ws) * 4 / 2**20
    base = None
    for m in rows:
        if m > SKINNY_MAX_ROWS:
            continue
        xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in ws}
        us = _median_us({"kernel": lambda: [kernel(xs[w.shape[1]], w) for w in ws]}, rounds)["kernel"]
        base = base or us
        print(json.dumps({"kind": "streamed", "weights_mb": round(mb), "rows": m, "kernel_ms": round(us / 1e3, 2),
                          "over_first_rows": round(us / base, 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a target directory; without it only the matrix table runs")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 56, 72])
    ap.add_argument("--shapes", nargs="+", default=["512x512", "1408x512", "512x1408", "4096x512", "4096x1536"],
                    help="weight shapes out x in")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 9], help="tokens per row (k+1)")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtype]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    matrices(shapes, args.rows, dtypes, args.rounds)
    if args.model:
        if torch.float32 in dtypes:
            streamed(args.model, args.rows, args.rounds)
        forwards(args.model, args.batch, args.tokens, dtypes, args.context, args.rounds)


if __name__ == "__main__":
    main()
