#!/usr/bin/env bash
# Regenerates the engine benchmark (issue 2) for the two pairs: the embedded default, and a pair
# trained with --data on ../shared/datasets (GSM8K + Spider + MBPP). Writes JSON into benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${OSD_DATASETS:-../shared/datasets}
out=benchmarks/results
mkdir -p "$out"
last_json() { tail -n 1; }
pair=$(osd-serve bootstrap | last_json)
t=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["target"])' "$pair")
d=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["draft"])' "$pair")
osd-serve bench --target "$t" --draft "$d" --threads 2 --repeats 3 --out "$out/engine_default_pair.json" >/dev/null
if [ -d "$D" ]; then
  pair=$(osd-serve bootstrap --data "$D/gsm8k/train.jsonl" "$D/spider/train_spider.json" "$D/mbpp/mbpp.jsonl" | last_json)
  t=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["target"])' "$pair")
  d=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["draft"])' "$pair")
  osd-serve bench --target "$t" --draft "$d" --threads 2 --repeats 3 --out "$out/engine_data_pair.json" >/dev/null
fi
{
  printf '# Engine benchmark (issue 2)\n\nRegenerate with `bash benchmarks/run_engine_bench.sh` (builds the pairs if needed; the data pair\n'
  printf 'needs `../shared/datasets`). Raw reports are in `results/engine_*.json`; each pair is one run.\n\n'
  python -m osd_serve.bench "$out"/engine_*.json
} | tee benchmarks/ENGINE.md
