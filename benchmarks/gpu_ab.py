"""Two source trees of osd-serve, timed against each other in one call: is a slower engine step a code
change or the machine? Stop 55's GPU run read batch 1's k = 4 steps at 35.3 ms against stop 27's 27.9 ms,
on a device whose speed moves between loans (benchmarks/GPU.md), so only runs interleaved on one machine
can tell.

Each round runs every tree in a fresh process (its own imports: PYTHONPATH and cwd are the tree), in
interleaved rounds (benchmarks/rounds.py) so a drift of the machine falls on both. A process loads the pair, runs
one untimed generation (warm-up: CUDA's first kernels, the allocator), then times the engine at each k.
The figure is the engine's own per-step draft + target time (StepStats, synchronised there), in ms per
step, so prefill and the loop's Python are left out as in the bench's S comparison.

  here:      python3 benchmarks/gpu_ab.py prepare 8e63e0c           # .ab/8e63e0c: that commit's osd_serve, kernels
  anywhere:  python3 benchmarks/gpu_ab.py run --pair /tmp/osd-gpu-pair --tree old=.ab/8e63e0c --tree new=.
             [--k 0,4] [--rounds 3] [--prompts 4] [--max-tokens 64] [--batch 1] [--device cuda] [--dtype bfloat16]

The last line printed is JSON: per tree and k, each round's ms per step and their median, and each
tree's median over the first tree's."""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.rounds import interleaved  # noqa: E402

# Run in the tree's own process: only APIs both stop 27's tree and today's have (load_pair, SpecEngine,
# generate(stats=), StepStats.draft_time / target_time).
WORKER = r"""
import json, sys, time
import torch
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.loading import ModelConfig, load_pair
a = json.loads(sys.argv[1])
target, draft, tok = load_pair(ModelConfig(target=a["pair"] + "/target", draft=a["pair"] + "/draft", dtype=a["dtype"],
                                           device=a["device"]))
lines = [json.loads(s) for s in open(a["pair"] + "/prompts.jsonl") if s.strip()][: a["prompts"]]
ids = [tok(r["prompt"])["input_ids"] for r in lines]
def run(k):
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=a["batch"]))
    stats = []
    eng.generate(ids, SamplingParams(max_tokens=a["max_tokens"], num_speculative_tokens=k), stats=stats)
    return stats
run(max(a["ks"]))  # warm-up, untimed
out = {}
for k in a["ks"]:
    st = run(k)
    out[k] = 1000 * sum(s.draft_time + s.target_time for s in st) / len(st)
print("AB " + json.dumps({"from": sys.modules[SpecEngine.__module__].__file__, "ms": out}))  # the engine timed
"""


def prepare(rev: str) -> None:
    dest = ROOT / ".ab" / rev
    ex = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, check=True, capture_output=True,
                        text=True).stdout.strip()
    ex_path = ROOT / ex
    ex_path.parent.mkdir(parents=True, exist_ok=True)
    if "/.ab/" not in (ex_path.read_text().split() if ex_path.exists() else []):
        with ex_path.open("a") as f:
            f.write("/.ab/\n")  # git-ignored: carry it to the device (run's carry: [".ab"])
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, "osd_serve", "kernels"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    print(dest)


def time_tree(tree: Path, args: dict) -> dict[int, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    p = subprocess.run([sys.executable, "-c", WORKER, json.dumps(args)], cwd=tree, env=env, capture_output=True, text=True)
    lines = [s for s in p.stdout.splitlines() if s.startswith("AB ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"error: the run of tree {tree} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    got = json.loads(lines[-1][3:])
    if Path(got["from"]).resolve().parents[1] != tree:  # an installed osd_serve must not stand in for the tree's
        raise SystemExit(f"error: tree {tree} imported osd_serve from {got['from']}")
    return {int(k): v for k, v in got["ms"].items()}


def run(ns: argparse.Namespace) -> dict:
    trees = []
    for spec in ns.tree:
        name, _, path = spec.partition("=")
        tree = Path(path or name).resolve()
        if not (tree / "osd_serve").is_dir():
            raise SystemExit(f"error: --tree {spec}: no osd_serve/ under {tree}")
        trees.append((name if path else tree.name, tree))
    if len(trees) < 2:
        raise SystemExit("error: give two or more --tree NAME=DIR")
    ks = [int(k) for k in ns.k.split(",")]
    args = dict(pair=str(Path(ns.pair).resolve()), dtype=ns.dtype, device=ns.device, prompts=ns.prompts,
                max_tokens=ns.max_tokens, batch=ns.batch, ks=ks)

    def timed(name: str, tree: Path) -> dict[int, float]:
        ms = time_tree(tree, args)
        print(f"{name}: " + ", ".join(f"k={k} {ms[k]:.2f} ms/step" for k in ks), file=sys.stderr, flush=True)
        return ms

    # each process warms itself up (its first generation is untimed): no round is dropped
    per_round = interleaved({name: functools.partial(timed, name, tree) for name, tree in trees}, ns.rounds, warmup=False)
    rounds = {name: {k: [ms[k] for ms in got] for k in ks} for name, got in per_round.items()}
    base = trees[0][0]
    med = {name: {k: statistics.median(v) for k, v in per.items()} for name, per in rounds.items()}
    return {"args": args, "rounds_ms_per_step": rounds, "median_ms_per_step": med,
            f"over_{base}": {name: {k: med[name][k] / med[base][k] for k in ks} for name in med}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="unpack a commit's osd_serve and kernels into .ab/REV")
    pr.add_argument("rev")
    ru = sub.add_parser("run", help="time the trees, interleaved")
    ru.add_argument("--pair", required=True, help="a directory with target/, draft/ and prompts.jsonl (gpu_pair.py's)")
    ru.add_argument("--tree", action="append", required=True, help="NAME=DIR, a tree with osd_serve/ and kernels/")
    ru.add_argument("--k", default="0,4")
    ru.add_argument("--rounds", type=int, default=3)
    ru.add_argument("--prompts", type=int, default=4)
    ru.add_argument("--max-tokens", type=int, default=64)
    ru.add_argument("--batch", type=int, default=1)
    ru.add_argument("--device", default="cuda")
    ru.add_argument("--dtype", default="bfloat16")
    ns = ap.parse_args(argv)
    if ns.cmd == "prepare":
        prepare(ns.rev)
    else:
        print(json.dumps(run(ns)))


if __name__ == "__main__":
    main()
