"""The replay buffer actor of an application's distillation (deployments/distiller.py): records go into
Ray's object store, put there by this actor so that it owns them (a replica that goes away does not take
its records along), and it keeps only their refs and byte sizes under the core ReplayBuffer's bound,
triggers and eviction. Each record is also a file (osd_serve/distill/spill.py), so a restart of this
actor reads back the records it held."""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import ray

from osd_serve.distill.guard import retire_guard_samples
from osd_serve.distill.replay import BufferConfig, ReplayBuffer
from osd_serve.distill.spill import RecordSpill, SpillWriter, count_new, restore

logger = logging.getLogger("ray.serve")
SEQ_BLOCK = 4096  # record numbers reserved on disk at a time
RIDS_KEPT = 1 << 16  # the newest records' ids known (~10 MB): a retried add() arrives within seconds of the first


@dataclass
class RecordRef:
    """What the buffer keeps per record: the object ref and what eviction needs."""

    ref: list  # [ObjectRef] (wrapped in a list so Ray never resolves it on the way in)
    nbytes: int
    expert: str
    heldout: bool = False  # a guard sample (ReplayRecord.heldout)
    created: float = field(default_factory=time.monotonic)
    seq: int = -1  # its number, set as it is kept: its file's name (spill.py), if the file was written
    rid: str | None = None  # ReplayRecord.rid


