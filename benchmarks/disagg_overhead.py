"""Where a disaggregated speculation step spends its time, on this machine, in one run.

    python benchmarks/disagg_overhead.py [--requests 8] [--max-tokens 64] [--k 4] [--out FILE.json]

Three measurements on the embedded default pair, greedy, the same GSM8K prompts, one request at a time:
  compute   DraftWorker.propose and TargetVerifier.verify called directly in this process, one
            torch thread (what a replica gets): the floor of a step, no Ray.
  serve     the same calls through Ray Serve handles to the real DraftPool and Verifier deployments
            (what the Router does per step: one propose call, one verify call), timed per call.
  echo      a deployment whose @serve.batch method returns its input: Ray Serve's own per-call cost.
  ahead     serve again, on a second app with draft-ahead on (DraftPool drafts the next step while
            the Verifier verifies): whether that overlap pays on this machine.
Per call, serve minus compute is the cost of disaggregation here: routing, (de)serialisation of the
history and the batch wait (draft-ahead is off in compute and serve, so both do the same work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.http_bench import prompts  # noqa: E402
from osd_serve.config import SamplingParams  # noqa: E402
from osd_serve.disagg import DraftWorker, TargetVerifier, run_request  # noqa: E402
from osd_serve.output import Request  # noqa: E402


def _ms(xs: list[float]) -> dict:
    return {"mean_ms": 1e3 * statistics.fmean(xs), "p50_ms": 1e3 * statistics.median(xs), "calls": len(xs)}


async def _drive(reqs, tok, propose, verify) -> dict:
    """Run the requests one at a time through run_request, timing every propose and verify call."""
    t_prop, t_ver = [], []

    async def timed(fn, into, item):
        t0 = time.perf_counter()
        out = await fn(item)
        into.append(time.perf_counter() - t0)
        return out

    t0 = time.perf_counter()
    for r in reqs:
        async for _ in run_request(r, 0, tok, set(), lambda it: timed(propose, t_prop, it), lambda it: timed(verify, t_ver, it)):
            pass
    wall = time.perf_counter() - t0
    steps = sum(r.steps for r in reqs)
    return {"propose": _ms(t_prop), "verify": _ms(t_ver), "steps": steps, "step_ms": 1e3 * wall / steps,
            "tokens": sum(len(r.output_ids) for r in reqs), "wall_s": wall}


def _requests(tok, texts, params, tag):
    return [Request(f"{tag}-{i}", t, tok.encode(t), params, None, expert="default") for i, t in enumerate(texts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out")
    a = ap.parse_args()

    import ray
    from ray import serve

    from deployments.app import build_app
    from osd_serve.bootstrap import build_pair
    from osd_serve.disagg import ProposeItem, Sampling
    from osd_serve.loading import ModelConfig, load_pair, pair_limits

    # Draft-ahead off on both sides, so the served calls do exactly the in-process calls' work.
    cfg = {"topology": "disaggregated", "distill": {"enabled": False}, "wandb": {"mode": "disabled"},
           "num_speculative_tokens": a.k, "draft_ahead": False}
    pair = build_pair()
    tpath, dpath = pair["target"], pair["draft"]
    target, draft, tok = load_pair(ModelConfig(target=tpath, draft=dpath, device="cpu"))
    vocab, _ = pair_limits(tpath, dpath, 2048)
    params = SamplingParams(max_tokens=a.max_tokens, num_speculative_tokens=a.k, ignore_eos=True)
    texts = prompts(a.requests)

    # compute: in process, one torch thread like a replica, draft-ahead off (nothing runs beside it here)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    worker, verifier = DraftWorker(draft, vocab, ahead=False), TargetVerifier(target, vocab)

    async def propose(it):
        return worker.propose([it])[0]

    async def verify(it):
        return verifier.verify([it])[0][0]

    with torch.inference_mode():
        asyncio.run(_drive(_requests(tok, texts[:1], params, "warm"), tok, propose, verify))
        compute = asyncio.run(_drive(_requests(tok, texts, params, "compute"), tok, propose, verify))
    torch.set_num_threads(threads)
    print(f"compute: propose {compute['propose']['mean_ms']:.1f} ms, verify {compute['verify']['mean_ms']:.1f} ms, "
          f"step {compute['step_ms']:.1f} ms", flush=True)

    # Logical CPUs only decide placement: each replica still gets one torch thread (Ray sets
    # OMP_NUM_THREADS from its num_cpus, 1 by default) and they all share this machine's cores.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.run(build_app(cfg), name="disagg", route_prefix="/disagg")
        serve.run(build_app({**cfg, "draft_ahead": True}), name="ahead", route_prefix="/ahead")

        @serve.deployment(name="Echo")
        class Echo:
            @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002)
            async def call(self, items):
                return items

        echo = serve.run(Echo.bind(), name="echo", route_prefix="/echo")
        def remote(app: str):
            drafts = serve.get_deployment_handle("DraftPool", app).options(multiplexed_model_id="default")
            ver = serve.get_deployment_handle("Verifier", app)

            async def propose(it):
                return await drafts.propose.remote(it)

            async def verify(it):
                return await ver.options(session_id=it.seq_id).verify.remote(it)

            return propose, verify

        async def echo_calls(item, n=200):
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                await echo.call.remote(item)
                ts.append(time.perf_counter() - t0)
            return _ms(ts)

        for app in ("disagg", "ahead"):
            asyncio.run(_drive(_requests(tok, texts[:1], params, f"warm-{app}"), tok, *remote(app)))
        served = asyncio.run(_drive(_requests(tok, texts, params, "serve"), tok, *remote("disagg")))
        ahead = asyncio.run(_drive(_requests(tok, texts, params, "ahead"), tok, *remote("ahead")))
        hist = tok.encode(texts[0]) + [0] * a.max_tokens
        echo_ms = asyncio.run(echo_calls(ProposeItem("x", hist, a.k, Sampling())))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"serve:   propose {served['propose']['mean_ms']:.1f} ms, verify {served['verify']['mean_ms']:.1f} ms, "
          f"step {served['step_ms']:.1f} ms", flush=True)
    print(f"ahead:   propose {ahead['propose']['mean_ms']:.1f} ms, verify {ahead['verify']['mean_ms']:.1f} ms, "
          f"step {ahead['step_ms']:.1f} ms (draft-ahead on)", flush=True)
    print(f"echo:    {echo_ms['mean_ms']:.1f} ms per call (p50 {echo_ms['p50_ms']:.1f})", flush=True)
    report = {
        "pair": {"target": tpath, "draft": dpath}, "k": a.k, "requests": a.requests, "max_tokens": a.max_tokens,
        "compute": compute, "serve": served, "serve_draft_ahead": ahead, "echo": echo_ms,
        "draft_ahead_step_over_plain_step": ahead["step_ms"] / served["step_ms"],
        "overhead_ms_per_step": served["step_ms"] - compute["step_ms"],
        "serve_step_over_compute_step": served["step_ms"] / compute["step_ms"],
        "same_steps": served["steps"] == compute["steps"],
    }
    print(json.dumps({k: report[k] for k in ("overhead_ms_per_step", "serve_step_over_compute_step", "same_steps",
                                             "draft_ahead_step_over_plain_step")}))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
