"""Prompts prefilled ahead (EngineConfig.prefill_ahead, engine._prefill) against prefilling only the free
slots, on the bench's batch-8 workload: the pair's prompts.jsonl, greedy, 64 tokens each, more prompts than
slots, so after the first group rows free and are refilled a few at a time.

Each variant is a fresh engine on the same loaded pair, run in interleaved rounds (benchmarks/rounds.py).
Per k: the whole run's tokens/s (prefill included, as `osd-serve bench` times the engine), its seconds
spent prefilling, prefill forwards, and on/off ratios within this run; and how the outputs of on and off differ
(in float32 they are equal; in bf16 a different batch can split at a near-tie, osd_serve.bench.mismatches).

    python benchmarks/prefill_ahead.py --pair DIR [--dtype bfloat16] [--ks 0 2 5] [--prompts 16] [--out FILE.json]
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import interleaved, load_for, pair_args  # noqa: E402
from osd_serve.bench import mismatches, timed  # noqa: E402
from osd_serve.cli import _read_prompts  # noqa: E402
from osd_serve.config import EngineConfig, SamplingParams  # noqa: E402
from osd_serve.engine import SpecEngine  # noqa: E402


def _run(target, draft, tok, prompts, batch: int, k: int, ahead: bool) -> dict:
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=batch, prefill_ahead=ahead))
    calls = []
    prefill = eng._prefill
    eng._prefill = lambda new, room: (calls.append(len(new)), prefill(new, room))[1]  # counts forwards only
    stats: list = []
    params = SamplingParams(max_tokens=64, num_speculative_tokens=k, ignore_eos=True)
    outs, wall = timed(lambda: eng.generate(prompts, params, stats=stats))
    return {"tok_s": sum(len(o.token_ids) for o in outs) / wall, "prefill_s": sum(s.prefill_time for s in stats),
            "prefill_forwards": len(calls), "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = pair_args(__doc__.split("\n\n")[0], rounds=3)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 2, 5])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    target, draft, tok = load_for(args)
    prompts = [tok(p)["input_ids"] for p in _read_prompts(str(Path(args.pair) / "prompts.jsonl"))[: args.prompts]]
    runs = {f"{k}/{on}": functools.partial(_run, target, draft, tok, prompts, args.batch, k, on)
            for k in args.ks for on in (True, False)}
    got = interleaved(runs, args.rounds)
    rows = []
    for k in args.ks:
        on, off = got[f"{k}/True"], got[f"{k}/False"]
        med = {name: {key: statistics.median(x[key] for x in r) for key in ("tok_s", "prefill_s", "prefill_forwards")}
               for name, r in (("on", on), ("off", off))}
        row = {"k": k, **{f"{name}_{key}": round(v, 4) for name, m in med.items() for key, v in m.items()},
               "tok_s_on_over_off": round(med["on"]["tok_s"] / med["off"]["tok_s"], 3),
               # on against off, each round: a difference must split at a near-tie (bf16 rows batched otherwise)
               "on_vs_off_outputs": [mismatches(target, prompts, a["outputs"], b["outputs"]) for a, b in zip(on, off)]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"pair": args.pair, "dtype": str(target.dtype), "batch": args.batch,
                                              "prompts": len(prompts), "rounds": args.rounds, "threads": args.threads,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
