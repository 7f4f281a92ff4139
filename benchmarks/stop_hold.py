"""The cost of a stream's stop-string hold-back per engine step (osd_serve/output.py StopScan), for one
row of repetitive output ("a" repeated), with 16 stops a client may send: benign ones ("Q" repeated,
never a prefix of the text) against adversarial ones ("a" * 16 then "Q" repeated: every place in the
text starts a 16-character partial match that then fails). Both time StopScan.hold, what
Request.delta calls each step, in interleaved rounds; the ratio is the point. The search StopScan replaced tested every such
place each step, quadratic in the stop's length: 26 ms a step for this row at 8,000 characters.

    python benchmarks/stop_hold.py [--stop-chars 6000] [--steps 2000] [--chars-per-step 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from osd_serve.output import StopScan


def _per_step_ms(stops: list[str], steps: int, chars: int) -> float:
    scan, text = StopScan(stops), ""  # made at a request's first delta, its failure tables included
    t0 = time.perf_counter()
    for _ in range(steps):
        text += "a" * chars  # what a step appends
        scan.hold(text, len(text))
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stop-chars", type=int, default=6000)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--chars-per-step", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.stop_chars
    kinds = {"benign": [f"{i:02d}" + "Q" * (n - 2) for i in range(16)],
             "adversarial": ["a" * 16 + "Q" * (n - 18) + f"{i:02d}" for i in range(16)]}
    times = {k: [] for k in kinds}
    for _ in range(args.rounds):  # interleaved, so drift of a shared machine hits both alike
        for k, stops in kinds.items():
            times[k].append(_per_step_ms(stops, args.steps, args.chars_per_step))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"text_chars": args.steps * args.chars_per_step, "stop_chars": n, "stops": 16,
                      "ms_per_step": med, "adversarial_over_benign": med["adversarial"] / med["benign"]}))


if __name__ == "__main__":
    main()
