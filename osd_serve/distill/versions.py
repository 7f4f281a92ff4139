"""Draft versions on disk: every published update is a new version, written atomically.

Layout under ``root``:
    v000003/draft.safetensors   serving weights (names of the draft's state_dict; LoRA merged)
    v000003/adapter/            LoRA mode: the peft adapter (adapter_model.safetensors)
    v000003/meta.json           guard numbers, losses, trigger, time
    manifest.json               {"current": 3, "versions": [1, 2, 3]}
A version directory is written under a temporary name and renamed into place, and the manifest is
replaced with os.replace, so a crash leaves either the old state or the new one, never a half.
Only safetensors: nothing here is ever unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class VersionStore:
    def __init__(self, root: str | os.PathLike, keep_last: int = 5):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        m = self.root / "manifest.json"
        self.manifest = json.loads(m.read_text()) if m.exists() else {"current": None, "versions": []}

    def refresh(self) -> int | None:
        """Re-read the manifest (another process may have published); returns the current version."""
        m = self.root / "manifest.json"
        if m.exists():
            self.manifest = json.loads(m.read_text())
        return self.current

    @property
    def current(self) -> int | None:
        return self.manifest["current"]

    @property
    def versions(self) -> list[int]:
        return list(self.manifest["versions"])

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def _write_manifest(self) -> None:
        tmp = self.root / f".manifest-{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=2))
        os.replace(tmp, self.root / "manifest.json")

    def publish(self, state: dict[str, torch.Tensor], meta: dict | None = None, adapter_writer=None) -> int:
        """Write a new version and make it current; returns its number. adapter_writer(dir), if
        given, writes the LoRA adapter into the version's adapter/ folder."""
        version = max(self.manifest["versions"], default=-1) + 1
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-v", dir=self.root))
        try:
            save_file({n: t.detach().cpu().contiguous() for n, t in state.items()}, str(tmp / "draft.safetensors"))
            if adapter_writer is not None:
                adapter_writer(str(tmp / "adapter"))
            (tmp / "meta.json").write_text(json.dumps({"version": version, "time": time.time(), **(meta or {})}, indent=2, default=str))
            os.replace(tmp, self.path(version))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.manifest["versions"].append(version)
        self.manifest["current"] = version
        self._prune()
        self._write_manifest()
        return version

    def _prune(self) -> None:
        keep = self.manifest["versions"][-self.keep_last :]
        for v in self.manifest["versions"][: -self.keep_last]:
            shutil.rmtree(self.path(v), ignore_errors=True)
        self.manifest["versions"] = keep

    def load(self, version: int | None = None) -> dict[str, torch.Tensor]:
        version = self.current if version is None else version
        if version not in self.manifest["versions"]:
            raise KeyError(f"draft version {version} is not kept (kept: {self.manifest['versions']})")
        return load_file(str(self.path(version) / "draft.safetensors"))

    def rollback(self, to: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Make an older kept version current (default: the one before current); returns it and its weights."""
        vs = self.manifest["versions"]
        if to is None:
            i = vs.index(self.current)
            if i == 0:
                raise ValueError("no older version to roll back to")
            to = vs[i - 1]
        state = self.load(to)
        self.manifest["current"] = to
        self._write_manifest()
        return to, state

    def meta(self, version: int) -> dict:
        return json.loads((self.path(version) / "meta.json").read_text())


class VersionWatcher:
    """Hot-swap for drafts trained elsewhere: polls each expert's VersionStore under ``root`` and calls
    ``apply(expert, state, version)`` when another process (the cluster distiller) publishes.

    Used by the colocated SpecServer and the disaggregated DraftPool when distill.backend is ray_train.
    A version being pruned as it is read is skipped, and picked up at the next poll.
    """

    def __init__(self, root: str | os.PathLike, apply, poll_s: float = 2.0, on_swap=None):
        self.root, self.apply, self.poll_s, self.on_swap = Path(root), apply, poll_s, on_swap
        self.stores: dict[str, VersionStore] = {}
        self.serving: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, expert: str, initial_state) -> tuple[int, dict | None]:
        """Start watching an expert. initial_state: a callable returning its draft's state dict as
        configured, published as version 0 if the store is empty. Returns (version to serve, its state
        to load now, or None when it is the initial draft itself); the caller loads it, on its own thread."""
        store = VersionStore(self.root / expert)
        state = None
        if store.refresh() is None:
            store.publish({n: t.clone() for n, t in initial_state().items()}, {"reason": "initial draft"})
        else:  # a restart, or a replica added later: serve what the store says the others serve
            state = store.load()
        with self._lock:
            self.stores[expert], self.serving[expert] = store, store.current
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="osd-version-watch", daemon=True)
                self._thread.start()
        return store.current, state

    def poll(self) -> None:
        with self._lock:
            items = list(self.stores.items())
        for expert, store in items:
            try:
                v = store.refresh()
                if v is not None and v != self.serving.get(expert):
                    self.apply(expert, store.load(v), v)
                    self.serving[expert] = v
                    if self.on_swap is not None:
                        self.on_swap(expert, v)
            except (OSError, ValueError, KeyError):
                continue

    def rollback(self, expert: str, to: int | None = None) -> int:
        """Make an older kept version current in the shared store; every watcher (this one at its next
        poll) swaps it in, and the cluster distiller trains on from it."""
        return self.stores[expert].rollback(to)[0]

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
