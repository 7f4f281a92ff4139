"""The replay buffer actor of an application's distillation (deployments/distiller.py): records go into
Ray's object store, put there by this actor so that it owns them (a replica that goes away does not take
its records along), and it keeps only their refs and byte sizes under the core ReplayBuffer's bound,
triggers and eviction. Each record is also a file (osd_serve/distill/spill.py), so a restart of this
actor reads back the records it held."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import ray

from osd_serve.distill.guard import retire_guard_samples
from osd_serve.distill.replay import BufferConfig, ReplayBuffer
from osd_serve.distill.spill import RecordSpill, restore

logger = logging.getLogger("ray.serve")


@dataclass
class RecordRef:
    """What the buffer keeps per record: the object ref and what eviction needs."""

    ref: list  # [ObjectRef] (wrapped in a list so Ray never resolves it on the way in)
    nbytes: int
    expert: str
    heldout: bool = False  # a guard sample (ReplayRecord.heldout)
    created: float = field(default_factory=time.monotonic)
    seq: int = -1  # its file's number (spill.py), -1 when it has none


class _ReplayBufferActor:
    """pair: [target, draft] of the application's config. Records hold the pair's token ids and target
    distributions, which would train another pair's draft to fit a model it does not serve with."""

    def __init__(self, cfg: dict, spill_dir: str | None = None):
        # Records are also files (spill.py): a restart (max_restarts) re-runs this and reads them back, with
        # the pair they belong to, instead of starting empty. None: in memory only (an older connect).
        self.spill = RecordSpill(spill_dir) if spill_dir else None
        self.buffer = self._new_buffer(cfg)
        # No pair until configure() (connect calls it at once), or the one the records read back belong to:
        # a creation pair would refuse every record of the pair a redeploy has moved to, silently.
        self.pair: list[str] | None = self.spill.pair() if self.spill else None
        self.configured = False  # the restart's cfg is its creation's: the controller's poll brings the current
        # expert -> the trigger window a job took and has not finished or put back (rearm), and the newest seq in
        # it. A controller killed mid-job does neither: its restart puts it back (rearm_taken).
        self.taken: dict[str, tuple] = {}
        self.marks: dict[str, int] = {}
        self.seq = 0
        if self.pair is not None:
            kept, self.seq = restore(self.spill, self.buffer, lambda s, created: RecordRef(
                [ray.put(s.record)], s.record.nbytes, s.record.expert, s.record.heldout, created, s.seq))
            logger.warning("replay buffer: %d records read back from %s", kept, self.spill.root)

    def _new_buffer(self, cfg: dict) -> ReplayBuffer:
        drop = (lambda r: r.seq >= 0 and self.spill.drop(r.expert, r.seq)) if self.spill else None
        return ReplayBuffer(BufferConfig(**cfg), on_drop=drop)

    def configure(self, cfg: dict, pair: list[str] | None = None) -> None:
        """The actor is detached and outlives the app: a redeploy brings its config here, and a
        redeploy onto another pair empties the buffer, and its files."""
        if self._another_pair(pair):
            logger.warning("replay buffer: the pair changed from %s to %s; its records are dropped", self.pair, pair)
            self.buffer, self.taken, self.marks = self._new_buffer(cfg), {}, {}
        else:
            self.buffer.reconfigure(BufferConfig(**cfg))
        self.pair = pair if pair is not None else self.pair
        self.configured = True
        if self.spill and pair is not None and self.spill.pair() != list(pair):
            self.spill.reset(pair)  # any files left are another pair's, or of no known pair

    def _another_pair(self, pair: list[str] | None) -> bool:
        """Whether ``pair`` names another pair than the buffer's (None on either side: no pair known)."""
        return pair is not None and self.pair is not None and list(pair) != list(self.pair)

    def add(self, expert: str, record, nbytes: int, pair: list[str] | None = None) -> bool:
        if self._another_pair(pair):
            return False  # from a replica of the pair before a redeploy, serving until the new ones are up
        # Put here, not by the sender: the object's owner is the process that put it, and the
        # buffer must own its records, or a replica that goes away would take its records along.
        ref = RecordRef([ray.put(record)], nbytes, expert, getattr(record, "heldout", False))
        if not self.buffer.add(ref):
            return False
        if self.spill and self.pair is not None and self.spill.save(self.seq, expert, record):
            ref.seq = self.seq  # one counter over all experts: take() marks the newest a job holds
        self.seq += 1
        return True

    def due(self, cfg: dict | None = None, pair: list[str] | None = None) -> dict[str, str]:
        """cfg, pair: the application's current ones (the controller's saved settings). A restart re-ran
        __init__ with its creation's config, and nothing configured it again until a replica started."""
        if cfg is not None and not self.configured:
            self.configure(cfg, pair)
        return self.buffer.due()

    def take(self, expert: str) -> tuple[list, list[bool], tuple]:
        """All refs of the expert's shard, oldest first, which are guard samples, and the trigger window
        this closes (a new one starts; ``rearm`` puts it back if the job fails)."""
        shard = self.buffer.shard(expert)
        if expert in self.taken:  # taken by a job never finished (its controller killed): this window holds it too
            shard.rearm(self.taken.pop(expert))
        window = self.taken[expert] = shard.mark_updated()
        self.marks[expert] = self.seq - 1
        return [r.ref[0] for r in shard.records], [r.heldout for r in shard.records], window

    def finish(self, expert: str) -> None:  # the job that took the window ended: published, refused or skipped
        self.taken.pop(expert, None)
        if (mark := self.marks.pop(expert, None)) is not None and self.spill:
            self.spill.finished(expert, mark, self.buffer.shard(expert).seen)

    def rearm(self, expert: str, window: tuple) -> None:
        self.taken.pop(expert, None)
        self.marks.pop(expert, None)
        self.buffer.shard(expert).rearm(window)

    def rearm_taken(self) -> dict[str, int]:
        """Put back every window still taken: called by a controller as it starts, when no job of its can be
        running, so these are its former incarnation's, killed mid-job. Returns expert -> records put back."""
        taken, self.taken, self.marks = self.taken, {}, {}
        for expert, window in taken.items():
            self.buffer.shard(expert).rearm(window)
        return {expert: window[0] for expert, window in taken.items()}

    def retire(self, expert: str, refs: list) -> None:
        """refs: guard samples an update trained on and published (guard.retire_guard_samples)."""
        trained = set(refs)
        retired = [r for r in self.buffer.shard(expert).records if r.ref[0] in trained]
        for r in retired:
            if self.spill and r.heldout and r.seq >= 0:
                self.spill.unguard(expert, r.seq)
        retire_guard_samples(retired)

    def stats(self) -> dict:
        return {e: {"records": len(s.records), "bytes": s.nbytes, "seen": s.seen} for e, s in self.buffer.shards.items()}


# Not decorated in place: importable by their own names, the classes are pickled by reference. By value
# (the name held the actor class), unpickling rewrote the class's methods here, with their own globals.
ReplayBufferActor = ray.remote(num_cpus=0)(_ReplayBufferActor)
