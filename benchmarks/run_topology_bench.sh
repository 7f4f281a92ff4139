#!/usr/bin/env bash
# Colocated against disaggregated on the same workload, in one run: both applications of the
# embedded default pair are served by one `serve run` (colocated at /, disaggregated at /disagg),
# online distillation off in both so the comparison is of the serving paths alone, and each is
# benchmarked in turn (the idle one sleeps) at concurrency 1/4/16, k=4 against k=0.
# Usage: bash benchmarks/run_topology_bench.sh [extra http_bench.py args, e.g. --trace azure]
# Writes $OSD_RESULTS/topology_bench.json, or topology_bench_azure.json with --trace azure.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OSD_RESULTS:-benchmarks/results}
TMP=$(mktemp -d)
python - "$TMP/serve.yaml" <<'PY'
import sys, yaml
co = yaml.safe_load(open("serve_config.yaml"))
dis = yaml.safe_load(open("serve_config.disaggregated.yaml"))["applications"][0]
co["applications"][0]["args"]["distill"] = {"enabled": False}
dis["args"]["distill"] = {"enabled": False}
dis.update(name="disagg", route_prefix="/disagg")
# One replica each (topologies, not autoscaling, are compared), and CPU shares that let both apps
# be scheduled on a 2-core machine: Ray gives each replica one torch thread either way, so the
# colocated replica computes on one core and the disaggregated pair on up to two (one per process).
cpus = {"Router": 0, "SpecServer": 1, "DraftPool": 0.5, "Verifier": 0.5}
for app in (co["applications"][0], dis):
    app["args"]["wandb"] = {"mode": "disabled"}
    for d in app["deployments"]:
        d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1}
        d["ray_actor_options"] = {"num_cpus": cpus[d["name"]]}
co["applications"].append(dis)
yaml.safe_dump(co, open(sys.argv[1], "w"))
PY
serve run "$TMP/serve.yaml" > "$TMP/serve.log" 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; sleep 5; ray stop --force >/dev/null 2>&1 || true' EXIT
ready() { curl -sf -m 60 localhost:8000$1/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "x", "max_tokens": 1}' >/dev/null; }
for _ in $(seq 1 900); do ready "" && ready /disagg && break; sleep 2; done
python benchmarks/http_bench.py --url http://127.0.0.1:8000 --out "$TMP/colocated.json" "$@"
python benchmarks/http_bench.py --url http://127.0.0.1:8000/disagg --out "$TMP/disaggregated.json" "$@"
# From the report, not the arguments: argparse takes --trace=azure too, and that run overwrote the unpaced one
TRACE=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["trace"])' "$TMP/colocated.json")
NAME=topology_bench; [[ "$TRACE" == azure ]] && NAME=topology_bench_azure
python benchmarks/topology_report.py "$TMP/colocated.json" "$TMP/disaggregated.json" "$OUT/$NAME.json"
