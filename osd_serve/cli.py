"""The `osd-serve` command line: bootstrap, generate, bench."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path


def _read_prompts(path: str, field: str = "prompt") -> list[str]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{n}: not valid JSON ({e.msg})")
            if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
                raise SystemExit(f"error: {path}:{n}: expected an object with a string field {field!r}")
            prompts.append(rec[field])
    if not prompts:
        raise SystemExit(f"error: {path} holds no prompts")
    return prompts


def _pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model: local directory or hub id (default: the embedded default pair)")
    p.add_argument("--draft", help="draft model: local directory or hub id (default: the embedded default pair)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")


def _load(args):
    from .loading import ModelConfig, load_pair

    if bool(args.target) != bool(args.draft):
        raise SystemExit("error: give both --target and --draft, or neither for the embedded default pair")
    if not args.target:
        from .bootstrap import build_pair

        pair = build_pair()
        args.target, args.draft = pair["target"], pair["draft"]
    try:
        return load_pair(ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device))
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def cmd_bootstrap(args) -> None:
    from .bootstrap import build_pair

    pair = build_pair(data_files=args.data, out_root=args.out, force=args.force, preset=args.preset)
    print(json.dumps({"target": pair["target"], "draft": pair["draft"]}))


def cmd_generate(args) -> None:
    from tqdm import tqdm

    from .config import EngineConfig, SamplingParams
    from .engine import SpecEngine

    prompts = _read_prompts(args.prompts)
    target, draft, tok = _load(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, num_speculative_tokens=args.num_speculative_tokens,
        )
        engine = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=args.batch_size))
        seeds = [None if args.seed is None else args.seed + i for i in range(len(prompts))]
        reqs = engine.submit(prompts, [replace(params, seed=s) for s in seeds])
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    bar = tqdm(total=len(reqs), desc="generate", unit="prompt", file=sys.stderr)
    done = 0
    while engine.has_unfinished():
        engine.step()
        now = sum(r.finished for r in reqs)
        bar.update(now - done)
        done = now
    bar.close()
    lines = []
    for r in reqs:
        c = r.completion()
        rec = {"prompt": c.prompt, "text": c.text, "token_ids": c.token_ids, "proposed": c.proposed, "accepted": c.accepted, "finish_reason": c.finish_reason}
        lines.append(json.dumps(rec))
    if not args.out:
        print("\n".join(lines))
        return
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    total_p, total_a = sum(r.proposed for r in reqs), sum(r.accepted for r in reqs)
    print(json.dumps({"out": args.out, "prompts": len(reqs), "acceptance": total_a / total_p if total_p else None}))


def cmd_bench(args) -> None:
    import torch

    from .bench import run_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tok = _load(args)
    prompts = _read_prompts(args.prompts) if args.prompts else _read_prompts(str(Path(args.target).parent / "prompts.jsonl"))
    prompts = prompts[: args.num_prompts]
    ks = range(1, args.max_k + 1)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    report = run_bench(target, draft, tok, prompts, args.max_tokens, sizes, ks, log=lambda s: print(s, file=sys.stderr))
    report["target"], report["draft"] = args.target, args.draft
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="osd-serve", description="Online speculative decoding server and tools")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bootstrap", help="build (or reuse) the embedded default target/draft pair")
    b.add_argument("--data", nargs="+", metavar="FILE", help="train on these .jsonl/.json/.txt files instead of the built-in corpus")
    b.add_argument("--out", help="output root (default $OSD_SERVE_HOME or ~/.cache/osd-serve)")
    b.add_argument("--force", action="store_true", help="rebuild even if a finished build exists")
    b.add_argument("--preset", default="default", choices=["default", "tiny"], help="tiny: seconds-long build for tests")
    b.set_defaults(fn=cmd_bootstrap)

    g = sub.add_parser("generate", help="generate completions for a jsonl file of {\"prompt\": ...}")
    _pair_args(g)
    g.add_argument("--prompts", required=True, metavar="FILE.jsonl")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="seed of the first prompt; prompt i uses seed+i")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--out", metavar="FILE.jsonl")
    g.set_defaults(fn=cmd_generate)

    n = sub.add_parser("bench", help="tokens/s against the target alone and HF assisted generation")
    _pair_args(n)
    n.add_argument("--prompts", metavar="FILE.jsonl", help="default: prompts.jsonl beside the pair")
    n.add_argument("--num-prompts", type=int, default=16)
    n.add_argument("--max-tokens", type=int, default=64)
    n.add_argument("--batch-sizes", default="1,8")
    n.add_argument("--max-k", type=int, default=8)
    n.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    n.add_argument("--out", metavar="FILE.json")
    n.set_defaults(fn=cmd_bench)

    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
