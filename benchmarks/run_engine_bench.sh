#!/usr/bin/env bash
# Regenerates the engine benchmark (issue 2) for the two pairs: the embedded default, and a pair
# trained with --data on ../shared/datasets (GSM8K + Spider + MBPP). Writes JSON into benchmarks/results/.
# Each pair is benched in float32, and also in bfloat16 where the CPU computes it natively
# (AVX512-BF16 or AMX). Which is faster depends on the CPU: on one host MKL's fp32 GEMM with 2-9 rows
# cost up to 2x its 1-row GEMV while oneDNN's bf16 GEMM was flat in the row count (what speculation's
# one-forward verification assumes), on another (AVX512-BF16, no AMX) bf16 was the slower of the two
# (0.74-0.86x fp32), about even (0.85-1.00x) once the target's linears were prepacked (kernels/
# cpu_linear.py), and 0.67-0.83x at the best k once fp32's few-row calls went to kernels/cpu_skinny.cpp; each
# report records its CPU (benchmarks/ENGINE.md). DTYPES="float32" (or "bfloat16") runs one only.
# A third pair, big_random_pair, asks whether the engine's shortfalls come from the pairs' size: a
# 189M-parameter target (755 MB in float32, past this host's 260 MB L3, so a decode step streams its
# weights from memory) with random weights and a 2-layer layer-skip draft (benchmarks/gpu_pair.py;
# speed depends on sizes and acceptance, not on what the weights know); 8 prompts and k <= 4, in float32
# (~9 minutes on 2 cores) and, like the others, in bf16 where the CPU has it (~12 minutes with AMX).
# PAIRS="default data big" (the default) picks which pairs run;
# PAIRS=none only rewrites ENGINE.md from the reports there. TAG=_amx (any suffix) names the reports
# engine_PAIR[_bf16]_amx.json, so a run on another host sits beside the reports of this one.
# OSD_DATA_PAIR=DIR benches that built data pair as it is instead of bootstrapping one (the reports'
# pair, e.g. after the datasets were rewritten by a build that predates content-matched reuse).
set -euo pipefail
cd "$(dirname "$0")/.."
D=${OSD_DATASETS:-../shared/datasets}
out=benchmarks/results
mkdir -p "$out"
if [ -z "${DTYPES:-}" ]; then
  DTYPES=float32
  if grep -q -w -E 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then DTYPES="float32 bfloat16"; fi
fi
bench_pair() {  # NAME PAIR_JSON DRAFT_DTYPE (auto, or "target": the target's dtype) [more bench arguments]
  local t d dd
  t=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["target"])' "$2")
  d=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["draft"])' "$2")
  for dt in $DTYPES; do
    suffix=$([ "$dt" = float32 ] && echo "" || echo "_bf16")
    dd=$([ "$3" = target ] && echo "$dt" || echo "$3")
    osd-serve bench --target "$t" --draft "$d" --dtype "$dt" --draft-dtype "$dd" --threads 2 --repeats 3 "${@:4}" \
      --out "$out/engine_$1$suffix${TAG:-}.json" >/dev/null
  done
}
PAIRS=${PAIRS:-default data big}
if [[ " $PAIRS " == *" default "* ]]; then
  bench_pair default_pair "$(osd-serve bootstrap | tail -n 1)" auto
fi
if [[ " $PAIRS " == *" data "* && -n "${OSD_DATA_PAIR:-}" ]]; then  # a built data pair's directory, as is
  bench_pair data_pair "{\"target\": \"$OSD_DATA_PAIR/target\", \"draft\": \"$OSD_DATA_PAIR/draft\"}" auto
elif [[ " $PAIRS " == *" data "* && -d "$D" ]]; then
  bench_pair data_pair "$(osd-serve bootstrap --data "$D/gsm8k/train.jsonl" "$D/spider/train_spider.json" "$D/mbpp/mbpp.jsonl" | tail -n 1)" auto
