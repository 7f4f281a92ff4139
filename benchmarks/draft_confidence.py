"""Would stopping the draft early when it is unsure beat a fixed k? A replay over one engine bench report.

Hugging Face's assisted generation (decoder (b) of the bench) stops drafting once the draft's own
probability of its token falls under a threshold; osd-serve drafts a fixed k per request. This script
asks whether the draft's confidence predicts acceptance well enough to be worth it, on the bench's own
pair, prompts and max_tokens (all read from the report):

1. the target's greedy outputs (the engine at k=0, which the bench checks against the target alone);
2. teacher-forced over them, at every position the draft's top probability ("confidence") and whether
   its argmax is the target's token (greedy acceptance);
3. a calibration table, confidence bin against acceptance;
4. a replay of continuous batching at each batch size of the report (admission as in the engine; k capped
   by the tokens left, which the engine counts to max_tokens and the replay also to an EOS the target
   reaches) for fixed k = 1..8, and for the early stop: after each drafted token, stop once no row's
   running product of confidences reaches tau (the token just drafted is still verified).

The replay is a cost model, not a timing: a step costs drafted·c + v(verified), with the report's measured
c and v (v(0) = 1), and the speedup is over plain decoding of the same outputs with the same batching.
Tokens are exact: a greedy step accepts the longest matching prefix of what it verifies. One
approximation: after a row's first mismatch its later confidences are the teacher-forced ones (the
draft's would come from a wrong prefix), which touches only the stopping decision. The fixed-k rows are
printed beside the bench's measured speedup over engine k=0, to show how far the model is to be trusted.

    python benchmarks/draft_confidence.py --report benchmarks/results/engine_default_pair.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from osd_serve.cli import _read_prompts
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.loading import ModelConfig, load_pair

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
TAUS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7)


@torch.inference_mode()
def teacher_forced(report: dict) -> list[dict]:
    """Per prompt: conf [n] float (draft's top probability) and match [n] bool, over the target's output."""
    target, draft, tok = load_pair(ModelConfig(target=report["target"], draft=report["draft"], dtype=report["dtype"],
                                               draft_dtype=report.get("draft_dtype", report["dtype"]), device=report["device"]))
    # The file the bench measured (a report from before it was recorded: the pair's own prompts.jsonl,
    # the only file such a report could have used without --prompts)
    path = report.get("prompts_file") or str(Path(report["target"]).parent / "prompts.jsonl")
    prompts = _read_prompts(path)[: report["prompts"]]
    ids = [tok.encode(p) for p in prompts]
    outs = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=8)).generate(
        ids, SamplingParams(max_tokens=report["max_tokens"], num_speculative_tokens=0))
    seqs = []
    for p, o in zip(ids, outs):
        y = torch.tensor(o.token_ids)  # [n]
        x = torch.tensor([p + o.token_ids], device=draft.device)  # [1, P+n]
        logits = draft(x).logits[0, len(p) - 1: len(p) + len(y) - 1].float().cpu()  # [n, V] predicts y
        conf, arg = torch.softmax(logits, -1).max(-1)  # [n], [n]
        seqs.append({"conf": conf.tolist(), "match": (arg == y).tolist()})
    return seqs


def calibration(seqs: list[dict]) -> list[dict]:
    pairs = [(c, m) for s in seqs for c, m in zip(s["conf"], s["match"])]
    rows = []
    for lo, hi in itertools.pairwise(BINS):
        sel = [m for c, m in pairs if lo <= c < hi or (hi == 1.0 and c == 1.0)]
        rows.append({"conf": f"{lo:.1f}-{hi:.1f}", "n": len(sel), "accept": sum(sel) / len(sel) if sel else None})
    return rows


def replay_cost(seqs: list[dict], batch: int, c: float, v: list[float], k: int, tau: float | None = None) -> float:
    """Modelled cost of decoding every output, in target forwards of one token per row: fixed k when
    tau is None, else drafting up to k with the early stop. k=0 is plain decoding (each step costs
    v[0] = 1 and emits one token per row), the baseline every speedup here divides."""
    waiting, running, pos = list(range(len(seqs))), [], {}
    cost = 0.0
    while waiting or running:
        while waiting and len(running) < batch:  # the engine admits between steps
            i = waiting.pop(0)
            running.append(i)
            pos[i] = 0
        k_row = {i: min(k, len(seqs[i]["conf"]) - pos[i] - 1) for i in running}  # capped by the tokens left
        cum = dict.fromkeys(running, 1.0)
        drafted = 0
        for j in range(max(k_row.values())):
            drafted = j + 1
            for i in running:
                cum[i] = cum[i] * seqs[i]["conf"][pos[i] + j] if j < k_row[i] else 0.0
            if tau is not None and max(cum.values()) < tau:
                break
        cost += drafted * c + v[drafted]
        for i in list(running):
            n, a = min(k_row[i], drafted), 0
            while a < n and seqs[i]["match"][pos[i] + a]:
                a += 1
            pos[i] += a + 1
            if pos[i] >= len(seqs[i]["conf"]):
                running.remove(i)
    return cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, type=Path, help="an engine bench report (benchmarks/results/engine_*.json)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    report = json.loads(a.report.read_text())
    seqs = teacher_forced(report)
    cal = calibration(seqs)
    n = sum(r["n"] for r in cal)
    mean_conf = sum(c for s in seqs for c in s["conf"]) / n
    accept = sum(m for s in seqs for m in s["match"]) / n
    print(f"{a.report.name}: {n} positions, mean draft confidence {mean_conf:.3f}, greedy acceptance {accept:.3f}")
    print("confidence  positions  acceptance")
    for r in cal:
        rate = "-" if r["accept"] is None else f"{r['accept']:.2f}"
        print(f"{r['conf']:>10}  {r['n']:>9}  {rate:>10}")
    results = {"report": str(a.report), "mean_confidence": mean_conf, "acceptance": accept, "calibration": cal, "batches": {}}
    for key, s in report["summary"].items():
        batch = int(key.split("_")[1])
        ks = sorted(int(k) for k in s["per_k"])
        v = [1.0] + [s["per_k"][str(k)]["verify_cost"] for k in ks]
        plain = replay_cost(seqs, batch, s["c"], v, 0)
        fixed = {k: plain / replay_cost(seqs, batch, s["c"], v, k) for k in ks}
        measured = {k: s["per_k"][str(k)]["tok_s"] / s["engine_k0_tok_s"] for k in ks}
        stop = {tau: plain / replay_cost(seqs, batch, s["c"], v, max(ks), tau) for tau in TAUS}
        best_k, best_tau = max(fixed, key=fixed.get), max(stop, key=stop.get)
        print(f"\nbatch {batch}, c = {s['c']:.3f}: modelled speedup over plain decoding (bench's measured over engine k=0)")
        print("  fixed k   " + "  ".join(f"{k}: {fixed[k]:.2f} ({measured[k]:.2f})" for k in ks))
        print(f"  stop, k<={max(ks)} " + "  ".join(f"{t}: {stop[t]:.2f}" for t in TAUS))
        print(f"  best fixed k={best_k}: {fixed[best_k]:.2f}; best early stop tau={best_tau}: {stop[best_tau]:.2f} "
              f"({stop[best_tau] / fixed[best_k]:.2f}x the best fixed k)")
        results["batches"][batch] = {"c": s["c"], "modelled_fixed": fixed, "measured_fixed_over_k0": measured,
                                     "modelled_early_stop": stop, "best_k": best_k, "best_tau": best_tau}
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
