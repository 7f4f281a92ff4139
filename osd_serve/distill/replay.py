"""Replay records written at verification, and a byte-bounded replay buffer with one shard per expert.

A record keeps the token ids of prompt and response and, at the positions kept, the target's
distribution: in full (float16) or as its top-k (ids + float16 probs) plus the remaining mass, which
is enough to rebuild a distribution for the losses in losses.py without re-running the target.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch


# What a kept record costs beyond its tensors' data, counted against the byte bound: its up to six
# small CPU tensors (~0.5 KB each with their allocations) and the dataclass, ~3 KB measured. A top-k
# record of a short request holds a few hundred bytes of data, so with data alone counted a shard at
# its bound held ~13x buffer_mb of real memory.
RECORD_OVERHEAD = 3 << 10


@dataclass
class ReplayRecord:
    prompt_ids: torch.Tensor  # [P] int32
    response_ids: torch.Tensor  # [R] int32
    positions: torch.Tensor  # [n] int64 indices into response_ids whose target distribution is kept
    probs: torch.Tensor  # [n, V] float16 (full) or [n, K] float16 (top-k)
    topk_ids: torch.Tensor | None = None  # [n, K] int32 when top-k, else None
    rest_mass: torch.Tensor | None = None  # [n] float16 mass outside the top-k
    expert: str = "default"
    created: float = field(default_factory=time.monotonic)
    # A guard sample: every verified position kept, whatever RecordConfig.keep says (recorder.py), so
    # the guard scores drafts on positions the serving draft did not choose; held out of training
    # while it is among the newest (guard.split_for_guard), an ordinary record once a published update
    # trained on it (guard.retire_guard_samples).
    heldout: bool = False
    seq: int = -1  # its file's number (spill.py), once a buffer that keeps files has kept it
    # Who it is, made with it and saved in its file: Ray retries an add() whose actor died mid-call, and the
    # restarted buffer, which read the first call's file back, must know the record again (replay_actor.py)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def nbytes(self) -> int:
        ts = [self.prompt_ids, self.response_ids, self.positions, self.probs, self.topk_ids, self.rest_mass]
        return RECORD_OVERHEAD + sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dense_probs(self, vocab: int) -> torch.Tensor:
        """The kept distributions as [n, V'] float32; top-k spreads the rest mass uniformly on the others.

        Full records keep the target's width V' (the caller cuts it to its draft's ids). A top-k
        record is built over ``vocab`` ids, widened to the largest kept id where the target has ids
        the draft lacks (Qwen2.5-7B's 152064 over 0.5B's 151936): cut there, the mass on missing
        ids would be lost from the row; kept, the caller cuts and renormalises as for a full record.
        """
        if self.topk_ids is None:
            return self.probs.float()
        n, k = self.probs.shape
        width = max(vocab, int(self.topk_ids.max()) + 1) if self.topk_ids.numel() else vocab
        fill = (self.rest_mass.float() / max(width - k, 1))[:, None].expand(n, width).clone()  # [n, V']
        return fill.scatter_(1, self.topk_ids.long(), self.probs.float())


def compress(p: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p [n, V] -> the top-k probs [n, K] float16, their ids [n, K] int32 and the mass outside them [n] float16."""
    vals, ids = p.detach().float().cpu().topk(topk, dim=-1)  # [n, K]
    return vals.half(), ids.int(), (1.0 - vals.sum(-1)).clamp_min(0).half()


def make_record(prompt_ids, response_ids, positions, target_probs, topk: int = 0, expert: str = "default") -> ReplayRecord:
    """target_probs [n, V]: the target's distribution at ``positions`` (temperature 1, unprocessed), or
    the (vals, ids, rest) ``compress`` made of it already (the recorder compresses as it goes)."""
    as_i32 = lambda x: torch.as_tensor(x, dtype=torch.int32).cpu()  # noqa: E731
    pos = torch.as_tensor(positions, dtype=torch.long).cpu()
    if isinstance(target_probs, tuple):
        return ReplayRecord(as_i32(prompt_ids), as_i32(response_ids), pos, *target_probs, expert)
    p = target_probs.detach().float().cpu()
    if topk and topk < p.shape[-1]:
        return ReplayRecord(as_i32(prompt_ids), as_i32(response_ids), pos, *compress(p, topk), expert)
    return ReplayRecord(as_i32(prompt_ids), as_i32(response_ids), pos, p.half(), expert=expert)


@dataclass
class BufferConfig:
    max_bytes: int = 256 << 20  # per shard
    trigger_records: int = 8  # an update is due at this many new records (the paper's I = 8)...
    trigger_age_s: float = 60.0  # ...or when the oldest new record is this old, whichever comes first
    eviction: str = "fifo"  # fifo | reservoir
    seed: int = 0

    def __post_init__(self) -> None:
        if self.eviction not in ("fifo", "reservoir"):
            raise ValueError(f"eviction must be fifo or reservoir, got {self.eviction!r}")
        # not (age > 0): a NaN age passed `<= 0` and the age trigger never fired
        if self.max_bytes <= 0 or self.trigger_records < 1 or not 0 < self.trigger_age_s < math.inf:
            raise ValueError("max_bytes, trigger_records and trigger_age_s must be positive (and the age finite)")


class Shard:
    """Records of one expert, bounded by bytes. FIFO drops the oldest; reservoir keeps a uniform
    sample of everything ever offered (Vitter's algorithm R, by bytes-bounded capacity). In reservoir
    mode the update trigger counts the records kept, not those offered, as that is what changes the
    training data. A guard sample that a published update trained on is no longer one
    (guard.retire_guard_samples), so evicting newer ones never brings it back into the held-out slice."""

    def __init__(self, cfg: BufferConfig, rng: random.Random, on_drop=None):
        self.cfg, self.rng = cfg, rng
        self.on_drop = on_drop  # called with each record evicted (the Ray buffer removes its file, spill.py)
        self.records: deque[ReplayRecord] = deque()
        self.nbytes = 0
        self.seen = 0  # records ever offered (for reservoir)
        self.full = False  # reservoir: capacity was reached once; every later record takes the test
        self.new_since_update = 0
        self.oldest_new: float | None = None

    def add(self, rec: ReplayRecord, now: float | None = None) -> bool:
        """Returns whether the record was kept."""
        self.seen += 1
        if rec.nbytes > self.cfg.max_bytes:
            return False
        if self.cfg.eviction == "reservoir" and (self.full or self.nbytes + rec.nbytes > self.cfg.max_bytes):
            # Keep with probability (records held)/seen, replacing uniformly chosen residents. Every
            # record takes the test once the shard has filled: records vary in size, and letting the
            # ones that fit into space a larger victim left enter untested kept mostly the newest.
            self.full = True
            if self.rng.random() >= len(self.records) / self.seen:
                return False
            self._evict_random(self.cfg.max_bytes - rec.nbytes)
        while self.records and self.nbytes + rec.nbytes > self.cfg.max_bytes:
            self._dropped(self.records.popleft())
        self.records.append(rec)
        self.nbytes += rec.nbytes
        self.new_since_update += 1
        if self.oldest_new is None:
            self.oldest_new = rec.created if now is None else now
        return True

    def shrink(self, max_bytes: int) -> None:
        """Down to ``max_bytes``: the oldest go (FIFO), or uniformly chosen records (reservoir)."""
        if self.cfg.eviction == "reservoir":
            self._evict_random(max_bytes)
        while self.records and self.nbytes > max_bytes:
            self._dropped(self.records.popleft())
        if not self.records:
            # Emptied (every record larger than the new bound): a reservoir that stayed 'full' kept
            # each new record with probability len(records)/seen = 0, and refused every one for good;
            # one that refilled untested still divided by the old count and froze on its first few.
            # The sample restarts over the records offered from now on.
            self.full, self.seen = False, 0

    def _evict_random(self, max_bytes: int) -> None:
        while self.records and self.nbytes > max_bytes:
            victim = self.rng.randrange(len(self.records))
            self._dropped(self.records[victim])
            del self.records[victim]

    def _dropped(self, rec) -> None:
        self.nbytes -= rec.nbytes
        if self.on_drop is not None:
            self.on_drop(rec)

    def due(self, now: float | None = None) -> str | None:
        """'size' or 'age' when an update is due, else None."""
        if self.new_since_update >= self.cfg.trigger_records:
            return "size"
        now = time.monotonic() if now is None else now
        if self.oldest_new is not None and now - self.oldest_new >= self.cfg.trigger_age_s:
            return "age"
        return None

    def mark_updated(self) -> tuple[int, float | None]:
        """Start a new trigger window; returns the one it closed (for rearm)."""
        window = self.new_since_update, self.oldest_new
        self.new_since_update, self.oldest_new = 0, None
        return window

    def rearm(self, window: tuple[int, float | None]) -> None:
        """Put back a window whose update failed: its records still count toward the trigger, and the
        update is retried, not left until as many new records (or the age trigger's wait) again."""
        n, oldest = window
        self.new_since_update += n
        if oldest is not None:
            self.oldest_new = oldest if self.oldest_new is None else min(self.oldest_new, oldest)


class ReplayBuffer:
    """One shard per draft expert, so experts are fed and trained separately."""

    def __init__(self, cfg: BufferConfig | None = None, on_drop=None):
        self.cfg = cfg or BufferConfig()
        self._rng = random.Random(self.cfg.seed)
        self.on_drop = on_drop
        self.shards: dict[str, Shard] = {}

    def shard(self, expert: str) -> Shard:
        if expert not in self.shards:
            self.shards[expert] = Shard(self.cfg, self._rng, self.on_drop)
        return self.shards[expert]

    def add(self, rec: ReplayRecord, now: float | None = None) -> bool:
        return self.shard(rec.expert).add(rec, now)

    def reconfigure(self, cfg: BufferConfig) -> None:
        """New bounds and triggers for every shard (a redeploy with a changed config); a smaller
        max_bytes drops records now, as the eviction policy would."""
        self.cfg = cfg
        for s in self.shards.values():
            s.cfg = cfg
            s.shrink(cfg.max_bytes)

    def due(self, now: float | None = None) -> dict[str, str]:
        """expert -> trigger ('size' or 'age') for every shard whose update is due."""
        return {e: why for e, s in self.shards.items() if (why := s.due(now))}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())


class Backoff:
    """Per expert, after n failed updates in a row: no retry for base * 2**(n-1) s, at most cap. A failed
    update leaves its trigger due (Shard.rearm), so without this a fault that repeats (an OOM) would train
    and fail every poll on the cores serving needs; per expert, so one failing expert neither delays the
    others' updates nor has its own wait reset by their successes."""

    def __init__(self, base_s: float = 5.0, cap_s: float = 300.0, clock=time.monotonic):
        self.base_s, self.cap_s, self.clock = base_s, cap_s, clock
        self._fails: dict[str, tuple[int, float]] = {}  # expert -> (failures in a row, no retry before)

    def ready(self, expert: str) -> bool:
        return self.clock() >= self._fails.get(expert, (0, 0.0))[1]

    def failed(self, expert: str) -> float:
        """Records a failure; returns the seconds until the next try."""
        n = self._fails.get(expert, (0, 0.0))[0] + 1
        wait = min(self.base_s * 2 ** (n - 1), self.cap_s)
        self._fails[expert] = (n, self.clock() + wait)
        return wait

    def succeeded(self, expert: str) -> None:
        self._fails.pop(expert, None)
