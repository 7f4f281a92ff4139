"""`osd-serve bench`: this engine against the target alone and HF assisted generation, one run.

Every decoder gets the same pair, prompts, max_tokens and greedy decoding; speedups are ratios of
tokens/s measured in the same process, so machine speed cancels out.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kernels.cpu_linear import PackedLinear

from .auto_k import expected_tokens, filled_cache, timed_forward
from .bench_hf import HF_ASSISTED_BATCH, hf_assisted_settings, hf_generate, hf_matched_k
from .config import EngineConfig, SamplingParams
from .engine import SpecEngine
from .output import check_prompt


def analytic_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """S = (1 - α^(k+1)) / ((1 - α)(k·c + v)), Leviathan et al.; α=1 is the limit (k+1)/(k·c+v).

    v = verify_cost, one target forward over k+1 tokens ÷ one over a single token. The paper's S
    takes v = 1 (verification is as cheap as decoding, true while decoding is bound by reading the
    weights); the bench also reports S with v measured, which shows how much of the gap between
    measured and analytic is the target's own cost growth rather than engine overhead.
    """
    return expected_tokens(alpha, k) / (k * c + verify_cost)


def acceptance_model_ratios(measured: float, k: int, c: float, alpha: float, v: float | None, tokens: float,
                            uncut: float | None = None) -> dict:
    """Splits measured/analytic into its factors. S = expected_tokens / (k·c + 1), so
    measured/S = (tokens ÷ expected) × ((k·c + 1) ÷ (k·c + v)) × measured/S(v, tokens), where the last
    factor, measured over S with both the tokens per forward and v measured, is what is left for the
    loop itself (drain, prefill, overheads). ``uncut``: tokens per forward over the steps that max_tokens
    and EOS did not cut (see _uncut_tokens_per_forward), which separates that cut from correlated acceptance."""
    expected = expected_tokens(alpha, k)
    return {
        "tokens_over_expected": tokens / expected,
        "uncut_tokens_over_expected": uncut / expected if uncut is not None else None,
        "measured_over_analytic_measured_v_tokens": measured * (k * c + v) / tokens if v is not None else None,
    }


# Logit gap (below the top one) under which the target's own argmax may flip between batch shapes:
# float32 sums reorder at ~1e-6 relative; bfloat16 resolves logits of size ~10 to ~0.06 (larger
# logits: divergence's two steps of the dtype).
NEAR_TIE = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.02}


@torch.inference_mode()
def divergence(model, prompt: list[int], ref: list[int], got: list[int]) -> tuple[float, float]:
    """(gap, tie) at the first position where ``got`` leaves ``ref``, on the target's logits at batch 1:
    gap, how far the lower of the two tokens that split lies below the top logit; tie, the gap under
    which that is a numerical near-tie (NEAR_TIE, or two steps of the dtype at that logit if larger:
    a bfloat16 step is 0.125 at 16-32, 0.25 at 32-64)."""
    j = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    logits = model(torch.tensor([prompt + ref[:j]], device=model.device)).logits[0, -1].float()  # [V]
    top = logits.max()
    gap = float(top - torch.minimum(logits[ref[j]], logits[got[j]]))
    t = top.abs().to(model.dtype)
    step = float(torch.nextafter(t, t.new_tensor(float("inf"))) - t)  # the dtype's step at the top logit
    return gap, max(NEAR_TIE.get(model.dtype, 1e-4), 2 * step)


def mismatches(model, prompts: list[list[int]], outs: list[list[int]], refs: list[list[int]]) -> dict:
    """Outputs that differ from the reference; of those, the ones that split from it at a near-tie, and
    the largest gap at a split (a split at a large gap would be a lossless bug); ``length_only``: ones
    that agree wherever both have tokens but stop elsewhere (both keep EOS, so an EOS near-tie is a split:
    this is a row ended by an error, or a max_tokens cut)."""
    gaps, length_only = [], 0
    for p, o, r in zip(prompts, outs, refs):
        if o == r:
            continue
        if any(a != b for a, b in zip(o, r)):
            gaps.append(divergence(model, p, r, o))
        else:
            length_only += 1
    return {"differ": len(gaps) + length_only, "near_ties": sum(g < tie for g, tie in gaps),
            "max_gap": max((g for g, _ in gaps), default=None), "length_only": length_only}


@torch.inference_mode()
def forward_cost(model, batch: int, context: int, vocab: int, device, repeats: int = 30, tokens: int = 1) -> float:
    """Median seconds of one forward appending ``tokens`` new tokens per row to a KV cache of
    ``context`` tokens (1: a decode step; k+1: a verification), after 3 warm-up forwards."""
    kv = filled_cache(model, batch, context, vocab, device)
    times = [timed_forward(kv, tokens, vocab) for _ in range(repeats + 3)]
    return statistics.median(times[3:])


def cpu_info() -> dict:
    """The CPU a report was measured on: runs on different hosts are not comparable, and whether bf16
    is native (AVX512-BF16, AMX) decides how verification cost grows with k (benchmarks/ENGINE.md)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")  # closed, not left to the collector
    except OSError:  # not Linux
        return {}

    def field(name: str) -> str:  # the first processor's value
        return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith(name)), "")

    flags = set(field("flags").split())
    return {"model": field("model name"), "bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})}


def code_version() -> dict:
    """Which code a report measured: git commit, whether the tree changed (not counting benchmarks/ outputs), libraries."""
    import transformers

    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10)  # noqa: E731
    try:
        sha, status = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results", ":!benchmarks/*.md")
        commit = sha.stdout.strip() if sha.returncode == 0 else None
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):  # no git: an installed copy
        commit, dirty = None, None
    return {"git": commit, "dirty": dirty, "torch": torch.__version__, "transformers": transformers.__version__}


@dataclass
class DecoderResult:
    name: str
    batch_size: int
    tokens: int
    seconds: float
    k: int | None = None
    alpha: float | None = None  # per-position acceptance: accepted / (accepted + rejections)
    acceptance_rate: float | None = None  # accepted / proposed (vLLM's draft acceptance rate)
    tokens_per_target_forward: float | None = None
    analytic_speedup: float | None = None
    verify_cost: float | None = None  # v: target forward over k+1 tokens ÷ over 1 (see analytic_speedup)
    analytic_speedup_measured_v: float | None = None  # S with that v instead of 1
    outputs_match_target: int | None = None  # prompts whose output equals the target-alone output
    mismatch: dict | None = None  # see mismatches(): differing outputs, of which near-ties, largest gap
    rows_per_step: float | None = None  # mean running rows per engine step (the batch's real occupancy)
    prefill_seconds: float | None = None  # engine: of ``seconds``, the time spent prefilling prompts (median)
    # engine: tokens per target forward over the steps that max_tokens and EOS did not cut
    uncut_tokens_per_target_forward: float | None = None
    # engine: tok/s over the steps that ran a full batch, their draft + target time only (median): the
    # steady state of a loaded server, without the drain at the end of a finite workload or prefill
    full_batch_tok_s: float | None = None
    # every round's seconds, in run order: a first round far slower than the rest is warm-up that the
    # median left out (on a GPU, every batch shape the drain reaches is new once)
    round_seconds: list[float] | None = None
    # engine: of ``seconds``, the time outside draft and target forwards and prefill (median): the
    # loop's own bookkeeping (admission, uniforms, appending and detokenising, cache compaction)
    loop_seconds: float | None = None
    auto_k_steps: dict | None = None  # engine "auto": steps per k it chose (first round)
    # (b) rows: the batch HF really decoded at (its limit), whatever batch_size they are compared at
    decoded_at_batch: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _full_batch_tok_s(stats, batch: int) -> float | None:
    """Tokens/s over the steps whose batch was full, counting only their draft and target time."""
    full = [s for s in stats if s.batch_size == batch]
    seconds = sum(s.draft_time + s.target_time for s in full)
    return sum(s.emitted for s in full) / seconds if seconds else None


def _uncut_tokens_per_forward(stats, k: int) -> float | None:
    """Tokens per target forward had max_tokens and EOS cut no step: accepted + 1 per row, over the steps
    where every row drafted its full k. The engine drafts no further than max_tokens (a row with n
    tokens left drafts n - 1), so a step with a capped row says nothing of how much a full k yields."""
    full = [s for s in stats if s.proposed == s.batch_size * k]
    rows = sum(s.batch_size for s in full)
    return (sum(s.accepted for s in full) + rows) / rows if rows else None


def engine_run(target, draft, tok, ids, batch: int, max_tokens: int, k: int | str, policy=None):
    """One engine run over all prompts, a fresh engine each time: (completions, per-step stats).
    ``policy``: for k = "auto", a calibrated SpeculationPolicy's fork (a server calibrated at start-up)."""
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=batch), policy=policy)
    stats: list = []
    outs = eng.generate(ids, SamplingParams(max_tokens=max_tokens, num_speculative_tokens=k), stats=stats)
    return outs, stats


def check_inputs(target, draft, tok, ids: list[list[int]], max_tokens: int, ks) -> int:
    """Every k and every prompt + max_tokens fit the engine: checked before the first timed run, not by
    the engine's own runs after every HF baseline has been timed. Returns the engine's max_model_len."""
    eng = SpecEngine(target, draft, tok)
    params = SamplingParams(max_tokens=max_tokens, num_speculative_tokens=max(ks))  # raises naming the field
    for i, p in enumerate(ids, 1):
        try:
            check_prompt(tok, eng.vocab, eng.max_model_len, p, params)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    return eng.max_model_len


def run_bench(
    target, draft, tok, prompts: list[str], max_tokens: int = 64, batch_sizes=(1, 8), ks=range(1, 9), log=print, repeats: int = 1
) -> dict:
    """``repeats`` > 1 times every decoder that many times, in interleaved rounds (a, b, engine k=1..K, 0, auto,
    then again), and keeps each decoder's median time: a slow spell of the machine then hits every
    decoder alike instead of whichever one happened to run during it. The cost ratios c and v are
    measured in every round too and their medians kept: on a shared 2-core machine the speed of one
    forward drifts by up to 1.5x over a run, and a c timed once, at the start, fed that drift straight
    into S. Outputs and acceptance are deterministic (greedy) and taken from the first round."""
    device = next(target.parameters()).device
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = [tok.encode(p) for p in prompts]
    max_len = check_inputs(target, draft, tok, ids, max_tokens, ks)
    # c and v are timed on a cache of ctx tokens plus up to max(ks)+1 more: all within the pair's
    # positions (a prompt near them fits the engine, which never drafts past max_tokens, but ctx +
    # k + 1 ran past GPT-2's learned positions after every decoder's round)
    ctx = min(int(statistics.median(map(len, ids))) + max_tokens // 2, max_len - max(ks) - 1)
    results: list[DecoderResult] = []
    summary = {}
    # Warm-up every path once so lazy initialisation is not timed; no more tokens than max_tokens,
    # which check_inputs fitted to the prompts (4 failed a prompt that fits with max_tokens 2 or 3).
    warm = min(4, max_tokens)
    hf_generate(target, tok, ids[:1], warm, 1)
    hf_generate(target, tok, ids[:1], warm, 1, assistant=draft)
    SpecEngine(target, draft, tok).generate(ids[:1], SamplingParams(max_tokens=warm))
    # (b) and (b, k matched) run at batch 1 whatever the batch size (HF's limit): timed in the first
    # size's rounds and reused for the others, not run again for the same numbers.
    hf_runs: dict = {}
    for bs in batch_sizes:
        engine_ks = list(ks) + [0]
        hf = {} if hf_runs else {
            "b": lambda: (hf_generate(target, tok, ids, max_tokens, HF_ASSISTED_BATCH, assistant=draft), None),
        } | {f"b{k}": (lambda k=k: hf_matched_k(target, tok, ids, max_tokens, draft, k)) for k in ks}
        rows = min(bs, len(ids))  # the batch the engine really runs: fewer prompts than bs fill fewer rows
        # "auto" chooses among the same ks; calibrated here, untimed: a one-off cost (~0.1-0.5 s a size on the
        # default pair) that a server pays in the first step meeting each batch size, not in every run
        auto = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=bs, auto_k_max=max(ks))).policy
        for b in range(1, rows + 1):
            auto.cost(b)  # the sizes it calibrates (powers of two and bs), not each
        decoders = {"a": lambda: (hf_generate(target, tok, ids, max_tokens, bs), None)} | hf \
            | {k: (lambda k=k: engine_run(target, draft, tok, ids, bs, max_tokens, k)) for k in engine_ks} \
            | {"auto": lambda: engine_run(target, draft, tok, ids, bs, max_tokens, "auto", auto.fork())}
        first, times, ratios = {}, {name: [] for name in decoders}, {name: [] for name in ["c", *ks]}
        prefill, full_rate, loop = ({k: [] for k in [*engine_ks, "auto"]} for _ in range(3))
        for _ in tqdm(range(repeats), desc=f"batch {bs}: {repeats} round(s) of {len(decoders)} decoders"):
            for name, run in decoders.items():
                out, dt = timed(run)
                first.setdefault(name, out)
                times[name].append(dt)
                if name in prefill:
                    prefill[name].append(sum(s.prefill_time for s in out[1]))
                    loop[name].append(dt - sum(s.prefill_time + s.draft_time + s.target_time for s in out[1]))
                    full_rate[name].append(_full_batch_tok_s(out[1], rows))
            t1 = forward_cost(target, rows, ctx, vocab, device)
            ratios["c"].append(forward_cost(draft, rows, ctx, vocab, device) / t1)
            for k in ks:
                ratios[k].append(forward_cost(target, rows, ctx, vocab, device, tokens=k + 1) / t1)
        hf_runs = hf_runs or {name: (first[name], times[name]) for name in hf}
        for name, (out, ts) in hf_runs.items():
            first[name], times[name] = out, ts
        t = {name: statistics.median(ts) for name, ts in times.items()}
        c, v = statistics.median(ratios["c"]), {k: statistics.median(ratios[k]) for k in ks}
        ref, hf_asst = first["a"][0], first["b"][0]
        a = DecoderResult("target_alone_hf", bs, sum(map(len, ref)), t["a"], round_seconds=times["a"])
        m = mismatches(target, ids, hf_asst, ref)
        b = DecoderResult("hf_assisted", bs, sum(map(len, hf_asst)), t["b"], outputs_match_target=len(ref) - m["differ"],
                          mismatch=m, round_seconds=times["b"], decoded_at_batch=HF_ASSISTED_BATCH)
        results += [a, b]
        b_k = {}  # HF assisted drafting the engine's k (batch 1, as (b))
        for k in ks:
            m = mismatches(target, ids, first[f"b{k}"][0], ref)
            b_k[k] = DecoderResult("hf_assisted_matched_k", bs, sum(map(len, first[f"b{k}"][0])), t[f"b{k}"], k=k,
                                   outputs_match_target=len(ref) - m["differ"], mismatch=m, round_seconds=times[f"b{k}"],
                                   decoded_at_batch=HF_ASSISTED_BATCH)
        results += list(b_k.values())
        log(f"[batch {bs}] c={c:.3f}  target alone {a.tokens_per_s:.1f} tok/s  HF assisted {b.tokens_per_s:.1f} tok/s")
        per_k = {}
        for k in [*engine_ks, "auto"]:
            outs, stats = first[k]
            proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
            row_steps = sum(s.batch_size for s in stats)
            tested = accepted + sum(s.rejected for s in stats)
            alpha = accepted / tested if tested else None  # per-position acceptance, see StepStats.alpha
            m = mismatches(target, ids, [o.token_ids for o in outs], ref)
            fixed = k != "auto" and k > 0  # S and v are for one k
            r = DecoderResult(
                "engine" if fixed else f"engine_{'auto' if k else 'k0'}", bs, sum(len(o.token_ids) for o in outs), t[k],
                k=k if k != "auto" else None, alpha=alpha,
                acceptance_rate=accepted / proposed if proposed else None,
                tokens_per_target_forward=sum(s.emitted for s in stats) / row_steps,
                analytic_speedup=analytic_speedup(alpha, k, c) if fixed else 1.0 if k == 0 else None,
                verify_cost=v[k] if fixed else 1.0 if k == 0 else None,
                analytic_speedup_measured_v=analytic_speedup(alpha, k, c, v[k]) if fixed else 1.0 if k == 0 else None,
                outputs_match_target=len(ref) - m["differ"],
                mismatch=m,
                rows_per_step=row_steps / len(stats),
                prefill_seconds=statistics.median(prefill[k]),
                uncut_tokens_per_target_forward=_uncut_tokens_per_forward(stats, k) if k != "auto" else None,
                full_batch_tok_s=statistics.median(full_rate[k]) if None not in full_rate[k] else None,
                round_seconds=times[k],
                loop_seconds=statistics.median(loop[k]),
                auto_k_steps=dict(sorted(Counter(s.auto_k for s in stats).items())) if k == "auto" else None,
            )
            results.append(r)
            per_k[k] = r
        auto_r = per_k.pop("auto")
        best = max((per_k[k] for k in ks), key=lambda r: r.tokens_per_s)
        k0 = per_k[0]

        def measured(r: DecoderResult) -> float:  # speedup over the same loop's plain decoding (k=0)
            return r.tokens_per_s / k0.tokens_per_s

        def decode_only(r: DecoderResult) -> float:  # the same, prefill time left out on both sides:
            # S models decode steps only, and prompts are prefilled once whatever k is
            return r.tokens / (r.seconds - r.prefill_seconds) / (k0.tokens / (k0.seconds - k0.prefill_seconds))

        summary[f"batch_{bs}"] = {
            "c": c,
            "rows": rows,  # the engine's batch, at which c and v were measured (< bs with fewer prompts)
            "target_alone_tok_s": a.tokens_per_s,
            "engine_k0_tok_s": k0.tokens_per_s,
            "hf_assisted_tok_s": b.tokens_per_s,
            "hf_assisted_batch_size": HF_ASSISTED_BATCH,
            "hf_assisted_mismatch": b.mismatch,
            "best_k": best.k,
            "best_engine_tok_s": best.tokens_per_s,
            "alpha_at_best_k": best.alpha,
            "speedup_vs_target_alone": best.tokens_per_s / a.tokens_per_s,
            "speedup_vs_engine_k0": measured(best),
            "speedup_vs_hf_assisted": best.tokens_per_s / b.tokens_per_s,
            "speedup_vs_hf_assisted_matched_k": best.tokens_per_s / b_k[best.k].tokens_per_s,
            "analytic_speedup_at_best_k": best.analytic_speedup,
            # measured over analytic, with the plain-decoding baseline of the same loop (k=0)
            "measured_over_analytic": measured(best) / best.analytic_speedup,
            "verify_cost_at_best_k": best.verify_cost,
            "measured_over_analytic_measured_v": measured(best) / best.analytic_speedup_measured_v,
            "prefill_share_at_best_k": best.prefill_seconds / best.seconds,
            "measured_decode_only_over_analytic": decode_only(best) / best.analytic_speedup,
            # "auto": the engine choosing k each step (auto_k.py), against the best k chosen afterwards
            "auto": {
                "tok_s": auto_r.tokens_per_s, "over_best_k": auto_r.tokens_per_s / best.tokens_per_s,
                "speedup_vs_target_alone": auto_r.tokens_per_s / a.tokens_per_s,
                "speedup_vs_hf_assisted": auto_r.tokens_per_s / b.tokens_per_s,
                "over_each_k": {k: auto_r.tokens_per_s / per_k[k].tokens_per_s for k in ks},
                "k_steps": auto_r.auto_k_steps, "alpha": auto_r.alpha,
                "outputs_match_target": auto_r.outputs_match_target, "mismatch": auto_r.mismatch,
                "first_round_over_median": auto_r.round_seconds[0] / auto_r.seconds,
            },
            "per_k": {
                k: {
                    "tok_s": r.tokens_per_s, "alpha": r.alpha, "tokens_per_target_forward": r.tokens_per_target_forward,
                    "analytic_speedup": r.analytic_speedup, "speedup_vs_target_alone": r.tokens_per_s / a.tokens_per_s,
                    "speedup_vs_hf_assisted": r.tokens_per_s / b.tokens_per_s,
                    "hf_assisted_matched_k_tok_s": b_k[k].tokens_per_s,
                    "speedup_vs_hf_assisted_matched_k": r.tokens_per_s / b_k[k].tokens_per_s,
                    "measured_over_analytic": measured(r) / r.analytic_speedup,
                    "verify_cost": r.verify_cost, "analytic_speedup_measured_v": r.analytic_speedup_measured_v,
                    "measured_over_analytic_measured_v": measured(r) / r.analytic_speedup_measured_v,
                    "prefill_share": r.prefill_seconds / r.seconds,
                    "loop_share": r.loop_seconds / r.seconds,
                    "first_round_over_median": r.round_seconds[0] / r.seconds,
                    "measured_decode_only_over_analytic": decode_only(r) / r.analytic_speedup,
                    "outputs_match_target": r.outputs_match_target, "mismatch": r.mismatch,
                    "rows_per_step": r.rows_per_step,
                    "uncut_tokens_per_target_forward": r.uncut_tokens_per_target_forward,
                    "full_batch_measured_over_analytic": (r.full_batch_tok_s / k0.full_batch_tok_s / r.analytic_speedup
                                                          if r.full_batch_tok_s and k0.full_batch_tok_s else None),
                } | acceptance_model_ratios(measured(r), k, c, r.alpha, r.verify_cost, r.tokens_per_target_forward,
                                            r.uncut_tokens_per_target_forward)
                for k, r in per_k.items() if k
            },
        }
        at_best = summary[f"batch_{bs}"]["per_k"][best.k]
        for key in ("tokens_over_expected", "measured_over_analytic_measured_v_tokens", "full_batch_measured_over_analytic"):
            summary[f"batch_{bs}"][f"{key}_at_best_k"] = at_best[key]
        log(json.dumps({f"batch_{bs}": {k: v for k, v in summary[f"batch_{bs}"].items() if k != "per_k"}}, indent=1))
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "attn_implementation": getattr(target.config, "_attn_implementation", None),
        "code": code_version(),
        # HF's defaults for the draft, what (b) ran with: it drafts up to num_assistant_tokens and
        # stops early below the confidence threshold, whatever the engine's k
        "hf_assisted_settings": hf_assisted_settings(draft),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "draft_dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
        "cpu": cpu_info(),
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "target_params": sum(p.numel() for p in target.parameters()),
        # kernels/cpu_linear.py: every decoder here runs this same target object, packed or not
        "target_packed_linears": sum(isinstance(m, PackedLinear) for m in target.modules()),
        # and whether float32 calls of <= SKINNY_MAX_ROWS rows take kernels/cpu_skinny.cpp
        "target_skinny_kernel": any(isinstance(m, PackedLinear) and m._skinny is not None for m in target.modules()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "summary": summary,
        "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
    }


if __name__ == "__main__":  # python -m osd_serve.bench REPORT.json... prints the tables (bench_report.py)
    import sys

    from .bench_report import main

    main(sys.argv[1:])
