#!/usr/bin/env bash
# The engine bench (issue 2) on a CUDA GPU with a larger random-weight pair (benchmarks/gpu_pair.py),
# then the CUDA attention tests. Needs torch with CUDA, transformers, peft and tokenizers; not ray.
# Writes benchmarks/results/gpu_bench.json and prints the tables. BENCH_ARGS adds bench options, to split the
# run where a call is time-limited (the lent device's is 10 minutes; all of it at 3 rounds takes longer), e.g.
#   BENCH_ARGS="--batch-sizes 8 --max-k 4 --num-prompts 16" OUT_NAME=gpu_b8 bash benchmarks/run_gpu_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # gpu_pair.py imports osd_serve: also where it is not pip-installed
py=${PYTHON:-python3}  # the device image has python3 only for sure
pair_dir=${GPU_PAIR_DIR:-/tmp/osd-gpu-pair}
out=${OUT_DIR:-benchmarks/results}
mkdir -p "$out"
[ -f "$pair_dir/prompts.jsonl" ] || $py benchmarks/gpu_pair.py --out "$pair_dir" "$@" >&2
$py -m osd_serve.cli bench --target "$pair_dir/target" --draft "$pair_dir/draft" --device cuda --dtype bfloat16 \
  --repeats "${REPEATS:-3}" ${BENCH_ARGS:-} --out "$out/${OUT_NAME:-gpu_bench}.json" >/dev/null
$py -m osd_serve.bench "$out/${OUT_NAME:-gpu_bench}.json"
$py -m pytest -q tests/test_cuda.py
