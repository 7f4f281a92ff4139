"""What asking for logprobs costs the engine (osd_serve/logprobs.py): the same greedy batch generated with
logprobs off and with n alternatives, in interleaved rounds on one loaded pair. The entries come from the
verify forward's logits, so the cost is the step's log-sum-exp and top-n over the asking rows, and the
token texts an API reply renders (measured apart: ``render_s``, with the per-tokenizer memo warm).

    python benchmarks/logprobs_cost.py --pair DIR [--batch 8] [--k 4] [--n 0 5 20] [--out FILE.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import interleaved, load_for, pair_args  # noqa: E402
from osd_serve.config import EngineConfig, SamplingParams  # noqa: E402
from osd_serve.engine import SpecEngine  # noqa: E402
from osd_serve.logprobs import render  # noqa: E402


def _run(target, draft, tok, prompts, n: int | None, k: int, max_tokens: int) -> dict:
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=len(prompts)))
    params = SamplingParams(max_tokens=max_tokens, num_speculative_tokens=k, ignore_eos=True, logprobs=n)
    t0 = time.perf_counter()
    done = eng.generate(prompts, params)
    gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    if n is not None:
        for c in done:
            render(tok, c.token_ids, c.logprobs)
    return {"generate_s": gen, "render_s": time.perf_counter() - t0, "tokens": sum(len(c.token_ids) for c in done),
            "ids": [c.token_ids for c in done]}


def main() -> None:
    ap = pair_args(__doc__, rounds=5, out="benchmarks/results/logprobs_cost.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n", type=int, nargs="+", default=[0, 5, 20], help="alternatives per token to ask for")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    target, draft, tok = load_for(a)
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.batch)]
    runs = {"off": lambda: _run(target, draft, tok, prompts, None, a.k, a.max_tokens)}
    runs |= {f"n={n}": (lambda n=n: _run(target, draft, tok, prompts, n, a.k, a.max_tokens)) for n in a.n}
    res = interleaved(runs, a.rounds)
    off = statistics.median(r["generate_s"] for r in res["off"])
    report = {"pair": a.pair, "batch": a.batch, "k": a.k, "max_tokens": a.max_tokens, "rounds": a.rounds, "variants": {}}
    for label, rs in res.items():
        gen = statistics.median(r["generate_s"] for r in rs)
        report["variants"][label] = {
            "generate_s": round(gen, 4), "over_off": round(gen / off, 3), "render_s": round(statistics.median(r["render_s"] for r in rs), 4),
            "tokens": rs[0]["tokens"], "same_tokens_as_off": all(r["ids"] == res["off"][0]["ids"] for r in rs)}
    print(json.dumps(report, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
