"""Disaggregated against colocated, from two http_bench.py reports of one run (run_topology_bench.sh).

    python benchmarks/topology_report.py colocated.json disaggregated.json out.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    co, dis = (json.loads(Path(p).read_text()) for p in sys.argv[1:3])
    by = {(name, r["concurrency"], r["k"]): r for name, rep in (("colocated", co), ("disaggregated", dis)) for r in rep["rows"]}
    rows = []
    for (name, conc, k), r in sorted(by.items(), key=lambda x: (x[0][1], -x[0][2], x[0][0])):
        if name != "disaggregated":
            continue
        c = by[("colocated", conc, k)]
        rows.append({"concurrency": conc, "k": k,
                     "colocated": {m: c[m] for m in ("p50_s", "p99_s", "tokens_per_s")},
                     "disaggregated": {m: r[m] for m in ("p50_s", "p99_s", "tokens_per_s")},
                     "tokens_per_s_disagg_over_colocated": r["tokens_per_s"] / c["tokens_per_s"],
                     "p50_disagg_over_colocated": r["p50_s"] / c["p50_s"]})
    out = {"trace": co.get("trace"), "max_tokens": co.get("max_tokens"), "rows": rows,
           "speculation": {"colocated": co["summary"], "disaggregated": dis["summary"]}}
    print(f"{'conc':>4} {'k':>2} | {'colocated p50/p99 s':>20} {'tok/s':>7} | {'disagg p50/p99 s':>18} {'tok/s':>7} | tok/s ratio")
    for r in rows:
        c, d = r["colocated"], r["disaggregated"]
        print(f"{r['concurrency']:>4} {r['k']:>2} | {c['p50_s']:>9.2f} / {c['p99_s']:<8.2f} {c['tokens_per_s']:>7.1f} | "
              f"{d['p50_s']:>8.2f} / {d['p99_s']:<7.2f} {d['tokens_per_s']:>7.1f} | {r['tokens_per_s_disagg_over_colocated']:.2f}")
    Path(sys.argv[3]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
