"""Replay records on disk, so that a replay buffer whose process dies (an OOM kill, a lost node) comes
back with the records it held instead of empty: they took real traffic to collect, and with the
buffer's byte bound they are up to ``buffer_mb`` of it per expert.

Layout under ``root`` (the application's ``versions_dir/<app>/.replay``; no expert name starts with a dot):
    .pair.json                         ["target", "draft"]: the pair whose token ids and distributions these are
    <expert>/state.json                {"finished": the newest seq a finished update took, "seen": records offered}
    <expert>/000000000042.safetensors  one record: its tensors; its wall-clock creation time and rid as metadata
    <expert>/000000000043.g.safetensors  one guard sample (ReplayRecord.heldout); renamed without ".g" once retired

A record is one file, written under a temporary name and renamed into place: a killed process leaves the
whole record or none. No fsync per record (it would cost each request a disk flush); a file a machine's
crash left unreadable is skipped and removed when read back. The writes run on a thread of their own
(SpillWriter), so the buffer's calls never wait on a disk; a process killed loses the writes still queued,
the records of its last moments. Only safetensors: nothing here is unpickled.
Sequence numbers are one counter over all experts, so "records newer than the last finished update" is a
comparison, and the trigger count a restart needs is read from the files, not saved at every record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .joblog import replace_json
from .replay import ReplayRecord

logger = logging.getLogger(__name__)
_FIELDS = ("prompt_ids", "response_ids", "positions", "probs", "topk_ids", "rest_mass")
_GUARD, _SUFFIX = ".g", ".safetensors"
PAIR_FILE = ".pair.json"  # a dot: no expert's directory can be named so
SEQ_FILE = ".seq.json"  # {"next": n}: numbers below n may have been handed out (RecordSpill.reserve)


@dataclass
class Spilled:
    """One record read back: its sequence number, the record, and when it was created (wall clock)."""

    seq: int
    record: ReplayRecord
    wall: float


class RecordSpill:
    """The files of one replay buffer. Every method that writes returns quietly on an OSError (a full or
    read-only disk), logging it once: the record stays in memory, and serving never fails for it."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(os.path.expanduser(root))
        self._warned = self._reserve_warned = False

    def _path(self, expert: str, seq: int, heldout: bool) -> Path:
        return self.root / expert / f"{seq:012d}{_GUARD if heldout else ''}{_SUFFIX}"

    def _failed(self, what: str, e: Exception) -> None:
        if not self._warned:
            logger.warning("replay buffer: could not %s under %s (%r); records are kept in memory only, and a "
                           "restart of the buffer loses those (warned once)", what, self.root, e)
            self._warned = True

    def pair(self) -> list[str] | None:
        """None only when there is no pair file (nothing saved yet, or a reset under way); any other error
        raises: read as "no pair", a passing one on a shared disk had every record removed at configure()."""
        try:
            return json.loads((self.root / PAIR_FILE).read_text())
        except FileNotFoundError:
            return None

    def reserved(self) -> int:
        """The first number no process of this buffer can have handed out (reserve); 0 if none was saved, or
        if what was is unreadable (a power loss after an unsynced rename): the numbers then go on from the
        files, as before reservations. Raising here would have every restart run without files, for good."""
        try:
            return int(json.loads((self.root / SEQ_FILE).read_text())["next"])
        except FileNotFoundError:
            return 0
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("replay buffer: %s is unreadable (%r); numbering goes on from the records' files",
                           self.root / SEQ_FILE, e)
            return 0

    def reserve(self, upto: int) -> bool:
        """Numbers below ``upto`` may be handed out. Written at once, not queued, and before any of them is:
        a window names its records by number (deployments/replay_actor.py), and a process killed before
        their files were written would otherwise hand the same numbers to other records after a restart.
        Whether it was written: if not, the caller tries again at its next number."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            replace_json(self.root / SEQ_FILE, {"next": upto})
            return True
        except OSError as e:
            if not self._reserve_warned:  # its own warning: a record's failed save may have used _failed's
                logger.warning("replay buffer: could not reserve record numbers under %s (%r); numbers a kill "
                               "loses may be given again after a restart (warned once)", self.root, e)
                self._reserve_warned = True
            return False

    def reset(self, pair: list[str] | None) -> None:
        """Remove every record (they belong to another pair) and name the pair the next ones belong to."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for d in self.root.iterdir():
                if d.is_dir():
                    shutil.rmtree(d)
            if pair is not None:
                replace_json(self.root / PAIR_FILE, list(pair))
        except OSError as e:
            self._failed("reset its records", e)

    def save(self, seq: int, expert: str, rec: ReplayRecord) -> bool:
        path = self._path(expert, seq, rec.heldout)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tensors = {k: t.contiguous() for k in _FIELDS if (t := getattr(rec, k)) is not None}
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata={"wall": repr(time.time()), "rid": getattr(rec, "rid", None) or ""})
            os.replace(tmp, path)
            return True
        except Exception as e:  # noqa: BLE001  a full disk, or a record of an unexpected shape: never fail add()
            self._failed("write a record", e)
            with contextlib.suppress(OSError):  # a full disk's half-written file, else one per record
                tmp.unlink(missing_ok=True)
            return False

    def drop(self, expert: str, seq: int) -> None:
        try:  # under either name: a guard sample whose retiring rename failed keeps its ".g"
            for heldout in (False, True):
                self._path(expert, seq, heldout).unlink(missing_ok=True)
        except OSError as e:
            self._failed("remove an evicted record", e)

    def unguard(self, expert: str, seq: int) -> None:
        """A guard sample that a published update trained on is an ordinary record (guard.retire_guard_samples):
        read back as a guard sample, the guard would score drafts on data they fitted."""
        try:
            os.replace(self._path(expert, seq, True), self._path(expert, seq, False))
        except FileNotFoundError:
            pass  # never written (a failed save), or evicted meanwhile
        except OSError as e:
            self._failed("retire a guard sample", e)

    def finished(self, expert: str, seq: int, seen: int) -> None:
        """An update that took the records up to ``seq`` finished: they no longer count toward the trigger."""
        try:
            (self.root / expert).mkdir(parents=True, exist_ok=True)
            replace_json(self.root / expert / "state.json", {"finished": seq, "seen": seen})
        except OSError as e:
            self._failed("save the trigger state", e)

    def state(self, expert: str) -> dict:
        try:
            s = json.loads((self.root / expert / "state.json").read_text())
            return {"finished": int(s["finished"]), "seen": int(s["seen"])}
        except (OSError, ValueError, KeyError, TypeError):
            return {"finished": -1, "seen": 0}

    def experts(self) -> list[str]:
        try:
            return sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        except OSError:
            return []

    def load(self, expert: str) -> list[Spilled]:
        """The expert's records, oldest first. A file of no record (a crash mid-write on a machine that lost
        its page cache) is removed and logged, not fatal: the rest still come back. A disk error raises."""
        out = []
        for tmp in (self.root / expert).glob(".*.tmp"):  # a write the process was killed in
            with contextlib.suppress(OSError):  # a read-only disk: the records still come back
                tmp.unlink(missing_ok=True)
        for path in sorted((self.root / expert).glob(f"*{_SUFFIX}")):
            stem = path.name[: -len(_SUFFIX)]
            heldout = stem.endswith(_GUARD)
            try:
                seq = int(stem[: -len(_GUARD)] if heldout else stem)
                with safe_open(str(path), "pt") as f:
                    t = {k: f.get_tensor(k) for k in f.keys()}
                    meta = f.metadata()
                wall = float(meta["wall"])
                rec = ReplayRecord(*(t[k] for k in _FIELDS[:4]), t.get("topk_ids"), t.get("rest_mass"), expert,
                                   heldout=heldout)
                rec.rid = meta.get("rid") or rec.rid  # an older osd-serve's file has none: a fresh one
                out.append(Spilled(seq, rec, wall))
            except (ValueError, KeyError, TypeError, SafetensorError) as e:  # not an OSError: that may pass
                logger.warning("replay buffer: %s is not a readable record (%r); removed", path, e)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        return sorted(out, key=lambda s: s.seq)


