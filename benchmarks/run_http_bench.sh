#!/usr/bin/env bash
# HTTP benchmark of `serve run serve_config.yaml` (embedded default pair, colocated topology):
# concurrency 1/4/16, speculation (k=4) against k=0 in one run, then α over time from the W&B
# offline run as a PNG. Usage: bash benchmarks/run_http_bench.sh [extra http_bench.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OSD_RESULTS:-benchmarks/results}
WB=$(mktemp -d)
CFG=$(mktemp --suffix=.yaml)
python - "$CFG" "$WB" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open("serve_config.yaml"))
cfg["applications"][0]["args"]["wandb"] = {"mode": "offline", "dir": sys.argv[2], "log_every_s": 2}
yaml.safe_dump(cfg, open(sys.argv[1], "w"))
PY
serve run "$CFG" > "$WB/serve.log" 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; sleep 5; ray stop --force >/dev/null 2>&1 || true' EXIT
for _ in $(seq 1 900); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
python benchmarks/http_bench.py --url http://127.0.0.1:8000 --out "$OUT/http_bench.json" "$@"
sleep 5  # one more W&B logging window
RUN=$(ls -t "$WB"/wandb/offline-run-*/run-*.wandb | head -1)
python benchmarks/wandb_alpha_plot.py "$RUN" "$OUT/http_alpha_wandb.png"
