"""The distill controller's job history, kept on disk as well as in memory.

The controller is a detached Ray actor that Ray restarts when its process dies (an OOM while it
guards, its node, an operator's kill). A restart ran ``__init__`` again with an empty history, so
``/admin/experts`` showed no job at all, not even the ones before the death, and nothing said a
restart had happened. Each event is now also one line of a JSON-lines file beside the controller's
settings, read back at start. The file is bounded: past twice ``keep`` lines it is rewritten with the
newest ``keep``. No library keeps a bounded, append-only, crash-tolerant event list, so this does.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class JobLog:
    """A bounded list of JSON-able events (dicts), newest last, mirrored to ``path``.

    A line a crash cut short, or any line that is not a JSON object, is skipped when read back. Disk
    errors are warned of once and never raised: the history is for operators, and losing it must not
    stop the controller training."""

    def __init__(self, path: str | os.PathLike, keep: int):
        self.path, self.keep = Path(path), keep
        self._warned = False
        self.events: collections.deque[dict] = collections.deque(self._read(), maxlen=keep)
        self._lines = len(self.events)  # in the file, after _read's rewrite (or none)

    def _read(self) -> list[dict]:
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []
        except OSError as e:
            logger.warning("job history %s unreadable (%s): starting empty", self.path, e)
            return []
        events = []
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                events.append(ev)
        events = events[-self.keep :]
        if len(lines) != len(events):  # cut lines or a long file: only what is kept stays on disk
            self._rewrite(events)
        return events

    def append(self, event: dict) -> None:
        self.events.append(event)
        try:
            if self._lines >= 2 * self.keep:
                self._rewrite(list(self.events))
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(event, default=str) + "\n")
                self._lines += 1
        except OSError as e:
            self._warn(e)

    def extend(self, events) -> None:
        for ev in events:
            self.append(ev)

    def _rewrite(self, events: list[dict]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            tmp.write_text("".join(json.dumps(ev, default=str) + "\n" for ev in events), encoding="utf-8")
            os.replace(tmp, self.path)  # a crash leaves the old file or the new one, never half of it
            self._lines = len(events)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._warn(e)

    def _warn(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("job history %s: not saved (%s); a restarted controller will not show these jobs", self.path, e)

    def __iter__(self):
        return iter(list(self.events))  # a snapshot: the controller's loop appends from its own thread

    def __len__(self) -> int:
        return len(self.events)


def json_safe(obj):
    """obj with every non-finite float as None (JSON has no NaN: a route's encoder answered 500 on a guard's
    NaN score)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def replace_json(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, written beside it and renamed over it: a crash leaves the old file or the
    new one, never half of either. The temporary file is removed if writing fails (a full disk: not one
    more file per try). Raises OSError; callers decide whether that is worth more than a warning."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
