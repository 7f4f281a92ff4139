"""A disaggregated Verifier's call when a long new sequence joins decoding ones: its prompt prefilled in a
forward of its own (prefill.apart) against the whole batch padded to it (the behaviour before), same
target and items, interleaved rounds. In process: the Verifier's compute, without Ray Serve.

    python benchmarks/disagg_apart.py --pair DIR [--decoding 7] [--long 1800] [--out FILE.json]
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

import osd_serve.disagg as disagg  # noqa: E402
from benchmarks.rounds import interleaved, load_for, pair_args  # noqa: E402
from osd_serve.disagg import Sampling, TargetVerifier, VerifyItem  # noqa: E402


def _call(target, decoding: int, long_len: int, k: int, apart: bool) -> float:
    """Seconds of the verify call that brings the long sequence, the decoding ones' caches warm."""
    disagg.APART_OVERHEAD = 32 if apart else 10**9  # 10**9: no history is ever long enough to look at
    v = TargetVerifier(target, target.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    hists = [torch.randint(3, vocab, (20,), generator=g).tolist() for _ in range(decoding)]
    v.verify([VerifyItem(f"d{i}", h, [3] * k, None, Sampling()) for i, h in enumerate(hists)])
    items = [VerifyItem(f"d{i}", h + [3] * (k + 1), [4] * k, None, Sampling()) for i, h in enumerate(hists)]
    items.append(VerifyItem("new", torch.randint(3, vocab, (long_len,), generator=g).tolist(), [5] * k, None, Sampling()))
    t0 = time.perf_counter()
    v.verify(items)
    return time.perf_counter() - t0


def main() -> None:
    ap = pair_args(__doc__.split("\n\n")[0], rounds=5)
    ap.add_argument("--decoding", type=int, default=7)
    ap.add_argument("--long", type=int, default=1800)
    args = ap.parse_args()
    target, _, _ = load_for(args)
    times = interleaved({label: functools.partial(_call, target, args.decoding, args.long, args.k, label == "apart")
                         for label in ("padded", "apart")}, args.rounds)
    med = {label: statistics.median(t) for label, t in times.items()}
    row = {"decoding": args.decoding, "long_prompt": args.long, "k": args.k, "rounds": args.rounds,
           "padded_s": round(med["padded"], 4), "apart_s": round(med["apart"], 4),
           "speedup": round(med["padded"] / med["apart"], 3)}
    print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
