"""What the prefill and disaggregation benchmarks share: a bootstrap pair loaded from its directory, and
runs timed in interleaved rounds, so drift of a shared machine hits every variant alike."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from osd_serve.loading import ModelConfig, load_pair

T = TypeVar("T")


def load_pair_dir(pair: str | Path, dtype: str = "auto"):
    """(target, draft, tokenizer) of an ``osd-serve bootstrap`` directory (target/ and draft/), on the CPU."""
    return load_pair(ModelConfig(target=str(Path(pair) / "target"), draft=str(Path(pair) / "draft"), device="cpu",
                                 dtype=dtype))


def pair_args(description: str, rounds: int, out: str | None = None) -> argparse.ArgumentParser:
    """The options every pair benchmark here takes (--pair, --k, --rounds, --threads, --dtype, --out); add its own."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="a directory with target/ and draft/ (osd-serve bootstrap)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the target's (ModelConfig.dtype; auto: float32 on CPU)")
    ap.add_argument("--out", default=out)
    return ap


def load_for(args: argparse.Namespace):
    """(target, draft, tokenizer) of ``args.pair``, with torch on ``args.threads`` threads."""
    import torch

    torch.set_num_threads(args.threads)
    return load_pair_dir(args.pair, args.dtype)


def interleaved(runs: dict[str, Callable[[], T]], rounds: int, warmup: bool = True) -> dict[str, list[T]]:
    """Each run once per round, in turn, for ``rounds`` rounds after one that warms up and is dropped
    (``warmup=False``: none, for runs that warm themselves up)."""
    out: dict[str, list[T]] = {label: [] for label in runs}
    for r in range(rounds + warmup):
        for label, run in runs.items():
            res = run()
            if r >= warmup:
                out[label].append(res)
    return out


def ab_args(description: str, ks: list[int]) -> argparse.ArgumentParser:
    """pair_args plus what an on/off comparison per k on the bench's batch workload takes (--ks, --prompts, --batch)."""
    ap = pair_args(description, rounds=3)
    ap.add_argument("--ks", type=int, nargs="+", default=ks)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    return ap


def pair_prompts(pair: str | Path, tok, n: int) -> list[list[int]]:
    """The token ids of the first ``n`` prompts of a bootstrap pair's prompts.jsonl."""
    from osd_serve.cli import _read_prompts

    return [tok(p)["input_ids"] for p in _read_prompts(str(Path(pair) / "prompts.jsonl"))[:n]]


def on_off_by_k(run: Callable[[int, bool], dict], ks: list[int], rounds: int, keys) -> dict[int, tuple]:
    """``run(k, on)`` for every k with the variant on and off, in interleaved rounds. Per k: (medians of
    ``keys`` on, the same off, the runs on, the runs off)."""
    got = interleaved({f"{k}/{on}": (lambda k=k, on=on: run(k, on)) for k in ks for on in (True, False)}, rounds)
    med = lambda rs: {key: statistics.median(r[key] for r in rs) for key in keys}  # noqa: E731
    return {k: (med(got[f"{k}/True"]), med(got[f"{k}/False"]), got[f"{k}/True"], got[f"{k}/False"]) for k in ks}
