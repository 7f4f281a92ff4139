"""The hole mask built by BatchKV._hole_mask (a 4D bool mask on SDPA) against the 2D mask transformers
turns into a 4D one at every forward, on the bench's batch-8 workload: the pair's prompts.jsonl, greedy,
64 tokens each. Rows keep different numbers of drafts, so past the first step every draft and target
forward of the batch sees holes; at batch 1 there are none (a rejection crops the cache), so both are
the same path there.

Each variant is a fresh engine on the same loaded pair, run in interleaved rounds (benchmarks/rounds.py).
Per k: the whole run's tokens/s (as `osd-serve bench` times the engine), seconds in draft and in target
forwards, the 4D/2D ratios within this run, and how the outputs differ (the masks are the same, so in
float32 the outputs are equal; in bf16 a kernel's order of summation can split a near-tie,
osd_serve.bench.mismatches).

    python benchmarks/hole_mask.py --pair DIR [--dtype bfloat16] [--ks 1 2 4 8] [--prompts 16] [--out FILE.json]
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import ab_args, load_for, on_off_by_k, pair_prompts  # noqa: E402
from osd_serve.bench import code_version, mismatches, timed  # noqa: E402
from osd_serve.config import EngineConfig, SamplingParams  # noqa: E402
from osd_serve.engine import SpecEngine  # noqa: E402
from osd_serve.kv import BatchKV  # noqa: E402

KEYS = ("tok_s", "draft_s", "target_s")


def _run(target, draft, tok, prompts, batch: int, k: int, four_d: bool) -> dict:
    own = BatchKV._hole_mask
    if not four_d:  # the 2D mask, as before _hole_mask: transformers builds the 4D one in each forward
        BatchKV._hole_mask = lambda self, mask, t: mask.long()
    try:
        eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=batch))
        stats: list = []
        params = SamplingParams(max_tokens=64, num_speculative_tokens=k, ignore_eos=True)
        outs, wall = timed(lambda: eng.generate(prompts, params, stats=stats))
    finally:
        BatchKV._hole_mask = own
    return {"tok_s": sum(len(o.token_ids) for o in outs) / wall, "draft_s": sum(s.draft_time for s in stats),
            "target_s": sum(s.target_time for s in stats), "outputs": [o.token_ids for o in outs]}


def main() -> None:
    args = ab_args(__doc__.split("\n\n")[0], ks=[1, 2, 4, 8]).parse_args()
    target, draft, tok = load_for(args)
    prompts = pair_prompts(args.pair, tok, args.prompts)
    rows = []
    run = functools.partial(_run, target, draft, tok, prompts, args.batch)
    for k, (new, old, new_runs, old_runs) in on_off_by_k(run, args.ks, args.rounds, KEYS).items():
        row = {"k": k, **{f"{name}_{key}": round(v, 4) for name, m in (("4d", new), ("2d", old)) for key, v in m.items()},
               **{f"{key}_4d_over_2d": round(new[key] / old[key], 3) for key in KEYS},
               "4d_vs_2d_outputs": [mismatches(target, prompts, a["outputs"], b["outputs"]) for a, b in zip(new_runs, old_runs)]}
        rows.append(row)
        print(json.dumps({key: v for key, v in row.items() if key != "4d_vs_2d_outputs"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"pair": args.pair, "dtype": str(target.dtype), "batch": args.batch,
                                              "prompts": len(prompts), "rounds": args.rounds, "threads": args.threads,
                                              "code": code_version(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
