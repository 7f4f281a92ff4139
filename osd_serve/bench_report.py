"""Markdown tables of ``osd-serve bench`` reports: what benchmarks/ENGINE.md, GPU.md and the closing
notes show. Apart from bench.py, which measures, so a report written by any version renders here.

    python -m osd_serve.bench_report REPORT.json...   (or python -m osd_serve.bench REPORT.json...)
"""

from __future__ import annotations

import json

from kernels.cpu_linear import SKINNY_MAX_ROWS

from .bench import acceptance_model_ratios


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"  # reports written before v was measured lack it


def _outputs(match: int, n: int, mismatch: dict | None) -> str:
    """"16/16", or "60/64 (4 near-ties, gap ≤ 0.06)" where outputs differ; a split at a larger gap is
    named as what it is (it read "15/16 (0 near-ties, gap ≤ 4.2)")."""
    if not mismatch or not mismatch["differ"]:
        return f"{match}/{n}"
    ties, splits = mismatch["near_ties"], mismatch["differ"] - mismatch.get("length_only", 0)
    parts = []
    if splits > ties:
        parts.append(f"**{splits - ties} split{'s' * (splits - ties != 1)} not at a near-tie, gap up to "
                     f"{mismatch['max_gap']:.2g}: not lossless**")
    if ties:
        parts.append(f"{ties} near-tie{'s' * (ties != 1)}" + ("" if splits > ties else f", gap ≤ {mismatch['max_gap']:.2g}"))
    parts += [f"{mismatch['length_only']} length only"] if mismatch.get("length_only") else []
    return f"{match}/{n} ({'; '.join(parts)})"


def full_batch_over_best_k(report: dict, batch: int) -> float | None:
    """The "auto" run's tokens/s over the steps that ran a full batch (their draft and target time only)
    against the best fixed k's by the same measure: a loaded server's steady state. The whole run's
    ratio also weighs prefill and the batch's drain at the end, which depend on k but not on the choice
    within a full batch. None where a run had no full-batch step."""
    runs = [r for r in report["results"] if r["batch_size"] == batch]
    auto = next((r["full_batch_tok_s"] for r in runs if r["name"] == "engine_auto"), None)
    fixed = [r["full_batch_tok_s"] for r in runs if r["name"] == "engine"]
    return auto / max(fixed) if auto and fixed and None not in fixed else None


LEGEND = [
    "v = one target forward over k+1 tokens ÷ one over 1 token (the paper's S assumes v = 1); S(v) puts the measured v in. "
    "Prefill share: the engine's time prefilling prompts at that k, which S does not model; the last column "
    "leaves it out of both the engine at k and at k=0.",
    "",
    "Tokens/fwd ÷ i.i.d.: the measured tokens per target forward over the (1 − α^(k+1))/(1 − α) that S assumes "
    "(acceptance is correlated, and max_tokens cuts the last step: \"uncut\" counts only the steps it did not cut). "
    "measured/S(v, tokens): S with both v and tokens per forward measured, i.e. what is left for the loop; "
    "measured/analytic = tokens/fwd ÷ i.i.d. × (k·c + 1)/(k·c + v) × measured/S(v, tokens). "
    "Full batch: the same ratio over only the steps that ran a full batch, their draft and target time only "
    "(a loaded server's steady state: no drain at the end of the workload, no prefill). "
    "Loop share: the engine's time outside draft and target forwards and prefill (its bookkeeping). "
    "1st round ÷ median: far above 1 means the first round paid a warm-up the median leaves out.",
]
AUTO_LEGEND = ("k = auto: the engine choosing k each step from calibrated forward costs and the acceptance it "
               "measures (osd_serve/auto_k.py), against every fixed k of the same run.")