class _ReplayBufferActor:
    """pair: [target, draft] of the application's config. Records hold the pair's token ids and target
    distributions, which would train another pair's draft to fit a model it does not serve with."""

    def __init__(self, cfg: dict, spill_dir: str | None = None):
        # Records are also files (spill.py): a restart (max_restarts) re-runs this and reads them back, with
        # the pair they belong to, instead of starting empty. None: in memory only (an older connect).
        self.spill = SpillWriter(RecordSpill(spill_dir)) if spill_dir else None
        self.buffer = self._new_buffer(cfg)
        # No pair until configure() (connect calls it at once), or the one the records read back belong to:
        # a creation pair would refuse every record of the pair a redeploy has moved to, silently.
        self.pair: list[str] | None = None
        self.spilled_pair: list[str] | None = None  # the pair the files are of (not re-read: an NFS hiccup)
        self.configured = False  # the restart's cfg is its creation's: the controller's poll brings the current
        # expert -> the trigger window a job took and has not finished or put back (rearm), and the newest seq in
        # it. A controller killed mid-job does neither: its restart puts it back (rearm_taken).
        self.taken: dict[str, tuple] = {}
        self.marks: dict[str, int] = {}
        self.seq = 0  # the next record's file number, one counter over all experts
        self.reserved = 0  # numbers below it are reserved on disk (spill.RecordSpill.reserve), never handed out twice
        # A job's window names the process it was taken from: one of a former process's, put back or finished
        # here, is of records restore() counted already
        self.incarnation = uuid.uuid4().hex
        self.restored = False  # records read back: seqs go on from the former process's
        self.first_seq = 0  # the first this process numbered: lower ones are its former process's
        # ids (ReplayRecord.rid) of the newest records kept, read back ones included: Ray retries an add() whose
        # process died mid-call (max_task_retries) on the restarted one, which may have read its file back
        self.rids: OrderedDict[str, None] = OrderedDict()
        if self.spill:
            self._restore(cfg)

    def _restore(self, cfg: dict) -> None:
        disk = self.spill.disk
        try:
            self.seq = self.reserved = disk.reserved()  # past every number a former process handed out
            self.pair = self.spilled_pair = disk.pair()
            if self.pair is None:
                return
            # All of them until configure() brings the current bound: this is the creation's cfg, and a redeploy
            # may have raised buffer_mb since; evicting here would delete the files of records the current one keeps
            self.buffer = self._new_buffer({**cfg, "max_bytes": 1 << 62})
            kept, after = restore(disk, self.buffer, lambda s, created: RecordRef(
                [ray.put(s.record)], s.record.nbytes, s.record.expert, s.record.heldout, created, s.seq, s.record.rid))
            for r in sorted((r for sh in self.buffer.shards.values() for r in sh.records), key=lambda r: r.seq):
                self._known(r.rid)
            self.seq = self.reserved = max(self.seq, after)  # files of an older osd-serve reserved none
            held = max((sh.nbytes for sh in self.buffer.shards.values()), default=0)
            self.buffer.reconfigure(BufferConfig(**{**cfg, "max_bytes": max(cfg["max_bytes"], held)}))
            self.restored = True
            logger.warning("replay buffer: %d records read back from %s", kept, disk.root)
        except Exception as e:  # noqa: BLE001  a restart that raises is not retried: start rather than not at all
            # In memory only, the files left as they are: a passing error must not have them reset or overwritten
            logger.warning("replay buffer: reading records back from %s failed (%r); starting empty, and writing "
                           "no records there until the next restart", disk.root, e)
            self.spill, self.rids = None, OrderedDict()  # first: the new buffer's eviction hook reads it
            self.buffer, self.pair, self.spilled_pair, self.seq, self.reserved = self._new_buffer(cfg), None, None, 0, 0
        self.first_seq = self.seq

    def _new_buffer(self, cfg: dict) -> ReplayBuffer:
        drop = (lambda r: self.spill.drop(r.expert, r.seq)) if self.spill else None
        return ReplayBuffer(BufferConfig(**cfg), on_drop=drop)

    def configure(self, cfg: dict, pair: list[str] | None = None) -> None:
        """The actor is detached and outlives the app: a redeploy brings its config here, and a
        redeploy onto another pair empties the buffer, and its files."""
        if self._another_pair(pair):
            logger.warning("replay buffer: the pair changed from %s to %s; its records are dropped", self.pair, pair)
            self.buffer, self.taken, self.marks, self.rids = self._new_buffer(cfg), {}, {}, OrderedDict()
        else:
            self.buffer.reconfigure(BufferConfig(**cfg))
        self.pair = pair if pair is not None else self.pair
        self.configured = True
        if self.spill and pair is not None and list(pair) != self.spilled_pair:
            self.spill.reset(pair)  # any files left are another pair's, or of no known pair
            self.spilled_pair = list(pair)

    def _another_pair(self, pair: list[str] | None) -> bool:
        """Whether ``pair`` names another pair than the buffer's (None on either side: no pair known)."""
        return pair is not None and self.pair is not None and list(pair) != list(self.pair)

    def add(self, expert: str, record, nbytes: int, pair: list[str] | None = None) -> bool:
        if self._another_pair(pair):
            return False  # from a replica of the pair before a redeploy, serving until the new ones are up
        rid = getattr(record, "rid", None)  # None: a record pickled by an older osd-serve
        if rid is not None and rid in self.rids:
            return True  # a retry of an add() this buffer (or its former process) kept: kept once
        # Put here, not by the sender: the object's owner is the process that put it, and the
        # buffer must own its records, or a replica that goes away would take its records along.
        ref = RecordRef([ray.put(record)], nbytes, expert, getattr(record, "heldout", False), rid=rid)
        if not self.buffer.add(ref):
            return False
        self._known(rid)
        ref.seq = self.seq  # its file's name, if it gets one (a disk can refuse it)
        self.seq += 1
        if self.spill and self.spilled_pair is not None:
            if ref.seq >= self.reserved and self.spill.disk.reserve(ref.seq + SEQ_BLOCK):  # one write per block
                self.reserved = ref.seq + SEQ_BLOCK
            self.spill.save(ref.seq, expert, record)
        return True

    def _known(self, rid: str | None) -> None:
        if rid is not None:
            self.rids[rid] = None
            if len(self.rids) > RIDS_KEPT:
                self.rids.popitem(last=False)

    def due(self, cfg: dict | None = None, pair: list[str] | None = None) -> dict[str, str]:
        """cfg, pair: the application's current ones (the controller's saved settings). A restart re-ran
        __init__ with its creation's config, and nothing configured it again until a replica started."""
        if cfg is not None and not self.configured:
            self.configure(cfg, pair)
        return self.buffer.due()

    def take(self, expert: str) -> tuple[list, list[bool], tuple]:
        """All refs of the expert's shard, oldest first, which are guard samples, and the trigger window
        this closes (a new one starts; ``rearm`` puts it back if the job fails, ``finish`` ends it)."""
        shard = self.buffer.shard(expert)
        if expert in self.taken:  # taken by a job never finished (its controller killed): this window holds it too
            shard.rearm(self.taken.pop(expert))
        window = self.taken[expert] = shard.mark_updated()
        self.marks[expert] = self.seq - 1
        # The records' numbers close the window: a job that publishes after this process died retires its guard
        # samples by them (retire), as the restarted process holds the records under refs of its own
        records = shard.records
        return ([r.ref[0] for r in records], [r.heldout for r in records],
                (*window, self.incarnation, self.seq - 1, tuple(r.seq for r in records)))

    def _mine(self, window: tuple | None) -> bool:
        return window is None or len(window) < 4 or window[2] == self.incarnation

    def finish(self, expert: str, window: tuple | None = None) -> None:
        """The job that took the window ended: published, refused or skipped. Its records no longer count toward
        the trigger, also after a restart (spill.py's state.json), and also when this process is not the one
        it took them from: restore() counted them again, and that job trained on them all the same."""
        shard, mark = self.buffer.shard(expert), None
        if self._mine(window):
            self.taken.pop(expert, None)
            mark = self.marks.pop(expert, None)
        elif self.restored and expert not in self.taken:  # else started empty: what that job took is gone
            # Its mark can exceed what was written before the kill (writes still queued then): this process
            # numbered its own from there, and no job took those. A job of this process's covers the rest.
            mark = min(window[3], self.first_seq - 1)
            count_new(shard, mark)
        if mark is not None and self.spill:
            self.spill.finished(expert, mark, shard.seen)

    def rearm(self, expert: str, window: tuple) -> None:
        if not self._mine(window):
            return  # a failed job's window from this actor's former process: restore() counted its records already
        self.taken.pop(expert, None)
        self.marks.pop(expert, None)
        self.buffer.shard(expert).rearm(window[:2])

    def rearm_taken(self) -> dict[str, int]:
        """Put back every window still taken: called by a controller as it starts, when no job of its can be
        running, so these are its former incarnation's, killed mid-job. Returns expert -> records put back."""
        taken, self.taken, self.marks = self.taken, {}, {}
        for expert, window in taken.items():
            self.buffer.shard(expert).rearm(window)
        return {expert: window[0] for expert, window in taken.items()}

    def retire(self, expert: str, refs: list, seqs: list[int] | None = None, window: tuple | None = None) -> None:
        """refs: guard samples an update trained on and published (guard.retire_guard_samples); seqs: their
        numbers, and window: the one its job took. A window of a former process's names records whose refs this
        one never gave out: those it read back (numbered below first_seq) are retired by number."""
        records = self.buffer.shard(expert).records
        if seqs is None or self._mine(window):
            trained = set(refs)
            retired = [r for r in records if r.ref[0] in trained]
        else:  # started empty (not restored): what that job trained on is gone
            numbered = {s for s in seqs if s < self.first_seq} if self.restored else set()
            retired = [r for r in records if r.seq in numbered]
        for r in retired:
            if self.spill and r.heldout:
                self.spill.unguard(expert, r.seq)
        retire_guard_samples(retired)

    def flush(self) -> None:
        """Wait for the record files written so far (tests, and an operator before a planned kill)."""
        if self.spill:
            self.spill.flush()

    def stats(self) -> dict:
        return {e: {"records": len(s.records), "bytes": s.nbytes, "seen": s.seen, "new": s.new_since_update}
                for e, s in self.buffer.shards.items()}


# Not decorated in place: importable by their own names, the classes are pickled by reference. By value
# (the name held the actor class), unpickling rewrote the class's methods here, with their own globals.
ReplayBufferActor = ray.remote(num_cpus=0)(_ReplayBufferActor)
