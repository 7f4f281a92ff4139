"""The bootstrap cache directory's file-system helpers: the umask a build's files get, removing a build's
temp dir (and sweeping those of killed builds), and the lock that keeps two builds of one cache from
training side by side."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path


def umask() -> int:
    """The process umask, read without setting it where Linux allows (os.umask is process-wide: setting
    it, even for an instant, races with files other threads create)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def build_lock(root: Path):
    """One build at a time in a cache directory. Two callers at once (two replicas starting on a fresh
    machine) each trained the whole pair on the same cores, and all but one threw theirs away; builds
    of different pairs share the cores too, so one lock for the directory costs them little.

    A flock on the directory itself: no lock file to leave in a --out the user owns, and the kernel
    drops it with its process, so a killed build leaves no stale lock. Best effort: where the directory
    cannot be opened or its file system has no such locks, builds run side by side as before (the
    atomic rename still keeps each cache entry whole). Yields whether it holds the lock."""
    try:
        import fcntl

        fd = os.open(root, os.O_RDONLY)
    except (ImportError, OSError):
        yield False
        return
    held = False
    try:
        with contextlib.suppress(OSError):  # a mount without flock (ENOLCK; EBADF on a read-only NFS descriptor)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"[bootstrap] another process is building a pair in {root}: waiting for it", file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        yield held
    finally:
        os.close(fd)


def share_tree(tree: Path) -> None:
    """Give the tree the umask's modes before it is published: mkdtemp's 0700 would stay after the rename,
    and safetensors writes weights 0600 whatever the umask, so in a shared cache other users could read
    a build's configs and tokenizer but not its weights."""
    mask = umask()
    for d, _, names in os.walk(tree):
        os.chmod(d, 0o777 & ~mask)
        for n in names:
            os.chmod(os.path.join(d, n), 0o666 & ~mask)


def remove_tree(d: Path) -> None:
    """rmtree, with the files that make a temp dir a build's (bootstrap._ours) going last: a removal cut short (a second
    Ctrl-C) then leaves a directory the next sweep still claims, not ~130 MB no sweep ever touches."""
    with contextlib.suppress(OSError):
        for p in d.iterdir():
            if p.name not in ("PID", "build.json"):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    shutil.rmtree(d, ignore_errors=True)


def sync_tree(tree: Path, recurse: bool = True) -> None:
    """fsync every file and directory under tree (with recurse=False: tree itself, as after a rename in it).
    Without it the file system may keep a rename and lose the renamed files' data in a power cut."""
    for d, _, names in os.walk(tree) if recurse else [(str(tree), [], [])]:
        for path, is_dir in [(os.path.join(d, n), False) for n in names] + [(d, True)]:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                # A file's write error can surface only here (NFS, a quota: safetensors ignores its
                # close's), and the build must then fail, not be marked complete. A file system that
                # cannot fsync (a directory, or at all) says EINVAL or ENOTSUP: best effort there.
                if not is_dir and e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise


def owner_tag() -> str:
    """What a build writes to its temp dir's PID file: this host and process."""
    return f"{socket.gethostname()} {os.getpid()}"


def sweep_dead_tmp(root: Path, ours: Callable[[Path], bool], foreign_after_s: float = 86400.0,
                   locked: bool = True) -> None:
    """Delete the .tmp-* dirs under root that ``ours`` claims and whose build process is gone.

    The PID file (owner_tag) names the host too: on storage several nodes share, another node's build
    is alive though its pid is not one here, so it is left alone for a day (a build takes minutes).
    """
    for d in root.glob(".tmp-*"):
        if not ours(d):
            continue
        age = 0.0
        try:
            age = time.time() - d.stat().st_mtime
            host, _, pid = (d / "PID").read_text().strip().rpartition(" ")
            if host and host != socket.gethostname():
                if age < foreign_after_s:
                    continue
            else:
                # Our own pid, with the root's lock held (locked): no build of this process is under way
                # here, so a dead one's pid came round again (a container's entrypoint is pid 1 every
                # start). Without the lock (a mount without flock) it may be a live build of ours.
                if locked and int(pid) == os.getpid():
                    raise ProcessLookupError
                os.kill(int(pid), 0)  # signal 0 only checks the process exists
                continue
        except ProcessLookupError:
            pass
        except PermissionError:  # alive, another user's: signal 0 is refused, not answered with ESRCH
            continue
        except (OSError, ValueError):  # no PID file: a build between its last two writes, or moved aside
            if age < 3600:
                continue
        remove_tree(d)