def count_new(shard, finished: int) -> None:
    """The shard's trigger window from its records' seqs: those newer than the last finished update."""
    new = [r for r in shard.records if r.seq > finished]
    shard.new_since_update, shard.oldest_new = len(new), min((r.created for r in new), default=None)


def as_kept(s: Spilled, created: float) -> ReplayRecord:
    """restore()'s make_ref for a buffer that keeps the records themselves (the local backend's)."""
    s.record.created, s.record.seq = created, s.seq
    return s.record


def restore(spill: RecordSpill, buffer, make_ref, only: str | None = None) -> tuple[int, int]:
    """Read every expert's records back into ``buffer`` (a replay.ReplayBuffer), oldest first, through
    ``make_ref(spilled, created)``: what the buffer keeps of one (a record, or the Ray buffer's ref to it,
    with ``.seq``). ``created`` is on this process's monotonic clock, from the wall-clock time saved, so the
    age trigger counts from when the record was made, not from the restart. Records newer than the expert's
    last finished update count toward its trigger again, as they did before the restart (and so do those
    of an update under way then: it died with the buffer). A record the buffer refuses loses its file.
    only: that expert's records alone (the local backend has a buffer per expert).
    Returns (records kept, the next free seq)."""
    wall, mono, kept, next_seq = time.time(), time.monotonic(), 0, 0
    for expert in [only] if only is not None else spill.experts():
        state, shard = spill.state(expert), buffer.shard(expert)
        for s in spill.load(expert):
            created = mono - max(0.0, wall - s.wall)
            if not shard.add(make_ref(s, created), now=created):
                spill.drop(expert, s.seq)
            next_seq = max(next_seq, s.seq + 1)
        next_seq = max(next_seq, state["finished"] + 1)
        count_new(shard, state["finished"])
        shard.seen = max(shard.seen, state["seen"])
        kept += len(shard.records)
    return kept, next_seq


