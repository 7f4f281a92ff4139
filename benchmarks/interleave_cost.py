"""What a forward costs inside the speculative loop's order against alone, as ``osd-serve bench`` times
c and v. The bench's S takes c (a draft forward ÷ a target forward) and v (a target forward over k+1
tokens ÷ over 1) from forwards of one model repeated back to back, whose weights then stay in the
core's caches. In the engine the k draft forwards and the target's verification alternate, so the
first draft forward of each step follows a target forward that streamed the target's weights through
L2: this measures how much that costs, with the bench's own timed forward (``osd_serve.bench.timed_forward``).

    python benchmarks/interleave_cost.py --pair ~/.cache/osd-serve/default-pair --dtype bfloat16 --k 5

Prints one JSON line: medians in ms of each kind of forward, and the step's extra cost over the
bench's isolated figures as a share of a step (k draft forwards + one verification).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from osd_serve.bench import filled_cache, timed_forward
from osd_serve.loading import ModelConfig, load_pair


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a directory with target/ and draft/")
    ap.add_argument("--dtype", default="float32")
    # auto: float32 under a half-precision target (ModelConfig.draft_dtype); the bfloat16 lines of
    # results/interleave_cost_amx.jsonl predate it and ran a bfloat16 draft (--draft-dtype bfloat16)
    ap.add_argument("--draft-dtype", default="auto")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--context", type=int, default=65, help="cached tokens (the bench: median prompt + max_tokens/2)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, _ = load_pair(ModelConfig(target=str(args.pair / "target"), draft=str(args.pair / "draft"),
                                             dtype=args.dtype, draft_dtype=args.draft_dtype, device="cpu"))
    vocab = target.get_output_embeddings().weight.shape[0]
    k = args.k
    tkv, dkv = (filled_cache(m, 1, args.context, vocab, torch.device("cpu")) for m in (target, draft))

    def fwd(kv, n: int) -> float:  # one forward of n tokens, rolled back, as the bench times c and v
        return timed_forward(kv, n, vocab)

    t = {name: [] for name in ("draft_alone", "verify_alone", "draft_first_in_step", "draft_rest_in_step", "verify_in_step")}
    for r in range(args.rounds + 2):
        keep = r >= 2  # two warm-up rounds
        alone_d = [fwd(dkv, 1) for _ in range(k + 1)][1:]  # the first follows the last round's verification
        alone_v = [fwd(tkv, k + 1) for _ in range(3)][1:]  # the first follows draft forwards
        fwd(tkv, k + 1)  # a step: the verification, then the next step's k draft forwards, then its verification
        step_d = [fwd(dkv, 1) for _ in range(k)]
        step_v = fwd(tkv, k + 1)
        if keep:
            t["draft_alone"] += alone_d
            t["verify_alone"] += alone_v
            t["draft_first_in_step"].append(step_d[0])
            t["draft_rest_in_step"] += step_d[1:]
            t["verify_in_step"].append(step_v)
    ms = {name: statistics.median(v) * 1e3 for name, v in t.items()}
    alone = k * ms["draft_alone"] + ms["verify_alone"]
    in_step = ms["draft_first_in_step"] + (k - 1) * ms["draft_rest_in_step"] + ms["verify_in_step"]
    draft_dtype = str(next(draft.parameters()).dtype).removeprefix("torch.")
    print(json.dumps({"pair": str(args.pair), "dtype": args.dtype, "draft_dtype": draft_dtype, "k": k, "context": args.context, "ms": ms,
                      "step_ms_alone": alone, "step_ms_in_order": in_step, "extra_share_of_step": in_step / alone - 1}))


if __name__ == "__main__":
    main()
