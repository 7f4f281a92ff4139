"""Markdown report of the online-distillation experiments (issue 3) from their result.json files.

    python benchmarks/osd_report.py benchmarks/results/osd > benchmarks/OSD.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from osd_serve.replay import rolling_mean

STREAMS = ["gsm8k", "spider", "mbpp", "alpaca", "shift"]


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def _identical(r: dict) -> str:
    """Whether every run's outputs equalled the online run's; "-" with one run, nothing to compare (a
    result.json from before replay wrote None there holds True for a run compared with itself)."""
    if len(r["runs"]) < 2 or r.get("outputs_identical") is None:
        return "-"
    return str(r["outputs_identical"])


def segments(sources):
    """[(source, start, end)] runs of equal source, in order."""
    segs, start = [], 0
    for i in range(1, len(sources) + 1):
        if i == len(sources) or sources[i] != sources[start]:
            segs.append((sources[start], start, i))
            start = i
    return segs


def _mean(xs):
    xs = [v for v in xs if v is not None]
    return sum(xs) / len(xs) if xs else None


def adaptation(result, run="online", window=10, frac=0.9):
    """Per segment: its own plateau (mean α over the last quarter), the offline draft's plateau on
    the same requests (a fixed reference: what a draft that knows the domain reaches), and the
    requests after the shift until the trailing-window mean first reaches frac x each."""
    alpha = [t["acceptance"] for t in result["runs"][run]["per_request"]]
    off = [t["acceptance"] for t in result["runs"]["offline"]["per_request"]] if "offline" in result["runs"] else None
    rows = []
    for src, a, b in segments(result["sources"]):
        seg = alpha[a:b]
        q = max(1, len(seg) // 4)
        plateau = _mean(seg[-q:])
        ref = _mean(off[a:b][-q:]) if off else None
        roll = rolling_mean(seg, window)

        def reach(level):
            return next((i + 1 for i, v in enumerate(roll) if i >= window - 1 and level and v >= frac * level), None)

        rows.append({"source": src, "start": a, "requests": b - a, "plateau": plateau, "offline_plateau": ref,
                     "first_window": _mean(seg[:window]), "second_half": _mean(seg[len(seg) // 2 :]),
                     "requests_to_90pct": reach(plateau), "requests_to_90pct_offline": reach(ref)})
    return rows


def main(root: str) -> None:
    root = Path(root)
    res = {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob("*/result.json"))}
    # replay rewrites result.json after each run: one it did not finish (interrupted, failed) has
    # "complete": false and lacks later runs; it is named, not reported
    for name in [n for n, r in res.items() if r.get("complete") is False]:
        print(f"(skipped {name}: its replay did not finish)", file=sys.stderr)
        del res[name]
    print("# Online distillation experiments (issue 3)\n")
    print("Regenerate: `bash benchmarks/run_osd_experiments.sh` (runs every stream, then this report).")
    print("Pair: `osd-serve bootstrap --preset osd --data gsm8k/train spider/train mbpp alpaca` (target 29.9M,")
    print("draft 1.2M briefly pre-trained, never distilled). Greedy, k=4, 64 new tokens, batch 8, 2 CPU threads.")
    print("α is greedy acceptance per tested draft position; *final* is the mean over the last 20% of requests.")
    print("*offline* is a copy of the draft distilled beforehand on the whole stream's target outputs, then frozen.\n")
    print("| stream | requests | static α | offline α | online α | online − static | online / offline | "
          "online α̂ | updates (published) | tok/s training ÷ idle | outputs identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in STREAMS + sorted(set(res) - set(STREAMS)):
        if name not in res:
            continue
        r = res[name]
        runs = r["runs"]
        st, off, on = (runs.get(k, {}).get("final_alpha") for k in ("static", "offline", "online"))
        tp = r.get("throughput_while_training") or {}
        print(f"| {name} | {r['requests']} | {_f(st)} | {_f(off)} | {_f(on)} | "
              f"{_f(on - st if on is not None and st is not None else None, 3)} | "
              f"{_f(on / off if on and off else None, 2)} | {_f(runs['online'].get('final_expected_alpha'))} | "
              f"{runs['online']['updates']} ({runs['online']['published']}) | {_f(tp.get('ratio'), 2)} | "
              f"{_identical(r)} |")
    print()
    if "shift" in res:
        print("## Adaptation after each shift (online run)\n")
        print("Requests after the shift until the trailing 10-request mean α first reaches 90% of a plateau: the")
        print("online run's own (mean over the segment's last quarter) and the offline draft's on the same requests.")
        print("The second-half mean shows whether the online draft stayed there.\n")
        print("| segment | starts at | requests | static plateau | offline plateau | online first 10 | online plateau | "
              "online 2nd-half mean | requests to 90% of own | requests to 90% of offline |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        static = {s["source"]: s for s in adaptation(res["shift"], "static")} if "static" in res["shift"]["runs"] else {}
        for s in adaptation(res["shift"]):
            print(f"| {s['source']} | {s['start']} | {s['requests']} | {_f(static.get(s['source'], {}).get('plateau'))} | "
                  f"{_f(s['offline_plateau'])} | {_f(s['first_window'])} | {_f(s['plateau'])} | {_f(s['second_half'])} | "
                  f"{s['requests_to_90pct']} | {s['requests_to_90pct_offline']} |")
        print()
    keep = {n: r for n, r in res.items() if r.get("record_bytes")}
    if keep:
        print("## Which positions to record\n")
        print("| run | keep | bytes per record | kept positions per record | online α (final) |")
        print("|---|---|---|---|---|")
        for n, r in sorted(keep.items()):
            b = r["record_bytes"]
            print(f"| {n} | {b['keep']} | {b['mean']:.0f} | {b['positions_mean']:.1f} | {_f(r['runs']['online']['final_alpha'])} |")
        print()
    print("## Figures\n")
    for name in res:
        print(f"- {name}: `results/osd/{name}/alpha.png`")
    caveats = Path(__file__).with_name("osd_caveats.md")  # written by hand: how the results above were made
    if caveats.is_file():
        print()
        print(caveats.read_text(), end="")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/osd")
