"""What running streams see when a long prompt arrives, at several ``prefill_chunk_tokens`` (osd_serve/prefill.py).

Four streams decode; after a few steps a prompt of ``--long`` tokens is queued. Measured per budget, in
interleaved rounds (each a fresh engine on the same loaded pair), from that moment until the long request
has its first token:
- ``max_gap_s``: the longest engine step, which is the longest any running stream waited for a token;
- ``ttft_s``: the long request's time to its first token;
- ``stream_tokens``: tokens the four streams gained meanwhile.

    python benchmarks/prefill_budget.py --pair DIR [--budgets none 1024 256] [--out FILE.json]
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import interleaved, load_for, pair_args  # noqa: E402
from osd_serve.config import EngineConfig, SamplingParams  # noqa: E402
from osd_serve.engine import SpecEngine  # noqa: E402


def _run(target, draft, tok, budget: int | None, long_len: int, k: int) -> dict:
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=5, prefill_chunk_tokens=budget))
    params = SamplingParams(max_tokens=200, num_speculative_tokens=k, ignore_eos=True)  # outlast the long prefill
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    streams = [eng.add_request(torch.randint(3, vocab, (20,), generator=g).tolist(), params) for _ in range(4)]
    for _ in range(3):
        eng.step()
    long_id = eng.add_request(torch.randint(3, vocab, (long_len,), generator=g).tolist(),
                              SamplingParams(max_tokens=4, num_speculative_tokens=k, ignore_eos=True))
    t0, gaps, gained = time.perf_counter(), [], 0
    while True:
        s = time.perf_counter()
        deltas, _ = eng.step()
        gaps.append(time.perf_counter() - s)
        gained += sum(len(d.token_ids) for d in deltas if d.request_id in streams)
        if any(d.request_id == long_id and d.token_ids for d in deltas):
            break
    ttft = time.perf_counter() - t0
    eng.reset()
    return {"max_gap_s": max(gaps), "ttft_s": ttft, "stream_tokens": gained, "steps": len(gaps)}


def main() -> None:
    ap = pair_args(__doc__.split("\n\n")[0], rounds=3)
    ap.add_argument("--budgets", nargs="+", default=["none", "1024", "256"])
    ap.add_argument("--long", type=int, default=1800, help="tokens of the prompt that arrives")
    args = ap.parse_args()
    target, draft, tok = load_for(args)
    budgets = [None if b == "none" else int(b) for b in args.budgets]
    runs = interleaved({str(b): functools.partial(_run, target, draft, tok, b, args.long, args.k) for b in budgets},
                       args.rounds)
    rows = []
    for b in budgets:
        got = runs[str(b)]
        rows.append({"prefill_chunk_tokens": b, **{key: round(statistics.median(x[key] for x in got), 4)
                                                    for key in ("max_gap_s", "ttft_s", "stream_tokens", "steps")}})
    base = rows[0]
    for row in rows:  # ratios to the first budget (none: the old one-forward prefill), within this run
        row["max_gap_vs_first"] = round(row["max_gap_s"] / base["max_gap_s"], 3)
        row["ttft_vs_first"] = round(row["ttft_s"] / base["ttft_s"], 3)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"pair": args.pair, "long_prompt": args.long, "k": args.k,
                                              "rounds": args.rounds, "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
