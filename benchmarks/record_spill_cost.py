"""What keeping the local backend's replay records as files (osd_serve/distill/spill.py, ReplicaSpill) costs
serving: the same requests through two SpecServices over one pair, one whose records are also written to its
versions slot (private_versions, as a Ray Serve replica) and one whose records stay in memory, which is all
that differs. Rounds alternate between them; distillation's trigger is set out of reach, so no update runs
and the difference is recording plus the files' writer thread (it shares the process, and so the GIL, with
the engine). GSM8K questions when ../shared/datasets has them, else examples/prompts.jsonl.

    python benchmarks/record_spill_cost.py --pair ~/.cache/osd-serve/default-pair --keep all

Prints one JSON line: tok/s per round of each; files/memory per round, each files round over the memory round
run beside it (paired: the host's speed drifts over a run, which a ratio of two medians hides), their median
(1.0: no cost) and in how many rounds the files side was slower; and the records and bytes it wrote. After each
round, outside its timing, the writer is flushed and the OS's dirty pages synced, so no round pays for the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.http_bench import prompts  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from osd_serve.config import SamplingParams  # noqa: E402
from osd_serve.service import SpecService, load_models  # noqa: E402


async def _round(svc: SpecService, texts: list[str], max_tokens: int, concurrency: int) -> float:
    """tok/s of one round: every prompt, at most ``concurrency`` at a time (the engine batches them)."""
    gate, tokens = asyncio.Semaphore(concurrency), 0

    async def one(p: str) -> None:
        nonlocal tokens
        async with gate:
            async for d in svc.stream("default", p, SamplingParams(max_tokens=max_tokens, temperature=0)):
                tokens += len(d["token_ids"])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in texts))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a directory with target/ and draft/")
    ap.add_argument("--keep", choices=["mismatch", "all"], default="all", help="all: every position, the most bytes")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = AppConfig(target=str(args.pair / "target"), draft=str(args.pair / "draft"), max_batch_size=args.concurrency,
                        distill={"versions_dir": tmp, "mode": "full", "keep": args.keep, "trigger_records": 10**9,
                                 "trigger_age_s": 1e9, "buffer_mb": 4096}, wandb={"mode": "disabled"})
        target, draft, tok = load_models(cfg)
        sides = {"files": SpecService(cfg, models=(target, draft, tok), replica_tag="files", private_versions=True),
                 "memory": SpecService(cfg, models=(target, draft, tok), replica_tag="memory")}
        texts = prompts(args.requests)
        tok_s: dict[str, list[float]] = {name: [] for name in sides}
        try:
            for r in range(args.rounds + 1):  # round 0 warms both up, and is not counted
                for name in (("files", "memory") if r % 2 else ("memory", "files")):
                    rate = asyncio.run(_round(sides[name], texts, args.max_tokens, args.concurrency))
                    if sides[name].spill is not None:
                        sides[name].spill.writer.flush()
                    os.sync()
                    if r:
                        tok_s[name].append(rate)
            spill = sides["files"].spill
            spill.writer.flush()  # the bytes on disk are those the round's records made
            files = list(spill.writer.disk.root.rglob("*.safetensors"))
            written = {"records": len(files), "bytes": sum(f.stat().st_size for f in files)}
        finally:
            for svc in sides.values():
                svc.close()
    paired = [f / m for f, m in zip(tok_s["files"], tok_s["memory"], strict=True)]
    print(json.dumps({"pair": str(args.pair), "keep": args.keep, "requests": args.requests, "max_tokens": args.max_tokens,
                      "concurrency": args.concurrency, "tok_s": tok_s,
                      "median_tok_s": {name: statistics.median(v) for name, v in tok_s.items()},
                      "files_over_memory_per_round": paired, "files_over_memory": statistics.median(paired),
                      "rounds_files_slower": sum(x < 1 for x in paired), "written": written}))


if __name__ == "__main__":
    main()