class SpillWriter:
    """A RecordSpill's writes on a thread of their own, in the order they were asked for: the buffer actor
    has one thread for add, due and take, which would otherwise wait on the disk at every record (several
    round trips each on the shared storage versions_dir must be for a cluster). The queue holds each record
    until it is written: past MAX_BACKLOG_BYTES of them, new records are not saved (kept in memory only,
    warned once), and a record dropped while queued is not written at all."""

    MAX_BACKLOG_BYTES = 256 << 20

    def __init__(self, spill: RecordSpill):
        self.disk = spill
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0  # bytes of the records queued
        self._dropped: set[tuple[str, int]] = set()  # (expert, seq) dropped while its save was queued
        self._warned = False
        self._closed = False  # close(): what is still queued is skipped
        self._state = threading.Lock()  # _closed and the end marker against _put
        self._then = None  # close(then=...): called on this thread as it stops
        self._thread = threading.Thread(target=self._run, name="osd-replay-spill", daemon=True)
        self._thread.start()

    def _put(self, fn, *args) -> bool:
        with self._state:  # not after close()'s end marker: a put there is never done, and flush() would hang
            if self._closed:
                return False
            self._q.put((fn, args))
            return True

    def _run(self) -> None:
        while True:
            fn, args = self._q.get()
            try:
                if fn is None:  # close(): the thread ends, and lets the caller know (also if that raises)
                    try:
                        if self._then is not None:
                            self._then()
                    except Exception as e:  # noqa: BLE001
                        logger.warning("replay buffer: closing %s: %r", self.disk.root, e)
                    return
                if not self._closed:
                    fn(*args)
            except Exception as e:  # noqa: BLE001  the methods log their own OSErrors; this thread must live on
                logger.warning("replay buffer: %s failed: %r", getattr(fn, "__name__", fn), e)
            finally:
                self._q.task_done()

    def save(self, seq: int, expert: str, rec) -> bool:
        with self._lock:
            if self._queued + rec.nbytes > self.MAX_BACKLOG_BYTES:
                if not self._warned:
                    logger.warning("replay buffer: %d MiB of records queued for %s; new ones are kept in memory "
                                   "only until it drains (warned once)", self._queued >> 20, self.disk.root)
                    self._warned = True
                return False
            self._queued += rec.nbytes
        if self._put(self._save, seq, expert, rec):
            return True
        with self._lock:  # closed meanwhile
            self._queued -= rec.nbytes
        return False

    def _save(self, seq: int, expert: str, rec) -> None:
        try:
            if (expert, seq) not in self._dropped:
                self.disk.save(seq, expert, rec)
        finally:
            with self._lock:
                self._queued -= rec.nbytes

    # queued behind the saves before them, so a record's file is never removed before it is written
    def drop(self, expert: str, seq: int) -> None:
        self._dropped.add((expert, seq))
        self._put(self._drop, expert, seq)

    def _drop(self, expert: str, seq: int) -> None:
        self._dropped.discard((expert, seq))
        self.disk.drop(expert, seq)

    def unguard(self, expert: str, seq: int) -> None:
        self._put(self.disk.unguard, expert, seq)

    def finished(self, expert: str, seq: int, seen: int) -> None:
        self._put(self.disk.finished, expert, seq, seen)

    def reset(self, pair: list[str] | None) -> None:
        self._put(self.disk.reset, pair)

    def flush(self) -> None:
        """Wait until every write asked for so far is done (tests; a clean shutdown)."""
        self._q.join()

    def close(self, timeout_s: float = 10.0, then=None) -> bool:
        """Do the writes asked for so far, for up to ``timeout_s``, then skip the rest; ``then()`` is called as
        the thread stops, so after a write still under way at the timeout (a hung disk), never before: a replica
        lets its versions slot go there, and the next one to take it must not meet this one's writes landing.
        Whether all were done. A second call changes nothing, and cannot take a ``then``: the thread may be gone."""
        if self._closed:
            if then is not None:
                raise RuntimeError("SpillWriter.close(then=...) on a writer already closed")
            return not self._thread.is_alive()
        done = threading.Event()
        self._put(done.set)
        ok = done.wait(timeout_s)
        with self._state:
            self._then, self._closed = then, True
            self._q.put((None, ()))
        self._thread.join(timeout=1.0 if ok else 0.0)  # at once, unless a write hangs
        if not ok:
            logger.warning("replay buffer: %d writes still queued for %s after %g s are dropped",
                           self._q.qsize(), self.disk.root, timeout_s)
        return ok


