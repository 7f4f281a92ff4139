"""How waiting prompts are prefilled before they join the running batch: a token budget per step.

Why a budget: one engine step prefills, then decodes every running row. Without one, a step admitted up
to max_batch_size prompts in one right-padded forward, so
- every running row waited for the whole prefill: a 30k-token prompt stalled each stream for as long as
  its prefill took, and past ``stall_timeout_s`` the replica was replaced as hung (serving.StallWatch);
- the forward cost (prompts x the longest prompt): a 2,000-token prompt admitted with seven of 10 tokens
  computed 16,000 positions for 2,070 real ones.

So a step prefills at most ``EngineConfig.prefill_chunk_tokens`` target positions, padding included: the
prompts at the head of the queue that fit together, or the first prompt alone, fed in chunks of that many
tokens over as many steps (a ``Partial``), each step still decoding the running rows. The queue stays FIFO.
Not counted: the draft's refill after a hot swap (engine._refill_draft_cache, the running rows' whole
histories) and a swapped draft's catching up (``Partial.feed``): the draft costs a fraction of the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv import BatchKV
from .output import Request


def group_size(lengths: list[int], budget: int | None) -> int:
    """How many prompts at the head of the queue to prefill in one forward.

    lengths  the prefill length of each candidate, in queue order (its prompt less the last token);
             as many as there is room for in the batch, at least one.
    budget   positions one forward may compute, padding included; None: no limit (all of them).
    returns  the longest prefix whose padded forward, count x its longest, fits the budget; at least 1
             (a first prompt over the budget alone: the caller feeds it in chunks).
    """
    n, longest = 0, 0
    for length in lengths:
        longest = max(longest, length)
        if budget is not None and n and (n + 1) * longest > budget:
            break
        n += 1
    return n


@dataclass
class Partial:
    """One prompt too long for a step's budget, being prefilled a chunk per step. It stays at the head
    of the engine's queue meanwhile, so it counts as waiting everywhere (load, /admin/experts, abort)."""

    request: Request
    target: BatchKV  # one row each
    draft: BatchKV
    needs_draft: bool  # k = 0 rows never read their draft: its cache is never fed
    fed: list[int] = field(default_factory=lambda: [0, 0])  # prompt tokens in the target's, the draft's cache

    def feed(self, budget: int) -> bool:
        """Append the next chunk of up to ``budget`` tokens to each cache; True once both hold the
        whole prefill (the prompt but its last token, which the first speculative step feeds)."""
        ids = self.request.prompt_ids[:-1]
        for i, kv in enumerate((self.target, self.draft)):
            if i == 1 and not self.needs_draft:
                continue
            # A draft behind a complete target (swapped mid-prompt) takes the rest at once: swaps that came
            # faster than its chunks kept the prompt out of the batch for good. The draft is small.
            n = len(ids) if i == 1 and self.fed[0] == len(ids) else budget
            chunk = ids[self.fed[i] : self.fed[i] + n]
            if chunk:
                dev = kv.length.device
                x = torch.tensor([chunk], device=dev)  # [1, C]
                kv.forward(x, torch.ones_like(x, dtype=torch.bool), keep=1)  # a prefill reads no logits
                self.fed[i] += len(chunk)
        return self.fed[0] == len(ids) and (self.fed[1] == len(ids) or not self.needs_draft)

    def redraft(self, draft_model) -> None:
        """New draft weights (a hot swap): the draft's cache holds the old weights' keys, so it is fed
        again from the start: in chunks while the target's is incomplete, the rest at once after."""
        self.draft, self.fed[1] = BatchKV(draft_model, 1, self.draft.length.device), 0


# A forward's fixed cost, in positions: below it, a forward of its own costs more than the padding it saves
APART_OVERHEAD = 32


def apart(feeds: list[int], fresh: list[bool], overhead: int = APART_OVERHEAD) -> list[bool]:
    """Which new sequences a disaggregated worker prefills in a forward of their own before its batch forward.

    Why: a worker's batch forward is right-padded, so a new sequence's first call, whose feed is its whole
    prompt, made every row of the batch compute that many positions: one 1,800-token prompt among 7
    decoding rows cost 8 x 1,804 positions for 1,800 + 8 x (k+1) real ones (8.5x the time of prefilling
    it apart on the default pair, benchmarks/results/disagg_apart.json).

    feeds    each row's feed in the batch forward (a new sequence's: its whole history);
    fresh    rows with no cache on the worker, the only ones that can be fed apart before the batch forms.
    returns  per row, whether to feed its history but the last token apart (its feed is then that token).
             The longest new rows go apart if that at least halves the positions computed (B x the longest
             feed left, plus each apart row's prefix and ``overhead``, a forward's fixed cost): a forward
             of its own costs more than its positions say (on a GPU, reading every weight once more), so
             only a clear saving pays. Prompts of like lengths stay batched.
    """
    b = len(feeds)
    order = sorted((i for i in range(b) if fresh[i]), key=lambda i: -feeds[i])
    rest = max((f for f, new in zip(feeds, fresh) if not new), default=0)  # rows that stay, whatever is chosen
    padded = b * max(feeds, default=0)
    best, best_cost, prefix = 0, padded, 0
    for j, i in enumerate(order, 1):
        prefix += feeds[i] - 1 + overhead
        longest = max(rest, feeds[order[j]] if j < len(order) else 0, 1)  # an apart row feeds its last token
        if b * longest + prefix < best_cost:
            best, best_cost = j, b * longest + prefix
    if 2 * best_cost > padded:
        best = 0
    chosen = set(order[:best])
    return [r in chosen for r in range(b)]
