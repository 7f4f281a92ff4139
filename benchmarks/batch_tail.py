"""Where a batch-8 run of the bench's workload spends its time: steps with a full batch against the tail.

`osd-serve bench` at batch 8 decodes the pair's 16 prompts in 8 slots. Plain decoding (k = 0) emits one
token a row a step, so every row of a wave ends at the same step and every step is full. With speculation a
row's tokens per step follow its acceptance, so rows end at different steps; once the queue is empty each
one that ends leaves its slot empty, and the last rows run alone. Such a step costs close to a full one
(a forward's fixed cost), for fewer tokens. S describes a full step; this splits each engine run into

* full steps (every slot busy): their draft + target forward seconds and the tokens they emitted;
* the tail (fewer rows than slots): the same;
* prefill, and the rest (the loop's own work),

for each k in the same interleaved rounds (benchmarks/rounds.py), with the full steps' rate over k = 0's
full steps: the speedup of a loaded server's steady state, whose queue never empties.

    python benchmarks/batch_tail.py --pair DIR [--dtype bfloat16] [--ks 0 1 2 4 6 8] [--prompts 16] [--out FILE.json]
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import ab_args, interleaved, load_for, pair_prompts  # noqa: E402
from osd_serve.bench import code_version, engine_run, timed  # noqa: E402

KEYS = ("wall_s", "full_s", "tail_s", "prefill_s", "rest_s")


def split_run(stats, batch: int, wall: float) -> dict:
    """One engine run's per-step stats, split into full steps and the tail (fewer than ``batch`` rows)."""
    full = [s for s in stats if s.batch_size == batch]
    tail = [s for s in stats if s.batch_size < batch]
    fwd = lambda steps: sum(s.draft_time + s.target_time for s in steps)  # noqa: E731
    prefill = sum(s.prefill_time for s in stats)
    return {"wall_s": wall, "full_s": fwd(full), "tail_s": fwd(tail), "prefill_s": prefill,
            "rest_s": wall - fwd(full) - fwd(tail) - prefill, "steps": len(stats), "full_steps": len(full),
            "full_tokens": sum(s.emitted for s in full), "tail_tokens": sum(s.emitted for s in tail),
            "tail_rows_per_step": sum(s.batch_size for s in tail) / len(tail) if tail else None}


def _run(target, draft, tok, prompts, batch: int, k: int) -> dict:
    (outs, stats), wall = timed(lambda: engine_run(target, draft, tok, prompts, batch, 64, k))
    return split_run(stats, batch, wall) | {"tokens": sum(len(o.token_ids) for o in outs)}


def main() -> None:
    ap = ab_args(__doc__.split("\n\n")[0], ks=[0, 1, 2, 4, 6, 8])
    args = ap.parse_args()
    target, draft, tok = load_for(args)
    prompts = pair_prompts(args.pair, tok, args.prompts)
    run = functools.partial(_run, target, draft, tok, prompts, args.batch)
    got = interleaved({k: (lambda k=k: run(k)) for k in args.ks}, args.rounds)
    rows = {}
    for k, runs in got.items():
        first = runs[0]  # greedy: steps and tokens are the same in every round
        med = {key: statistics.median(r[key] for r in runs) for key in KEYS}
        rows[k] = first | med | {
            "tok_s": first["tokens"] / med["wall_s"],
            "full_tok_s": first["full_tokens"] / med["full_s"],
            "tail_tok_s": first["tail_tokens"] / med["tail_s"] if first["tail_tokens"] else None,
            "tail_share_of_time": med["tail_s"] / med["wall_s"],
            "tail_share_of_tokens": first["tail_tokens"] / first["tokens"],
        }
    base = rows.get(0)
    for k, row in rows.items():
        if base is not None:
            row["over_k0"] = row["tok_s"] / base["tok_s"]
            row["full_over_k0_full"] = row["full_tok_s"] / base["full_tok_s"]
        print(json.dumps({"k": k, **{key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}}),
              flush=True)
    if args.out:
        report = {"pair": str(args.pair), "dtype": args.dtype, "threads": args.threads, "batch": args.batch,
                  "prompts": len(prompts), "max_tokens": 64, "rounds": args.rounds, "code": code_version(),
                  "rows": [{"k": k, **row} for k, row in rows.items()]}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
