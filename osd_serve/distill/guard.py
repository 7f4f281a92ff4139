"""The publish guard: a new draft version serves only if it is no worse than the one serving now.

Measured on held-out guard samples (recent requests whose every verified position was recorded,
which the update did not train on; split_for_guard), with the target's
distributions the records already carry, so the guard costs draft forwards only:
    alpha-hat  mean over kept positions of sum_x min(p(x), q(x))  (= expected acceptance)
    greedy     mean of argmax q == argmax p                         (greedy acceptance)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kv import max_input_id, pad_right
from .replay import ReplayRecord


@dataclass
class GuardConfig:
    tolerance: float = 0.0  # publish if alpha-hat(new) >= alpha-hat(serving) - tolerance
    heldout_fraction: float = 0.25  # the newest records of an update, held out of its training
    min_heldout: int = 2
    max_heldout: int = 32  # the slice is recent traffic: a whole buffer's worth would be stale

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if not math.isfinite(self.tolerance) or self.tolerance < 0:  # nan < 0 is False: it passed, and published all
            raise ValueError(f"tolerance must be finite and >= 0, got {self.tolerance}")


def split_for_guard(heldout_flags: list[bool], cfg: GuardConfig) -> tuple[list[int], list[int]] | None:
    """(train, held-out) indices into a shard's records, oldest first; None: too few guard samples.

    Held out: the newest guard samples (every verified position kept, so unbiased), as many as
    heldout_fraction of the records within [min_heldout, max_heldout]; they are what the next
    requests will look like. Train: everything else, older guard samples included.
    """
    n = len(heldout_flags)
    want = max(cfg.min_heldout, min(cfg.max_heldout, math.ceil(cfg.heldout_fraction * n)))
    guard = [i for i, h in enumerate(heldout_flags) if h][-want:]
    if len(guard) < cfg.min_heldout or len(guard) >= n:
        return None
    held = set(guard)
    return [i for i in range(n) if i not in held], guard


def retire_guard_samples(trained: list) -> None:
    """The guard samples among ``trained`` (records, or the Ray buffer's RecordRefs) become ordinary
    records once an update trained on them is published. The buffer keeps them, and a later split
    could hold them out again (its held-out count grows with the buffer, or too few guard samples
    came since): scored on data both drafts had fitted, the guard would no longer be held out."""
    for r in trained:
        r.heldout = False


@dataclass
class Verdict:
    publish: bool
    reason: str
    candidate: dict  # {"expected_acceptance", "greedy_agreement", "positions"}
    serving: dict


@torch.no_grad()
def evaluate(model, records: list[ReplayRecord], vocab: int, batch: int = 16) -> dict:
    """alpha-hat and greedy agreement of ``model`` against the records' target distributions."""
    was_training = model.training
    model.eval()
    overlap, agree, n = 0.0, 0, 0
    for i in range(0, len(records), batch):
        recs = records[i : i + batch]
        ids, mask = pad_right([torch.cat([r.prompt_ids, r.response_ids]) for r in recs])
        mask = mask.long()
        dev = next(model.parameters()).device
        logits = model(input_ids=ids.clamp(max=max_input_id(model)).to(dev), attention_mask=mask.to(dev)).logits  # [B, L, V']
        for j, r in enumerate(recs):
            p = r.dense_probs(vocab)  # [n, V]
            # A draft with a smaller embedding never proposes the ids it lacks: no overlap there. One
            # with a larger (padded) embedding proposes only the target's ids, as serving cuts its logits.
            w = min(vocab, logits.shape[-1], p.shape[-1])
            # the kept positions only, then float32: the whole [B, L, V'] in float32 on a training GPU (the Ray
            # job's rank 0 guards there) is 10 GB for 16 records of 1k tokens over a 152k vocabulary
            at = (len(r.prompt_ids) - 1 + r.positions).to(logits.device)
            q = torch.softmax(logits[j, at, :w].float().cpu(), -1)  # [n, w]
            overlap += float(torch.minimum(p[:, :w], q).sum())
            agree += int((q.argmax(-1) == p.argmax(-1)).sum())
            n += len(r.positions)
    model.train(was_training)
    return {"expected_acceptance": overlap / n if n else None, "greedy_agreement": agree / n if n else None, "positions": n}


def finite(state: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def check(candidate, serving, heldout: list[ReplayRecord], vocab: int, cfg: GuardConfig, candidate_state=None,
          steps_taken: int | None = None) -> Verdict:
    """candidate, serving: draft models (the serving one is the guard's private copy of what serves).
    steps_taken: the optimizer steps the update took, where known."""
    if steps_taken == 0:
        # Every step was skipped (non-finite gradients, no records): the candidate is the serving draft,
        # the guard passed it as no worse, and each such update published a copy that pushed distinct
        # versions out of the keep_last that rollbacks reach.
        return Verdict(False, "no training step taken (every gradient was non-finite, or no records)", {}, {})
    state = candidate_state if candidate_state is not None else candidate.state_dict()
    if not finite(state):
        return Verdict(False, "non-finite weights", {}, {})
    new, cur = evaluate(candidate, heldout, vocab), evaluate(serving, heldout, vocab)
    if new["expected_acceptance"] is None:
        return Verdict(False, "no held-out positions", new, cur)
    if new["expected_acceptance"] != new["expected_acceptance"]:  # NaN logits from finite weights
        return Verdict(False, "non-finite acceptance", new, cur)
    # Both must hold: alpha-hat is what sampled requests accept, greedy agreement what greedy ones do.
    # Greedy agreement is a 0/1 mean over a few hundred positions, so a drop within one standard
    # error is noise, not a worse draft; refusing on it would stall updates that do help.
    n, p = max(cur["positions"], 1), cur["greedy_agreement"]
    noise = {"expected_acceptance": 0.0, "greedy_agreement": (p * (1 - p) / n) ** 0.5}
    for key, name in (("expected_acceptance", "alpha-hat"), ("greedy_agreement", "greedy agreement")):
        if new[key] < cur[key] - cfg.tolerance - noise[key]:
            return Verdict(False, f"{name} {new[key]:.4f} < serving {cur[key]:.4f}", new, cur)
    return Verdict(True, "ok", new, cur)
