#!/usr/bin/env bash
# The engine bench (issue 2) on a CUDA GPU with a larger random-weight pair (benchmarks/gpu_pair.py),
# then the CUDA attention tests. Needs torch with CUDA, transformers, peft and tokenizers; not ray.
# Writes benchmarks/results/gpu_bench.json and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # gpu_pair.py imports osd_serve: also where it is not pip-installed
pair_dir=${GPU_PAIR_DIR:-/tmp/osd-gpu-pair}
out=${OUT_DIR:-benchmarks/results}
mkdir -p "$out"
[ -f "$pair_dir/prompts.jsonl" ] || python benchmarks/gpu_pair.py --out "$pair_dir" "$@" >&2
python -m osd_serve.cli bench --target "$pair_dir/target" --draft "$pair_dir/draft" --device cuda --dtype bfloat16 \
  --repeats "${REPEATS:-3}" --out "$out/gpu_bench.json" >/dev/null
python -m osd_serve.bench "$out/gpu_bench.json"
python -m pytest -q tests/test_cuda.py
