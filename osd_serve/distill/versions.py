"""Draft versions on disk: every published update is a new version, written atomically.

Layout under ``root``:
    v000003/draft.safetensors   serving weights (names of the draft's state_dict; LoRA merged)
    v000003/adapter/            LoRA mode: the peft adapter (adapter_model.safetensors), a delta over
                                the weights of version meta["adapter_base_version"] (0, the draft as
                                configured, until a rollback puts a fresh LoRA on a later version)
    v000003/meta.json           guard numbers, losses, trigger, time
    manifest.json               {"current": 3, "versions": [1, 2, 3], "parents": {"3": 2, ...},
                                 "draft": the fingerprint of the draft version 0 was (draft_fingerprint)}
A replica's private stores live under versions_dir/replicas/slot-N/<expert>, a slot it holds by a
lock on slot-N/.owner while it lives (claim_slot).
A version's parent is the one current when it was published (what it was trained from): the
default rollback goes back to it, and pruning keeps it, as it keeps version 0.
A version directory is written under a temporary name and renamed into place, and the manifest is
replaced with os.replace, so a crash leaves either the old state or the new one, never a half.
Only safetensors: nothing here is ever unpickled.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)


def draft_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """Names, shapes and a few values of each tensor: tells one draft's weights from another's (a
    redeploy that changed the draft must not resume the old draft's versions) without hashing them all.
    Values are rounded to bfloat16 first, so one draft loaded in float32 and in bfloat16 (dtype auto
    on a CPU and on a GPU node) is the same draft: its versions load into either. A float16 load can
    round differently (fp16, then bf16) and read as another draft: its versions are then cleared."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().reshape(-1)  # [numel]
        ends = torch.cat([t[:32], t[-32:]]).cpu()  # [<= 64]
        if ends.is_floating_point():
            ends = ends.to(torch.bfloat16)
        h.update(f"{name}{tuple(state[name].shape)}".encode())
        h.update(ends.float().numpy().tobytes())
    return h.hexdigest()[:16]


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') writes to the device. Renames reach the journal
    before delayed-allocation data does: without this, a power loss just after a publish left the
    manifest naming a version whose draft.safetensors was empty, and a restart failed on it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """A directory's entries (a rename into it), best effort: some filesystems refuse a directory's
    fsync (EINVAL), and what it guards is durability only."""
    with contextlib.suppress(OSError):
        _fsync(path)


def claim_slot(root: str | os.PathLike) -> tuple[Path, object]:
    """A directory ``root/slot-N`` that no live process holds, and the open file whose lock holds it
    for as long as it stays open. The OS drops the lock when its process dies, even killed, so a
    replica that replaces one that died (or was redeployed) takes the lowest free slot and resumes its
    versions; slots never outnumber the replicas that ran at once, so nothing piles up on disk."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for i in itertools.count():
        d = root / f"slot-{i}"
        d.mkdir(exist_ok=True)
        f = open(d / ".owner", "a")  # noqa: SIM115  held open: the lock lives as long as this file
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live replica holds it
            f.close()
            continue
        return d, f
    raise AssertionError("unreachable")


def read_manifest(root: str | os.PathLike) -> dict | None:
    """The manifest of the store at root ({"current", "versions", ...}), changing nothing (VersionStore creates
    the folder); None when there is none. Written by os.replace, a manifest is never read half written."""
    try:
        return json.loads((Path(root) / "manifest.json").read_text())
    except FileNotFoundError:
        return None


class VersionStore:
    def __init__(self, root: str | os.PathLike, keep_last: int = 5):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.manifest = read_manifest(self.root) or {"current": None, "versions": []}

    def refresh(self) -> int | None:
        """Re-read the manifest (another process may have published); returns the current version."""
        self.manifest = read_manifest(self.root) or self.manifest
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
        try:
            tmp.write_text(json.dumps(self.manifest, indent=2))
            _fsync(tmp)  # the versions it names are on the device already (_publish): so must it be
            os.replace(tmp, self.root / "manifest.json")
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: not one more file on it per process that tried
            raise
        _fsync_dir(self.root)  # the rename's durability; the manifest is in place either way

    @contextlib.contextmanager
    def _locked(self):
        """Every read-modify-write of the manifest holds this file lock and starts from the manifest on
        disk: replicas, the cluster controller and admin rollbacks share one store."""
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                self.refresh()
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def publish(self, state: dict[str, torch.Tensor], meta: dict | None = None, adapter_writer=None,
                expect_current: int | None | str = "any", draft: str | None = None,
                expect_draft: str | None = "any") -> int | None:
        """Write a new version and make it current; returns its number. adapter_writer(dir), if
        given, writes the LoRA adapter into the version's adapter/ folder. expect_current: publish only
        if the current version is still this one (a candidate trained from it), else return None.
        draft: the draft's fingerprint (draft_fingerprint), recorded in the same manifest write.
        expect_draft: publish only if the store still holds that draft's versions (the manifest's
        fingerprint). A clear() restarts the numbering, so expect_current alone passed a candidate
        trained from the cleared store's version 0 over the new draft's version 0."""
        with self._locked():
            if expect_current != "any" and self.current != expect_current:
                return None
            if expect_draft != "any" and self.manifest.get("draft") != expect_draft:
                return None
            if draft is not None:
                self.manifest["draft"] = draft
            return self._publish(state, meta, adapter_writer)

    def _publish(self, state, meta, adapter_writer) -> int:
        # Above every number ever used, also those a rollback left out of the manifest.
        on_disk = [int(p.name[1:]) for p in self.root.glob("v[0-9]*") if p.name[1:].isdigit()]
        version = max(self.manifest["versions"] + on_disk, default=-1) + 1
        for orphan in self.root.glob(".tmp-v*"):  # under the store's lock: a killed publisher's, never a live one's
            shutil.rmtree(orphan, ignore_errors=True)
        # Versions no manifest lists: a publisher killed between its rename and its manifest write, or before
        # its pruned versions went. No reader ever loaded one; each is a whole draft left on disk for good.
        for orphan in self.root.glob("v[0-9]*"):
            if orphan.name[1:].isdigit() and int(orphan.name[1:]) not in self.manifest["versions"]:
                shutil.rmtree(orphan, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-v", dir=self.root))
        try:
            save_file({n: t.detach().cpu().contiguous() for n, t in state.items()}, str(tmp / "draft.safetensors"))
            if adapter_writer is not None:
                adapter_writer(str(tmp / "adapter"))
            (tmp / "meta.json").write_text(json.dumps({"version": version, "time": time.time(), **(meta or {})}, indent=2, default=str))
            for f in [*tmp.rglob("*"), tmp]:  # files and directories, before the manifest can name them
                (_fsync_dir if f.is_dir() else _fsync)(f)
            os.replace(tmp, self.path(version))
            _fsync_dir(self.root)  # the rename reaches the device before the manifest names it
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        saved = json.loads(json.dumps(self.manifest))
        try:
            self.manifest["versions"].append(version)
            self.manifest.setdefault("parents", {})[str(version)] = self.current
            self.manifest["current"] = version
            doomed = self._prune()
            # Deleted after the manifest stops listing them: a crash in between leaves unlisted directories
            # (numbering skips them), never a listed version without its files.
            self._write_manifest()
        except BaseException:
            # The manifest write failed (a full disk): this object went on naming a version no other
            # reader sees (/admin/experts listed it), and its directory, a whole draft, stayed on
            # the full disk for good. The disk's manifest is the truth; its version stays only if named.
            self.manifest = saved
            with contextlib.suppress(OSError, ValueError):
                self.refresh()
            if version not in self.manifest["versions"]:
                shutil.rmtree(self.path(version), ignore_errors=True)
            raise
        for d in doomed:
            shutil.rmtree(d, ignore_errors=True)
        return version

    def parent(self, version: int) -> int | None:
        return self.manifest.get("parents", {}).get(str(version))

    def _prune(self) -> list[Path]:
        """The newest keep_last, always the current version's parent (after a rollback to v0 and an
        update from it, v0 is the known-good version the next rollback goes to), and always version 0,
        the draft as configured: `rollback?to=0` reaches it with either backend (ray_train's full-weight
        versions pruned it after keep_last; the local backend kept it only as its LoRA series' base).
        Returns the directories to delete once the manifest no longer lists them (_publish)."""
        vs = self.manifest["versions"]
        keep = set(vs[-self.keep_last :]) | {self.parent(self.current)} | ({0} & set(vs))
        # A LoRA version's adapter is a delta over its base version's weights (meta
        # adapter_base_version): the base stays while any kept version applies over it.
        keep |= {self._adapter_base(v) for v in keep if v is not None} - {None}
        self.manifest["versions"] = [v for v in vs if v in keep]
        parents = self.manifest.get("parents", {})
        self.manifest["parents"] = {k: p for k, p in parents.items() if int(k) in keep}
        return [self.path(v) for v in vs if v not in keep]

    def _adapter_base(self, version: int) -> int | None:
        try:
            return self.meta(version).get("adapter_base_version")
        except (OSError, ValueError):
            return None

    def load(self, version: int | None = None) -> dict[str, torch.Tensor]:
        version = self.current if version is None else version
        self._check_kept(version)
        return load_file(str(self.path(version) / "draft.safetensors"))

    def rollback(self, to: int | None = None, load: bool = True) -> tuple[int, dict[str, torch.Tensor] | None]:
        """Make a kept version current (default: the current one's parent, the version it was trained
        from); returns it and its weights (None with load=False: a caller that serves no draft)."""
        with self._locked():
            to = self._rollback_target(to)
            state = self.load(to) if load else None
            self._make_current(to)
            return to, state

    def rollback_target(self, to: int | None = None) -> tuple[int, int]:
        """(the version rollback(to) makes current, the current one), changing nothing (ValueError when
        there is none), for make_current."""
        with self._locked():
            return self._rollback_target(to), self.current

    def make_current(self, version: int, expect_current: int | None) -> None:
        """Make a kept version current (rollback's last step, for a caller that prepares between), if
        the current one is still expect_current: another writer may have published meanwhile."""
        with self._locked():
            if self.current != expect_current:
                raise ValueError(f"rollback: draft version {self.current} was published meanwhile "
                                 f"(the rollback was from {expect_current}); roll back again")
            self._make_current(version)

    def _check_kept(self, version: int | None) -> None:
        if version not in self.manifest["versions"]:
            raise KeyError(f"draft version {version} is not kept (kept: {self.manifest['versions']})")

    def _make_current(self, version: int) -> None:
        self._check_kept(version)
        self.manifest["current"] = version
        self.manifest["current_at"] = time.time()  # a rollback's choice: no sibling's older version undoes it (siblings.py)
        self._write_manifest()

    def _rollback_target(self, to: int | None) -> int:
        if self.current is None:
            raise ValueError("no draft versions yet")
        vs = self.manifest["versions"]
        if to is None:
            if "parents" in self.manifest:
                to = self.parent(self.current)
            else:  # a manifest from before parents were recorded: the previous in publish order
                i = vs.index(self.current)
                to = vs[i - 1] if i else None
            if to is None:
                raise ValueError("no older version to roll back to")
            if to not in vs:  # a 409 of its own: as "not kept" it was a 404 naming `to`, which the caller never sent
                raise ValueError(f"version {self.current} was trained from version {to}, which is no longer kept "
                                 f"(kept: {vs}); roll back to one of those with `to`")
        return to

    def meta(self, version: int) -> dict:
        return json.loads((self.path(version) / "meta.json").read_text())

    def set_draft(self, fingerprint: str) -> None:
        """Record which draft (draft_fingerprint) these versions were distilled from."""
        with self._locked():
            self.manifest["draft"] = fingerprint
            self._write_manifest()

    def clear(self, unless_draft: str | None = None) -> bool:
        """Remove every version (the store held another draft's); returns whether it did. unless_draft: keep
        them if the store holds that draft's by now. Checked under the lock: two replicas of a new draft
        both saw the old one's, and the later clear deleted what the first had published since (and a
        version trained from it), restarting the numbering under a watcher serving that number."""
        with self._locked():
            if unless_draft is not None and (self.current is None or self.manifest.get("draft", unless_draft) == unless_draft):
                return False
            for v in self.manifest["versions"]:
                shutil.rmtree(self.path(v), ignore_errors=True)
            self.manifest = {"current": None, "versions": []}
            self._write_manifest()
            return True


class VersionWatcher:
    """Hot-swap for drafts trained elsewhere: polls each expert's VersionStore under ``root`` and calls
    ``apply(expert, state, version)`` when another process (the cluster distiller) publishes.

    Used by the colocated SpecServer and the disaggregated DraftPool when distill.backend is ray_train.
    A version being pruned as it is read is skipped, and picked up at the next poll.

    loaded(expert): whether the expert's draft is still held. DraftPool's experts come and go (Ray Serve's
    multiplexing evicts past its cap): one no longer held stops being watched, as its versions would
    each be read in full for nothing, and watch() again, as it loads, gives it the current version.
    """

    def __init__(self, root: str | os.PathLike, apply, poll_s: float = 2.0, on_swap=None, loaded=None):
        self.root, self.apply, self.poll_s, self.on_swap, self.loaded = Path(root), apply, poll_s, on_swap, loaded
        self.stores: dict[str, VersionStore] = {}
        self.serving: dict[str, int | None] = {}
        self.failed: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        # One swap at a time per watcher: a poll's and a rollback's (rollback()), so neither swaps in an
        # older version over the other's newer one.
        self._swapping = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, expert: str, initial_state) -> tuple[int, dict | None]:
        """Start watching an expert. initial_state: a callable returning its draft's state dict as
        configured, published as version 0 if the store is empty. Returns (version to serve, its state
        to load now, or None when it is the initial draft itself); the caller loads it, on its own thread."""
        store = VersionStore(self.root / expert)
        draft = initial_state()
        base = draft_fingerprint(draft)
        if store.refresh() is not None and store.manifest.get("draft", base) != base:
            # As OnlineDistiller does: versions of another draft (a redeploy changed it) would load
            # without complaint where the shapes match and serve the old draft's weights.
            if store.clear(unless_draft=base):  # unless another replica of this draft cleared and published first
                logger.warning("versions under %s belonged to another draft; starting from version 0", store.root)
        state = None
        initial = {n: t.clone() for n, t in draft.items()} if store.refresh() is None else None
        if initial is None or store.publish(initial, {"reason": "initial draft"}, expect_current=None, draft=base) is None:
            state = store.load()  # a restart, or another replica was first: serve what the store says
            if "draft" not in store.manifest:  # a store from before fingerprints: this draft's from now on
                store.set_draft(base)
        with self._lock:
            self.stores[expert], self.serving[expert] = store, store.current
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="osd-version-watch", daemon=True)
                self._thread.start()
        return store.current, state

    def _watching(self, expert: str, store: VersionStore) -> bool:
        """Whether store is still the one watch() last gave expert (not unloaded, or loaded again since)."""
        with self._lock:
            return self.stores.get(expert) is store

    def poll(self) -> None:
        with self._lock:
            items = list(self.stores.items())
        for expert, store in items:
            if self.loaded is not None and not self.loaded(expert):
                with self._lock:
                    if self.stores.get(expert) is store:  # not if it was loaded again meanwhile
                        del self.stores[expert], self.serving[expert]
                continue
            with self._swapping:
                self._poll_one(expert, store)

    def _poll_one(self, expert: str, store: VersionStore) -> None:
        try:
            v = store.refresh()
            if v is None or v == self.serving.get(expert) or (expert, v) in self.failed:
                return
            state = store.load(v)
        except SafetensorError as e:  # a damaged file does not heal: say so once, keep serving
            # It is no OSError: uncaught, it ended the watch thread, and no later version swapped in.
            self.failed.add((expert, v))
            logger.error("draft version %s of expert %s is unreadable: %s", v, expert, e)
            return
        except (OSError, ValueError, KeyError):  # being written or pruned as we read: next poll
            return
        if not self._watching(expert, store):
            # Unloaded, or loaded again while this was read (a whole draft: seconds): watch() gave the
            # new draft the store's version of then, and this one may be older (one rolled back from).
            return
        if self._apply(expert, state, v) and self.on_swap is not None:
            self.on_swap(expert, v)

    def _apply(self, expert: str, state, v: int) -> bool:
        try:
            self.apply(expert, state, v)
        except Exception as e:  # noqa: BLE001  a version this draft cannot take: keep serving, say so
            self.failed.add((expert, v))
            logger.error("draft version %s of expert %s could not be swapped in: %r", v, expert, e)
            return False
        with self._lock:
            # Also when it was loaded again during apply, as the new draft may then have got v: the
            # next poll swaps the store's version in if that is another one.
            if expert in self.stores:
                self.serving[expert] = v
        return True

    def rollback(self, expert: str, to: int | None = None) -> int:
        """Make an older kept version current in the shared store, and swap it in here now; every other
        watcher swaps it in at its next poll, and the cluster distiller trains on from it. No on_swap: the
        caller logs the rollback as one event. Left to the next poll, the swap logged a second version
        row, or (a poll between the store's write and the caller's event) came first. Swapped in here
        before the store moves: a version this draft cannot take changes nothing (the store moved first, the
        caller's error came with every replica rolled back but this one)."""
        with self._swapping:
            store = self.stores[expert]
            v, was = store.rollback_target(to)
            try:
                state = store.load(v)
            except FileNotFoundError:  # pruned by a publish since the manifest was read: what a 404 says
                raise KeyError(f"draft version {v} is not kept (pruned meanwhile); nothing changed") from None
            if not self._apply(expert, state, v):
                raise RuntimeError(f"rollback: this replica could not swap draft version {v} of expert {expert!r} in "
                                   f"(the log has why); nothing changed, version {was} is still current")
            # ValueError (a 409) if published meanwhile: this replica's next poll swaps the newer version in
            store.make_current(v, expect_current=was)
            return v

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001  (on_swap, say) one bad poll must not end hot-swapping for good
                logger.error("draft version watch: %r", e, exc_info=e)

    def close(self) -> None:
        self._stop.set()