def summary_table(report: dict, title: str, legend: bool = True) -> str:
    """A markdown table of one bench report's summary (what the closing notes and benchmarks/ show).
    ``legend=False`` leaves out the column legends that are the same for every report (``main`` prints
    them once above several)."""
    rows = [
        f"### {title}",
        f"target {report['target_params'] / 1e6:.1f}M params, draft {report['draft_params'] / 1e6:.2f}M, "
        f"{report['prompts']} prompts x {report['max_tokens']} tokens, {report['device']} {report.get('dtype', 'float32')}"
        + (f" (draft {d})" if (d := report.get("draft_dtype", report.get("dtype"))) != report.get("dtype") else "")
        + ", "
        f"{report['threads']} threads, "
        + (f"target linears on oneDNN prepacked weights ({n}), " if (n := report.get("target_packed_linears")) else "")
        + (f"float32 calls of <= {SKINNY_MAX_ROWS} rows on kernels/cpu_skinny.cpp, " if report.get("target_skinny_kernel") else "")
        + f"median of {report.get('repeats', 1)} interleaved run(s) per decoder"
        + (f"; GPU {report['gpu']}, attention {report.get('attn_implementation')}" if report.get("gpu") else
           f"; CPU {cpu['model']}, native bf16: {', '.join(cpu['bf16_flags']) or 'none'}" if (cpu := report.get("cpu")) else "")
        + (f"; code {c['git']}{' (uncommitted changes)' if c['dirty'] else ''}" if (c := report.get("code")) and c.get("git") else ""),
        "",
        "| batch | c | best k | α | target alone tok/s | HF assisted tok/s (batch 1) | engine k=0 tok/s | engine tok/s | (c)/(a) | (c)/(b) | (c)/(b, k matched) | analytic S | measured/analytic | v | measured/S(v) | prefill share | measured/analytic, no prefill |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["summary"].items():
        rows.append(
            f"| {name.split('_')[1]} | {s['c']:.3f} | {s['best_k']} | {s['alpha_at_best_k']:.3f} | {s['target_alone_tok_s']:.1f} | "
            f"{s['hf_assisted_tok_s']:.1f} | {s['engine_k0_tok_s']:.1f} | {s['best_engine_tok_s']:.1f} | "
            f"{s['speedup_vs_target_alone']:.2f} | {s['speedup_vs_hf_assisted']:.2f} | {_f(s.get('speedup_vs_hf_assisted_matched_k'))} | "
            f"{s['analytic_speedup_at_best_k']:.2f} | "
            f"{s['measured_over_analytic']:.2f} | {_f(s.get('verify_cost_at_best_k'))} | {_f(s.get('measured_over_analytic_measured_v'))} | "
            f"{_f(s.get('prefill_share_at_best_k'))} | {_f(s.get('measured_decode_only_over_analytic'))} |"
        )
    rows += [
        "",
        "HF assisted (b): transformers runs assisted generation at batch 1 only, so it decodes the prompts one at "
        "a time at every batch size, with the draft's own HF drafting settings ("
        + (", ".join(f"{n} {v}" for n, v in hf.items()) if (hf := report.get("hf_assisted_settings"))
           else "not recorded in this report; HF's defaults drafted up to 20 tokens a step, stopping below confidence 0.4")
        + "), whatever the engine's k; (b, k matched) is HF assisted drafting exactly the engine's k, with no "
        "confidence cut-off. At batch 8, (c)/(b) therefore compares the engine's batch with what HF's "
        "assisted generation can do for the same requests.",
        *(["", *LEGEND] if legend else []),
        "",
        "| batch | k | α | tokens/target fwd | tokens/fwd ÷ i.i.d. | uncut ÷ i.i.d. | rows/step | analytic S | (c)/(a) | (c)/(b) | (c)/(b, k matched) | "
        "measured/analytic | v | S(v) | measured/S(v) | measured/S(v, tokens) | measured/analytic, no prefill | "
        "full batch: measured/analytic | loop share | 1st round ÷ median | outputs = target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["summary"].items():
        for k, r in s["per_k"].items():
            # reports written before these ratios were stored: recompute what their fields allow
            measured = r["measured_over_analytic"] * r["analytic_speedup"]
            r = acceptance_model_ratios(measured, int(k), s["c"], r["alpha"], r.get("verify_cost"),
                                        r["tokens_per_target_forward"], r.get("uncut_tokens_per_target_forward")) | r
            rows.append(
                f"| {name.split('_')[1]} | {k} | {r['alpha']:.3f} | {r['tokens_per_target_forward']:.2f} | "
                f"{r['tokens_over_expected']:.2f} | {_f(r['uncut_tokens_over_expected'])} | {_f(r.get('rows_per_step'))} | "
                f"{r['analytic_speedup']:.2f} | "
                f"{r['speedup_vs_target_alone']:.2f} | {r['speedup_vs_hf_assisted']:.2f} | {_f(r.get('speedup_vs_hf_assisted_matched_k'))} | "
                f"{r['measured_over_analytic']:.2f} | "
                f"{_f(r.get('verify_cost'))} | {_f(r.get('analytic_speedup_measured_v'))} | "
                f"{_f(r.get('measured_over_analytic_measured_v'))} | {_f(r['measured_over_analytic_measured_v_tokens'])} | "
                f"{_f(r.get('measured_decode_only_over_analytic'))} | {_f(r.get('full_batch_measured_over_analytic'))} | "
                f"{_f(r.get('loop_share'))} | {_f(r.get('first_round_over_median'))} | "
                f"{_outputs(r['outputs_match_target'], report['prompts'], r.get('mismatch'))} |"
            )
    autos = [(name, s["auto"]) for name, s in report["summary"].items() if "auto" in s]  # reports since "auto"
    if autos:
        rows += [
            *(["", AUTO_LEGEND] if legend else []),
            "",
            "| batch | auto tok/s | ÷ best k | ÷ k=1..K | full batch ÷ best k | steps at each k | (c)/(a) | (c)/(b) | outputs = target |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, a in autos:
            rows.append(
                f"| {name.split('_')[1]} | {a['tok_s']:.1f} | {a['over_best_k']:.2f} | "
                f"{' '.join(f'{x:.2f}' for x in a['over_each_k'].values())} | "
                f"{_f(full_batch_over_best_k(report, int(name.split('_')[1])))} | "
                f"{', '.join(f'{k}: {n}' for k, n in a['k_steps'].items())} | {a['speedup_vs_target_alone']:.2f} | "
                f"{a['speedup_vs_hf_assisted']:.2f} | {_outputs(a['outputs_match_target'], report['prompts'], a.get('mismatch'))} |"
            )
    return "\n".join(rows)


def main(paths: list[str]) -> None:
    from pathlib import Path

    # Several reports (benchmarks/ENGINE.md renders 13): their shared legends once, above them all
    legend = len(paths) < 2  # none: nothing to print, legends included
    if not legend:
        print("\n".join(["## Column legends", "", *LEGEND, "", AUTO_LEGEND]), end="\n\n")
    for path in paths:
        print(summary_table(json.loads(Path(path).read_text()), Path(path).stem, legend), end="\n\n")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
