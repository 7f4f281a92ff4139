"""What one draft forward costs, and whether a cheap lever lowers it: the evidence behind c on CPU.

The default pair's draft (1 layer, 1.23M parameters) does ~2.5 MFLOP per row, yet one forward costs
~0.1 of the 30M-parameter target's (``osd-serve bench``'s c): it is bound by per-call work (Python,
module dispatch, mask and rotary set-up), not by its arithmetic. This times one draft forward
appending 1 token per row to a cache, as ``osd-serve bench`` times c (``osd_serve.bench.forward_cost``),
for the draft as the engine runs it and for three variants, in interleaved rounds (median):

  packed    its linears on kernels/cpu_linear.py (oneDNN prepacked weights, cpu_skinny.cpp), as the target's;
  1 thread  torch.set_num_threads(1) around the forward (thread hand-off per small op);
  compiled  torch.compile(dynamic=True) of the draft (--compile; its first calls compile, ~1 min, untimed);
  holes     the draft as the engine runs it, on a cache with holes (batch > 1; see holed_cost).

It also reports the engine's own draft time per draft forward at k = --k (``StepStats.draft_time``
over the draft forwards of a greedy run over the prompts, each proposing one token per row), which adds
the proposal loop's argmax, logit gathering and the cache's hole mask to the forward.

    python benchmarks/draft_call_cost.py --pair ~/.cache/osd-serve/default-pair --dtype bfloat16 --compile
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import load_pair_dir  # noqa: E402
from kernels.cpu_linear import pack_linears  # noqa: E402
from osd_serve.auto_k import timed_forward  # noqa: E402
from osd_serve.bench import code_version, cpu_info, engine_run, forward_cost  # noqa: E402
from osd_serve.cli import _read_prompts  # noqa: E402
from osd_serve.kv import BatchKV  # noqa: E402


@torch.inference_mode()
def holed_cost(model, batch: int, context: int, vocab: int, device, repeats: int = 30) -> float:
    """forward_cost on a cache with holes, as the engine's at batch > 1 (rows keep different numbers of
    drafts): every other row's prompt is a quarter shorter, right-padded, so its padding stays as holes
    and every forward passes a 2D mask, which transformers turns into a 4D one."""
    kv = BatchKV(model, batch, device)
    ctx = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)  # [B, ctx]
    valid = torch.ones_like(ctx, dtype=torch.bool)  # [B, ctx]
    valid[1::2, context - context // 4:] = False
    kv.forward(ctx, valid, keep=1)
    times = [timed_forward(kv, 1, vocab) for _ in range(repeats + 3)]
    return statistics.median(times[3:])


def one_thread(fn):
    def run():
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(n)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a bootstrap pair: target/, draft/ and prompts.jsonl")
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype (the draft's is ModelConfig's auto)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=64, help="cached tokens per row")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(dynamic=True) of the draft")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = load_pair_dir(args.pair, args.dtype)
    device, vocab = next(target.parameters()).device, target.get_output_embeddings().weight.shape[0]
    packed = copy.deepcopy(draft)
    n_packed = pack_linears(packed)
    models = {"engine's draft": draft, "packed": packed}
    if args.compile:
        models["compiled"] = torch.compile(copy.deepcopy(draft), dynamic=True)
    ids = [tok.encode(p) for p in _read_prompts(str(args.pair / "prompts.jsonl"))][: args.num_prompts]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    cost = lambda m, b: lambda: forward_cost(m, b, args.context, vocab, device)  # noqa: E731
    runs = {}
    for b in sizes:
        runs |= {(b, name): cost(m, b) for name, m in models.items()}
        runs[(b, "1 thread")] = one_thread(cost(draft, b))
        if b > 1:  # at batch 1 a rejection only crops the cache: no holes
            runs[(b, "holes")] = lambda b=b: holed_cost(draft, b, args.context, vocab, device)
        runs[(b, "target")] = cost(target, b)
    for (b, name), run in runs.items():
        if name == "compiled":
            run()  # compiles (and recompiles as shapes first vary): not a forward's cost
    per_forward = {b: [] for b in sizes}
    times = {key: [] for key in runs}
    for _ in tqdm(range(args.rounds), desc=f"{args.rounds} round(s) of {len(runs)} timings + the engine"):
        for key, run in runs.items():
            times[key].append(run())
        for b in sizes:
            _, stats = engine_run(target, draft, tok, ids, b, 64, args.k)
            forwards = sum(sum(1 for n in s.proposed_per_position if n) for s in stats)  # draft forwards run
            per_forward[b].append(sum(s.draft_time for s in stats) / forwards)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    report = {"pair": str(args.pair), "dtype": args.dtype, "draft_dtype": str(next(draft.parameters()).dtype),
              "context": args.context, "k": args.k, "rounds": args.rounds, "threads": args.threads,
              "packed_linears": n_packed, "cpu": cpu_info(), "code": code_version(), "batches": {}}
    for b in sizes:
        base = med[(b, "engine's draft")]
        row = {name: {"ms": 1e3 * med[(bb, name)], "vs_engine_draft": med[(bb, name)] / base}
               for (bb, name) in med if bb == b and name != "target"}
        row["target_ms"] = 1e3 * med[(b, "target")]
        row["c"] = base / med[(b, "target")]
        row["engine_draft_ms_per_forward"] = 1e3 * statistics.median(per_forward[b])
        report["batches"][str(b)] = row
        print(f"batch {b}: target {row['target_ms']:.2f} ms, c {row['c']:.3f}, engine draft "
              f"{row['engine_draft_ms_per_forward']:.2f} ms per forward; "
              + ", ".join(f"{n} {v['ms']:.2f} ms ({v['vs_engine_draft']:.2f}x)"
                          for n, v in row.items() if isinstance(v, dict)))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
