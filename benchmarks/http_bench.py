"""HTTP benchmark of a running osd-serve (e.g. `serve run serve_config.yaml`).

    python benchmarks/http_bench.py --url http://127.0.0.1:8000 --out benchmarks/results/http.json \
        [--api-key KEY] [--concurrency 1,4,16] [--requests 32] [--max-tokens 64] [--trace azure]

For each concurrency level it sends the same prompts (GSM8K test questions from ../shared/datasets,
or examples/prompts.jsonl) twice: speculation on (k=4) and off (k=0, plain decoding through the same
server), greedy, and reports p50/p99 latency and generated tokens/s, all measured in one run. With
--trace azure, request i is sent at the i-th arrival time of the Azure LLM code trace (time-scaled
by --trace-speedup), instead of as fast as the concurrency limit allows; latency then runs from the
arrival time, so queueing behind the concurrency limit counts.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import statistics
import time
from datetime import datetime
from pathlib import Path

import httpx

DATASETS = Path(os.environ.get("OSD_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))


def prompts(n: int) -> list[str]:
    gsm = DATASETS / "gsm8k" / "test.jsonl"
    if gsm.exists():
        rows = [json.loads(x) for x in gsm.read_text().splitlines()[:n]]
        return [r["question"] + "\n" for r in rows]
    ex = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
    ps = [json.loads(x)["prompt"] for x in ex.read_text().splitlines() if x.strip()]
    return [ps[i % len(ps)] for i in range(n)]


def azure_offsets(n: int, speedup: float) -> list[float]:
    """Arrival offsets (s) of the first n requests of the Azure 2023 code trace, divided by speedup."""
    path = DATASETS / "azure-llm-inference-trace-2023" / "AzureLLMInferenceTrace_code.csv"
    with open(path) as f:
        rows = list(csv.DictReader(f))[:n]
    ts = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    return [(t - ts[0]).total_seconds() / speedup for t in ts]


async def one(client, url, headers, prompt, max_tokens, k, start_at=None):
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    # Paced by a trace, latency runs from the request's arrival time, so time spent queued behind the
    # concurrency limit counts, as a user would see it.
    t0 = time.perf_counter() if start_at is None else start_at
    r = await client.post(f"{url}/v1/completions", headers=headers, timeout=600, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "num_speculative_tokens": k, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["text"]


async def level(url, headers, ps, conc, max_tokens, k, offsets=None):
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=conc + 4)) as client:
        t0 = time.perf_counter()

        async def guarded(i, p):
            if offsets is not None:  # arrive on time, then wait for a free slot
                await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with sem:
                return await one(client, url, headers, p, max_tokens, k, None if offsets is None else t0 + offsets[i])

        res = await asyncio.gather(*(guarded(i, p) for i, p in enumerate(ps)))
        wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in res)
    return {"concurrency": conc, "k": k, "requests": len(ps), "p50_s": statistics.median(lat),
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "tokens_per_s": sum(r[1] for r in res) / wall,
            "wall_s": wall, "texts": [r[2] for r in res]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("OSD_API_KEY"))
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--trace", choices=["none", "azure"], default="none")
    ap.add_argument("--trace-speedup", type=float, default=1.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    ps = prompts(a.requests)
    offsets = azure_offsets(len(ps), a.trace_speedup) if a.trace == "azure" else None
    asyncio.run(level(a.url, headers, ps[:2], 1, 4, a.k))  # warm-up
    rows = []
    for conc in [int(c) for c in a.concurrency.split(",")]:
        for k in (a.k, 0):
            r = asyncio.run(level(a.url, headers, ps, conc, a.max_tokens, k, offsets))
            rows.append(r)
            print(f"concurrency {conc:3d} k={k}: p50 {r['p50_s']:.2f}s p99 {r['p99_s']:.2f}s {r['tokens_per_s']:.1f} tok/s",
                  flush=True)
    by = {(r["concurrency"], r["k"]): r for r in rows}
    summary = []
    for conc in sorted({r["concurrency"] for r in rows}):
        on, off = by[(conc, a.k)], by[(conc, 0)]
        summary.append({"concurrency": conc, "speedup_tok_s": on["tokens_per_s"] / off["tokens_per_s"],
                        "p50_ratio": on["p50_s"] / off["p50_s"], "outputs_identical": on["texts"] == off["texts"]})
    for r in rows:
        r.pop("texts")
    report = {"url": a.url, "max_tokens": a.max_tokens, "requests": a.requests, "trace": a.trace,
              "trace_speedup": a.trace_speedup if a.trace != "none" else None, "rows": rows, "summary": summary}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
