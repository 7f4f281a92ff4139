"""The draft's dtype under a half-precision target on CPU: the evidence behind ModelConfig.draft_dtype's
``auto`` (float32 there). One loaded target, the same draft weights in the target's dtype and in
float32, and for each: the draft's forward cost (alone, as ``osd-serve bench`` times c) and the
engine's greedy tokens/s at a few k, in interleaved rounds (median), beside the engine at k=0.

    python benchmarks/draft_dtype.py --pair ~/.cache/osd-serve/default-pair --out benchmarks/results/draft_dtype_default_pair_amx.json

``outputs_equal`` records whether the two drafts' runs emitted the same tokens. The draft's dtype
changes which tokens are proposed, and so which verification shapes the target runs; greedy outputs
can then differ only where the target's own top two logits nearly tie, which ``osd-serve bench``
checks for every report (here it is not re-checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from osd_serve.bench import check_inputs, code_version, cpu_info, engine_run, forward_cost, timed
from osd_serve.cli import _read_prompts
from osd_serve.loading import ModelConfig, load_model, load_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a bootstrap pair: target/, draft/ and prompts.jsonl")
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", default="1:3,1:5,8:2,8:3", help="batch:k pairs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.dtype not in ("bfloat16", "float16"):
        raise SystemExit(f"error: --dtype {args.dtype}: the comparison is a half-precision target's draft in its dtype and in float32")
    target, same, tok = load_pair(ModelConfig(target=str(args.pair / "target"), draft=str(args.pair / "draft"), dtype=args.dtype,
                                              draft_dtype=args.dtype, device="cpu"))
    drafts = {args.dtype: same, "float32": load_model(str(args.pair / "draft"), "draft", torch.device("cpu"), torch.float32)}
    ids = [tok.encode(p) for p in _read_prompts(str(args.pair / "prompts.jsonl"))[: args.num_prompts]]
    # c is timed as one token after ctx: within the pair's positions, as osd_serve.bench caps it
    runs = [tuple(map(int, r.split(":"))) for r in args.runs.split(",")]
    limit = check_inputs(target, same, tok, ids, args.max_tokens, [k for _, k in runs])
    ctx = min(int(statistics.median(map(len, ids))) + args.max_tokens // 2, limit - 1)
    vocab, cpu = target.get_output_embeddings().weight.shape[0], torch.device("cpu")
    for d in drafts.values():  # warm-up
        engine_run(target, d, tok, ids[:1], 1, min(4, args.max_tokens), 2)
    tok_s, cost, outs, alpha = {}, {}, {}, {}
    for _ in tqdm(range(args.rounds), desc=f"{args.rounds} rounds"):
        for bs in sorted({b for b, _ in runs}):
            rows_run = min(bs, len(ids))  # the rows the engine runs: fewer prompts than bs never fill the batch
            t1 = forward_cost(target, rows_run, ctx, vocab, cpu)
            for name, d in drafts.items():
                cost.setdefault((name, bs), []).append(forward_cost(d, rows_run, ctx, vocab, cpu) / t1)
        for bs, k in [(b, 0) for b in sorted({b for b, _ in runs})] + runs:
            for name, d in drafts.items() if k else [(args.dtype, same)]:
                (res, stats), dt = timed(lambda: engine_run(target, d, tok, ids, bs, args.max_tokens, k))
                alpha.setdefault((name, bs, k), sum(s.accepted for s in stats) / max(1, sum(s.accepted + s.rejected for s in stats)))
                tok_s.setdefault((name, bs, k), []).append(sum(len(o.token_ids) for o in res) / dt)
                outs.setdefault((name, bs, k), [o.token_ids for o in res])
    rows = []
    for bs, k in runs:
        k0 = statistics.median(tok_s[(args.dtype, bs, 0)])
        row = {"batch": bs, "rows": min(bs, len(ids)), "k": k, "outputs_equal": outs[(args.dtype, bs, k)] == outs[("float32", bs, k)]}
        for name in drafts:
            m = statistics.median(tok_s[(name, bs, k)])
            row[name] = {"c": statistics.median(cost[(name, bs)]), "alpha": alpha[(name, bs, k)], "tok_s": m, "over_k0": m / k0}
        row["float32_over_" + args.dtype] = row["float32"]["tok_s"] / row[args.dtype]["tok_s"]
        rows.append(row)
        print(json.dumps(row))
    report = {"pair": str(args.pair), "target_dtype": args.dtype, "rounds": args.rounds, "prompts": len(ids),
              "max_tokens": args.max_tokens, "threads": args.threads, "cpu": cpu_info(), "code": code_version(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
