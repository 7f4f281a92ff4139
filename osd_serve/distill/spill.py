"""Replay records on disk, so that a replay buffer whose process dies (an OOM kill, a lost node) comes
back with the records it held instead of empty: they took real traffic to collect, and with the
buffer's byte bound they are up to ``buffer_mb`` of it per expert.

Layout under ``root`` (the application's ``versions_dir/<app>/.replay``; no expert name starts with a dot):
    pair.json                          ["target", "draft"]: the pair whose token ids and distributions these are
    <expert>/state.json                {"finished": the newest seq a finished update took, "seen": records offered}
    <expert>/000000000042.safetensors  one record: its tensors, and its wall-clock creation time as metadata
    <expert>/000000000043.g.safetensors  one guard sample (ReplayRecord.heldout); renamed without ".g" once retired

A record is one file, written under a temporary name and renamed into place: a killed process leaves the
whole record or none. No fsync per record (it would cost each request a disk flush); a file a machine's
crash left unreadable is skipped and removed when read back. Only safetensors: nothing here is unpickled.
Sequence numbers are one counter over all experts, so "records newer than the last finished update" is a
comparison, and the trigger count a restart needs is read from the files, not saved at every record.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .replay import ReplayRecord

logger = logging.getLogger(__name__)
_FIELDS = ("prompt_ids", "response_ids", "positions", "probs", "topk_ids", "rest_mass")
_GUARD, _SUFFIX = ".g", ".safetensors"


@dataclass
class Spilled:
    """One record read back: its sequence number, the record, and when it was created (wall clock)."""

    seq: int
    record: ReplayRecord
    wall: float


def _replace_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class RecordSpill:
    """The files of one replay buffer. Every method that writes returns quietly on an OSError (a full or
    read-only disk), logging it once: the record stays in memory, and serving never fails for it."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(os.path.expanduser(root))
        self._warned = False

    def _path(self, expert: str, seq: int, heldout: bool) -> Path:
        return self.root / expert / f"{seq:012d}{_GUARD if heldout else ''}{_SUFFIX}"

    def _failed(self, what: str, e: Exception) -> None:
        if not self._warned:
            logger.warning("replay buffer: could not %s under %s (%r); records are kept in memory only, and a "
                           "restart of the buffer loses those (warned once)", what, self.root, e)
            self._warned = True

    def pair(self) -> list[str] | None:
        try:
            return json.loads((self.root / "pair.json").read_text())
        except (OSError, ValueError):
            return None

    def reset(self, pair: list[str] | None) -> None:
        """Remove every record (they belong to another pair) and name the pair the next ones belong to."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for d in self.root.iterdir():
                if d.is_dir():
                    shutil.rmtree(d)
            if pair is not None:
                _replace_json(self.root / "pair.json", list(pair))
        except OSError as e:
            self._failed("reset its records", e)

    def save(self, seq: int, expert: str, rec: ReplayRecord) -> bool:
        path = self._path(expert, seq, rec.heldout)
        tensors = {k: t.contiguous() for k in _FIELDS if (t := getattr(rec, k)) is not None}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            save_file(tensors, str(tmp), metadata={"wall": repr(time.time())})
            os.replace(tmp, path)
            return True
        except Exception as e:  # noqa: BLE001  a full disk, or a record of an unexpected shape: never fail add()
            self._failed("write a record", e)
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
            _replace_json(self.root / expert / "state.json", {"finished": seq, "seen": seen})
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
        """The expert's records, oldest first. An unreadable file (a crash mid-write on a machine that lost
        its page cache) is removed and logged, not fatal: the rest still come back."""
        out = []
        for tmp in (self.root / expert).glob(".*.tmp"):  # a write the process was killed in
            tmp.unlink(missing_ok=True)
        for path in sorted((self.root / expert).glob(f"*{_SUFFIX}")):
            stem = path.name[: -len(_SUFFIX)]
            heldout = stem.endswith(_GUARD)
            try:
                seq = int(stem[: -len(_GUARD)] if heldout else stem)
                with safe_open(str(path), "pt") as f:
                    t = {k: f.get_tensor(k) for k in f.keys()}
                    wall = float(f.metadata()["wall"])
                rec = ReplayRecord(*(t[k] for k in _FIELDS[:4]), t.get("topk_ids"), t.get("rest_mass"), expert,
                                   heldout=heldout)
                out.append(Spilled(seq, rec, wall))
            except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
                logger.warning("replay buffer: %s is not a readable record (%r); removed", path, e)
                path.unlink(missing_ok=True)
        return sorted(out, key=lambda s: s.seq)


def restore(spill: RecordSpill, buffer, make_ref) -> tuple[int, int]:
    """Read every expert's records back into ``buffer`` (a replay.ReplayBuffer), oldest first, through
    ``make_ref(spilled, created)``: what the buffer keeps of one (a record, or the Ray buffer's ref to it,
    with ``.seq``). ``created`` is on this process's monotonic clock, from the wall-clock time saved, so the
    age trigger counts from when the record was made, not from the restart. Records newer than the expert's
    last finished update count toward its trigger again, as they did before the restart (and so do those
    of an update under way then: it died with the buffer). Returns (records kept, the next free seq)."""
    wall, mono, kept, next_seq = time.time(), time.monotonic(), 0, 0
    for expert in spill.experts():
        state, shard = spill.state(expert), buffer.shard(expert)
        for s in spill.load(expert):
            created = mono - max(0.0, wall - s.wall)
            shard.add(make_ref(s, created), now=created)
            next_seq = max(next_seq, s.seq + 1)
        next_seq = max(next_seq, state["finished"] + 1)
        new = [r for r in shard.records if r.seq > state["finished"]]
        shard.new_since_update, shard.oldest_new = len(new), min((r.created for r in new), default=None)
        shard.seen = max(shard.seen, state["seen"])
        kept += len(shard.records)
    return kept, next_seq