fi
if [[ " $PAIRS " == *" big "* ]]; then
  big=${OSD_BIG_PAIR:-$HOME/.cache/osd-serve/big-random-pair}
  if [ ! -f "$big/prompts.jsonl" ]; then
    rm -rf "$big"
    python benchmarks/gpu_pair.py --out "$big" --hidden 1024 --layers 16 --intermediate 2816 --heads 16 --kv-heads 4 \
      --draft-layers 2 --vocab 4096 --dtype float32 --deep-scale 0.02 >/dev/null
  fi
  # Its draft is two of the target's layers and streams weights too: bf16 beside a bf16 target, 1.07x and 1.26x
  # a float32 draft at batch 1 and 8 (benchmarks/draft_dtype.py, results/draft_dtype_big_random_pair_amx.json).
  bench_pair big_random_pair "{\"target\": \"$big/target\", \"draft\": \"$big/draft\"}" target --num-prompts 8 --max-k 4
fi
{
  printf '# Engine benchmark (issue 2)\n\nRegenerate with `bash benchmarks/run_engine_bench.sh` (builds the pairs if needed; the data pair\n'
  printf 'needs `../shared/datasets`). Raw reports are in `results/engine_*.json`; each pair is one run.\n'
  printf 'A "–" is a column the report predates (DTYPES= reruns one dtype and leaves the other'"'"'s reports as they were).\n\n'
  printf 'Why batch 8 falls short of S: S assumes a target forward over k+1 tokens per row costs what one over\n'
  printf '1 token does (v = 1), true while a forward is bound by reading the weights rather than by multiplying them.\n'
  printf 'On the 2-core host the 30M-parameter target sits in L3, and the float32 linears reach 200-240 GFLOP/s,\n'
  printf 'about the FMA peak, from 12-16 rows on (`results/cpu_linear.jsonl`): a batch-8 verification has\n'
  printf '8(k+1) >= 16 rows, so its linears cost in proportion to its rows and v grows with k (column v).\n'
  printf 'At batch 1 (k+1 rows) v is 1.05-1.21 in float32 and 1.12-1.35 in bfloat16 up to k = 5 (the tables below), split about evenly\nbetween the linears and attention with the elementwise ops.\n\n'
  printf 'In float32 a target past the cache does not change this (engine_big_random_pair: 189M parameters, 755 MB,\n'
  printf 'random weights with a 2-layer layer-skip draft, so α comes from construction, not training). Its one-token\n'
  printf 'step streams the weights from memory (~28 GB/s), but two cores multiply at ~200 GFLOP/s: 7 FLOP per byte, so\n'
  printf 'from ~14 rows of float32 on, the FMAs and not the memory bound a step. Batch 1 (k+1 <= 5 rows) stays under\n'
  printf 'that: v 1.07-1.20 and measured/analytic 0.75-0.85, as for the default pair; batch 8 (16-40 rows) is past it:\n'
  printf 'v 1.31-2.19 and (c)/(a) 1.05-1.08. Its linears of 8 rows cost 1.24x those of 1 row since kernels/cpu_skinny.cpp\n'
  printf 'streams the next weight block during a block'"'"'s later tiles (1.50x before; results/cpu_linear_big_random.jsonl),\n'
  printf 'which sped up the target alone at batch 8 more than the engine. In bf16 on the AMX host (engine_big_random_pair_bf16_amx,\n'
  printf 'draft bf16 too: 1.07x/1.26x a float32 one at batch 1/8) a step reads 378 MB in 42 ms, and up to 5 rows cost about what 1 does: v 1.06-1.08\n'
  printf 'at batch 1, measured/analytic 0.89-0.96 at every k; batch 8: v 1.18-1.43, (c)/(a) 1.39-1.42 at k 2-4, 1.24 at k = 1 (S 1.58).\n'
  printf 'A GPU is the machine speculation is built for: an H200 reads 4.8 TB/s against\n'
  printf '~990 TFLOP/s of bf16, ~200 FLOP per byte, and there measured/analytic is 0.94-0.99 at batch 1 in GPU.md'"'"'s 3-round run (k 1-4).\n\n'
  printf 'The `_amx` reports come from another host (TAG=_amx): the same 2 cores with AMX, whose tiles make a bf16\n'
  printf 'forward nearly flat in its rows. The default target at batch 8 costs 1.33x its 1-token step with 4 tokens\n'
  printf 'per row and 1.68x with 9 in bf16, 1.65x and 2.61x in float32 on the skinny kernel (results/cpu_linear_amx.jsonl).\n'
  printf 'Its pairs were built there (bootstrap chose bf16 autocast), so they are other weights than this host'"'"'s.\n'
  printf 'Its bf16 reports run the draft in float32 (header: "draft float32"; ModelConfig.draft_dtype, whose auto does so beside a\n'
  printf 'half-precision target on CPU): a 1-layer draft'"'"'s forward is mostly per-call work, which bf16 adds to, so c fell from\n'
  printf '0.16 to 0.11 at batch 1. The reports without that note ran a bf16 draft. In stop 32, against the bf16-draft runs of the\n'
  printf 'same pairs (code f20902b/74695c9), the best batch-1 (c)/(a) rose from 1.72 to 1.89 (default) and 2.50 to 2.75 (data), and\n'
  printf '(c)/(b) from 1.32 to 1.41 and 1.60 to 1.70; measured/analytic at the best k fell from 0.84 to 0.80 and 0.75, since S rises\n'
  printf 'with a smaller c while v, prefill and the loop cost what they did. Interleaved in one run (benchmarks/draft_dtype.py,\n'
  printf 'results/draft_dtype_*_amx.json) the float32 draft was 1.05-1.09x faster at batch 1 and 1.00-1.03x at batch 8.\n'
  printf 'c is per-call work, not arithmetic (the draft does ~2.5 MFLOP a row): benchmarks/draft_call_cost.py times one\n'
  printf 'draft forward as the bench times c, beside variants, in 3 interleaved rounds on 0b7477c (results/draft_call_cost_\n'
  printf 'default_pair{,_fp32}_amx.json: bf16 and float32 targets; c 0.10-0.12). Its linears prepacked as the target'"'"'s cost\n'
  printf '1.06-1.09x at batch 1 and 0.91-0.94x at batch 8, one thread 1.18-1.26x, torch.compile(dynamic=True) 1.28-1.43x:\n'
  printf 'no cheap lever lowers c. Inside the engine a draft forward costs 1.20x that at batch 1 and 1.39-1.42x at batch 8,\n'
  printf 'where the cache'"'"'s holes (a 2D mask that transformers makes 4D at every forward) account for 1.09-1.11x; the rest\n'
  printf 'is the proposal loop'"'"'s own ops and the wider first forward (a row that accepted all k feeds 2 tokens).\n'
  printf 'The default pair'"'"'s two `_amx` reports were rerun on a578d33 (the hole mask, below), the data pair'"'"'s on 77227df\n'
  printf '(the same engine; the pair built in stop 59 by bootstrap --data, greedy acceptance ~0.89), in a faster spell of\n'
  printf 'the host than its d254a38 reports (the target alone 1.57x their tok/s at batch 1 and 8 in float32, the engine\n'
  printf '1.38-1.43x at batch 8), so compare within a report. The data pair at batch 8: bf16 (c)/(a) 1.40-1.96 at every k,\n'
  printf 'float32 1.26-1.53, above 1.3 at k = 2-8 (d254a38: 1.38-1.97 and 1.38-1.70); measured/analytic at batch 1 over k and\n'
  printf 'at the best k: bf16 0.78-0.86 and 0.78 (k = 8), float32 0.69-0.87 and 0.71 (k = 7), prefill 9%% and 15%% of the time. The\n'
  printf 'default pair at batch 8: bf16 1.20-1.39, above 1.3 at k = 1-5, float32 0.95-1.22 (d254a38: 1.17-1.40 and 0.98-1.30);\n'
  printf 'bf16 v 1.05-1.20 at batch 1 and 1.10-1.52 at batch 8. measured/analytic at batch 1, over k and at the best k: bf16\n'
  printf '0.82-1.00 and 0.93 (a batch-1 check on a578d33: 0.77-0.97 and 0.89; d254a38: 0.83), float32 0.73-0.84 and 0.79\n'
  printf '(d254a38: 0.87; c3dfc76: 0.75; a check on 165a37c: 0.83). Batch 1 ran the same code in all of these (no holes, and\n'
  printf 'prefill ahead holds nothing there), so the ratio moves with the host by about 0.1. Batch 8 reads 0.33-0.78 of S:\n'
  printf 'besides v, prefill (8-29%% of the engine'"'"'s time, the data pair'"'"'s prompts being longer) and the tail of the batch\n'
  printf '(16 prompts in 8 slots: 5.9-7.8 rows a step). The hole mask (BatchKV._hole_mask: on SDPA the 4D mask is built in\n'
  printf '1-3 ops instead of by transformers in every forward) against the 2D mask it replaced, in one run (benchmarks/\n'
  printf 'hole_mask.py, results/hole_mask_default_pair{,_fp32}_amx.json: batch 8, k 1/2/4/8, 3 rounds): the engine'"'"'s tok/s\n'
  printf '1.02-1.06x in bf16 and 0.98-1.04x in float32, its draft time 0.89-0.98x, outputs equal.\n'
  printf 'Where batch 8'"'"'s time goes (benchmarks/batch_tail.py, results/batch_tail_*_amx.json, 3 interleaved rounds on 44dba42):\n'
  printf 'at k = 0 every row emits one token a step, so a wave'"'"'s rows end together and all 128 steps are full. With speculation\n'
  printf 'rows end at different steps, and once the queue is empty each leaves its slot empty. In the default pair'"'"'s bf16 run\n'
  printf 'those steps (3.9-4.6 rows) took 13-39%% of the time for 10-31%% of the tokens (k = 1-8); the full steps ran 1.24-1.44x\n'
  printf 'k = 0'"'"'s full steps (the steady state of a server whose queue never empties), the whole run 0.97-1.20x k = 0'"'"'s. With\n'
  printf '48 prompts the tail took 11-16%% of the time (k = 2-8). float32: full steps 1.03-1.24x. The data pair, whose rows accept\n'
  printf '~0.92 and so end closer together: tail 3-15%% of the time, full steps 1.39-2.16x (bf16) and 1.32-1.66x (float32). So\n'
  printf 'the default pair at batch 8 loses twice: v and k*c bound its full step, and its lower, uneven acceptance makes the tail.\n'
  printf 'A longer generation does not close batch 1'"'"'s gap: engine_default_pair_bf16_amx_t128 is the default pair in\n'
  printf 'bf16 (its draft too) at 128 tokens, batch 1 only (`osd-serve bench --dtype bfloat16 --draft-dtype bfloat16 --threads 2 --repeats 3 --max-tokens 128 --batch-sizes 1`):\n'
  printf 'prefill falls to 2.4%% and tokens per forward to 0.95 of i.i.d., but v and the context grow,\n'
  printf 'and measured/analytic reads 0.83 at its best k (0.79-0.91 over k) against 0.84 at 64 tokens (bf16 draft).\n\n'
  printf 'k = auto (osd_serve/auto_k.py; the `_amx_auto` reports, float32, `TAG=_amx_auto PAIRS=default DTYPES=float32` and\n'
  printf 'the same with `PAIRS=data OSD_DATA_PAIR=...`, on d44ebeb and 253acfd; the first reads dirty for a README edit made during it): the engine picks k each step from calibrated\n'
  printf 'forward costs and the acceptance it measures, timed in the same interleaved rounds as every fixed k. Against the\n'
  printf 'best fixed k, chosen afterwards from the same run: default pair 1.09x at batch 1 (each request gets its own k:\n'
  printf 'steps at k 1-8) and 0.98x at batch 8 (1.09x k = 4); data pair 0.99x at batch 1 and 0.93x at batch 8, where it\n'
  printf 'mostly drafted 5 while 3 was best (0.96x k = 4). Over the steps that ran a full batch (a loaded server'"'"'s\n'
  printf 'steady state, their draft and target time; column "full batch ÷ best k") it matched the best fixed k: 1.10, 1.01,\n'
  printf '1.00 and 1.00 (default b1, b8; data b1, b8). There the data pair'"'"'s k 3-6 are within 1.5%% of each other at batch 8\n'
  printf '(1185-1202 tok/s), so drafting 5 cost nothing, and its acceptance model held (tokens per forward over the\n'
  printf 'steps no cut shortened 0.98-1.04 of i.i.d. up to k = 6: the "uncut ÷ i.i.d." column). The whole run'"'"'s 0.93 is\n'
  printf 'outside those steps: the drain at the end (6.9 rows a step against 7.8 at k = 3; a larger k ends each request in\n'
  printf 'fewer steps, and the last requests alone), prefill (0.38 s against 0.35 s: rows finish at other steps, so prompts\n'
  printf 'are admitted in other groups) and the loop (0.067 s against 0.040-0.065 s over the fixed k). Both runs were on a slower spell of the host than\n'
  printf 'the `_amx` reports (the target alone 132-138 tok/s at batch 1 against 166-170), so compare within a report.\n\n'
  python -m osd_serve.bench "$out"/engine_*.json
} | tee benchmarks/ENGINE.md
