"""Does a stream in flight survive a redeploy that replaces the replicas serving it? Ray Serve stops a
replaced replica gracefully: it waits for the requests it holds, up to the deployment's
graceful_shutdown_timeout_s, then kills it. osd-serve's deployments set 120 s
(deployments.config.GRACEFUL_SHUTDOWN_S); Serve's own default is 20 s, which cut a long stream.

Starts a local Ray cluster with a tiny pair (colocated topology), opens one long greedy stream, redeploys
with other init args (every replica is replaced) and reports whether the stream ended with [DONE].
`--grace S` sets every deployment's timeout to S instead (20 gives Serve's default):

    python benchmarks/redeploy_drain.py [--grace 20] [--max-tokens 6000] [--port 28123]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/ (its tiny models)


def _pair(root: Path) -> tuple[str, str]:
    from tests.conftest import char_tokenizer, llama, perturbed  # the suite's tiny models: no download

    tok = char_tokenizer()
    target = llama(len(tok), seed=3)
    target.config.max_position_embeddings = 8192  # room for a stream that outlives the redeploy
    for name, m in (("target", target), ("draft", perturbed(target, 0.08))):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grace", type=float, default=None, help="every deployment's graceful_shutdown_timeout_s")
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--port", type=int, default=28123)
    args = ap.parse_args()

    import httpx
    import ray
    from ray import serve

    import deployments.app as dapp

    target, draft = _pair(Path(tempfile.mkdtemp()))

    def app(max_batch_size: int):
        a = dapp.build_app({"target": target, "draft": draft, "max_model_len": 8192, "max_batch_size": max_batch_size,
                            "distill": {"enabled": False}, "wandb": {"mode": "disabled"}})
        if args.grace is not None:  # as a config's `deployments:` entries would set it
            for d in [a._bound_deployment, *(b._bound_deployment for b in a._bound_deployment.init_args)]:
                d._deployment_config.graceful_shutdown_timeout_s = args.grace
        return a

    ray.init(num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(app(8), name="osd", route_prefix="/")
    out = {"chunks": 0, "done": False, "error": None}

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{args.port}/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out["chunks"] += 1
                        out["done"] = out["done"] or line == "data: [DONE]"
                        out["error"] = out["error"] or (line[:200] if '"error"' in line else None)
        except Exception as e:  # noqa: BLE001  the connection cut: what this measures
            out["error"] = repr(e)[:200]

    t0 = time.monotonic()
    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(8)
    before = out["chunks"]
    serve.run(app(4), name="osd", route_prefix="/")  # other init args: every replica is replaced
    redeployed = time.monotonic() - t0
    reader.join(700)
    print(json.dumps({"graceful_shutdown_timeout_s": args.grace or dapp.GRACEFUL_SHUTDOWN_S, "chunks_before_redeploy": before,
                      "redeploy_returned_s": round(redeployed, 1), "seconds": round(time.monotonic() - t0, 1), **out}))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
