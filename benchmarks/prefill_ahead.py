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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import ab_args, load_for, on_off_by_k, pair_prompts  # noqa: E402
from osd_serve.bench import mismatches, timed  # noqa: E402
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
    args = ab_args(__doc__.split("\n\n")[0], ks=[0, 2, 5]).parse_args()
    target, draft, tok = load_for(args)
    prompts = pair_prompts(args.pair, tok, args.prompts)
    rows = []
    run = functools.partial(_run, target, draft, tok, prompts, args.batch)
    for k, (m_on, m_off, on, off) in on_off_by_k(run, args.ks, args.rounds, ("tok_s", "prefill_s", "prefill_forwards")).items():
        row = {"k": k, **{f"{name}_{key}": round(v, 4) for name, m in (("on", m_on), ("off", m_off)) for key, v in m.items()},
               "tok_s_on_over_off": round(m_on["tok_s"] / m_off["tok_s"], 3),
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