def pair_of(cfg) -> list[str]:
    """[target, draft] of an AppConfig as configured, as a buffer tells one pair's records from another's.
    Not the resolved paths: the embedded default pair's differ from node to node (each builds its own
    under its HOME), and replicas of one pair would wipe each other's records."""
    return [cfg.target or "embedded default", cfg.draft or "embedded default"]


class ReplicaSpill:
    """The local backend's records as files (distill.backend: local): every expert's of one SpecService
    replica, under its versions slot (versions.claim_slot), so the replica that takes the slot over after
    a crash resumes with them, not empty. The slot's lock makes the files this process's alone: no other
    process's update can finish or put back a window over them, as one can at the Ray buffer actor's.
    Each method is called under the expert's distiller lock (online.py), which orders a record's seq
    against the mark an update takes."""

    def __init__(self, root: str | os.PathLike, pair: list[str]):
        self.pair = list(pair)  # also in the versions this replica publishes (siblings.py)
        self.writer = SpillWriter(RecordSpill(root))
        self._lock = threading.Lock()  # the seq counter is one over all experts, whose distillers run apart
        self._next = 0
        self.on = True  # False: a read-back failed; records are kept in memory only, their files left alone
        disk = self.writer.disk
        try:
            if (was := disk.pair()) != list(pair):
                if was is not None:
                    logger.warning("replay buffer: the pair changed from %s to %s; the records under %s are dropped",
                                   was, pair, disk.root)
                disk.reset(list(pair))  # at once, not queued: restore() must find no other pair's records
        except Exception as e:  # noqa: BLE001  as a read-back that fails: serve, in memory only
            self._off(e)

    def _off(self, e: Exception) -> None:
        logger.warning("replay buffer: reading records back from %s failed (%r); writing no records there until "
                       "the replica restarts", self.writer.disk.root, e)
        self.on = False

    def keep_only(self, experts: list[str]) -> None:
        """Remove the records of experts not configured (a redeploy dropped them): nothing would read them
        back, and they would stay on disk for good."""
        disk = self.writer.disk
        for gone in sorted(set(disk.experts()) - set(experts)) if self.on else []:
            try:
                shutil.rmtree(disk.root / gone)
                logger.warning("replay buffer: expert %r is not configured; its records under %s are removed",
                               gone, disk.root)
            except OSError as e:
                disk._failed(f"remove the records of {gone!r}", e)

    def restore(self, expert: str, buffer) -> int:
        """The expert's records read back into its buffer (whose on_drop is ``dropped``); how many were kept."""
        if not self.on:
            return 0
        try:
            kept, next_seq = restore(self.writer.disk, buffer, as_kept, only=expert)
        except Exception as e:  # noqa: BLE001  the files stay for the next replica; this one starts empty
            self._off(e)
            buffer.shards.pop(expert, None)
            return 0
        with self._lock:
            self._next = max(self._next, next_seq)
        if kept:
            logger.warning("replay buffer: %d records of %s read back from %s", kept, expert, self.writer.disk.root)
        return kept

    def kept(self, rec: ReplayRecord) -> None:
        with self._lock:
            rec.seq, self._next = self._next, self._next + 1
        if self.on:
            self.writer.save(rec.seq, rec.expert, rec)

    def mark(self) -> int:
        """The newest seq given so far: an update taking the shard now takes every record of its up to here."""
        with self._lock:
            return self._next - 1

    def dropped(self, rec: ReplayRecord) -> None:
        if self.on and rec.seq >= 0:
            self.writer.drop(rec.expert, rec.seq)

    def retired(self, records: list) -> None:
        """Before guard.retire_guard_samples(records): the guard samples' files become ordinary records'."""
        for r in records:
            if self.on and r.heldout and r.seq >= 0:
                self.writer.unguard(r.expert, r.seq)

    def finished(self, expert: str, mark: int, seen: int) -> None:
        if self.on:
            self.writer.finished(expert, mark, seen)

    def close(self, timeout_s: float = 10.0, then=None) -> None:
        self.writer.close(timeout_s, then)
