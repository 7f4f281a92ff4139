#!/usr/bin/env bash
# Issue 3 experiments: online distillation on the paper's four single-domain streams and a sharp
# shift between them, on a pair built from ../shared/datasets. Regenerate everything with
#   bash benchmarks/run_osd_experiments.sh            (then: python benchmarks/osd_report.py)
# ~55 min on 2 CPU cores, plus ~17 min to build the pair on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${OSD_DATASETS:-../shared/datasets}
OUT=${OSD_RESULTS:-benchmarks/results/osd}
N=${OSD_REQUESTS:-300}        # requests per single-domain stream
NSHIFT=${OSD_SHIFT_REQUESTS:-600}
mkdir -p "$OUT"
[ -d "$D" ] || { echo "datasets not found at $D (set OSD_DATASETS)"; exit 1; }

# The pair: a target trained on all four domains, and a briefly trained, never distilled draft.
PAIR=$(osd-serve bootstrap --preset osd --data "$D/gsm8k/train.jsonl" "$D/spider/train_spider.json" \
       "$D/mbpp/mbpp.jsonl" "$D/alpaca-5000-subset/alpaca_5000.json" | tail -1)
T=$(python -c "import json,sys; print(json.loads(sys.argv[1])['target'])" "$PAIR")
DR=$(python -c "import json,sys; print(json.loads(sys.argv[1])['draft'])" "$PAIR")
# --keep all: every stream run in OSD.md recorded all verified positions (replay's default is now mismatch)
COMMON=(--target "$T" --draft "$DR" --threads 2 --max-tokens 64 --num-speculative-tokens 4 --seed 0 --keep all)

run() { name=$1; shift; echo "== $name" >&2; osd-serve replay "${COMMON[@]}" "$@" --out "$OUT/$name" | tail -1 > "$OUT/$name.summary.json"; }

run gsm8k  --data "$D/gsm8k/test.jsonl" --field question --max-requests "$N"
run spider --data "$D/spider/dev.json" --field question --max-requests "$N"
run mbpp   --data "$D/mbpp/mbpp.jsonl" --field text --max-requests "$N"
run alpaca --data "$D/alpaca-5000-subset/alpaca_5000.json" --field instruction --max-requests "$N"
# Sharp shift: the four domains one after another, an equal share each.
run shift  --data "$D/gsm8k/test.jsonl" "$D/spider/dev.json" "$D/mbpp/mbpp.jsonl" \
           "$D/alpaca-5000-subset/alpaca_5000.json" --field question,text,instruction --max-requests "$NSHIFT"
# Which positions to record: only the draft's mistakes (the paper) against all verified positions, on the
# first 150 GSM8K requests, online only (OSD.md's keep_all and keep_mismatch rows)
run keep_all      --data "$D/gsm8k/test.jsonl" --field question --max-requests 150 --keep all --online-only
run keep_mismatch --data "$D/gsm8k/test.jsonl" --field question --max-requests 150 --keep mismatch --online-only
# Full distributions against top-32 + rest mass: bytes per record and what it costs in acceptance.
run gsm8k_top32 --data "$D/gsm8k/test.jsonl" --field question --max-requests "$N" --topk 32 --online-only
python benchmarks/osd_report.py "$OUT" > benchmarks/OSD.md  # with benchmarks/osd_caveats.md, kept by hand
echo "wrote benchmarks/OSD.md" >&2
