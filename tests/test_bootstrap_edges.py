"""Bootstrap edges a review found: weights others cannot read, a waiting build that retrained what it
waited for, a file given twice, repeated records, and chat-format records."""

import fcntl
import os
import stat
import threading
from pathlib import Path
import time

import pytest
import torch
from safetensors.torch import save_file

from osd_serve import bootstrap, cache_dir, corpus
from osd_serve.bootstrap import build_pair
from tests.test_bootstrap import _fake_build
from tests.test_bootstrap_mutants import TINY, _counting_build, _jsonl


def test_a_published_build_has_the_umasks_modes_weights_included(tmp_path, monkeypatch):
    """safetensors writes 0600 whatever the umask: another user of a shared cache read the configs and
    the tokenizer, then failed on the weights."""
    def build(out, *args):
        info = _fake_build(out, *args)
        save_file({"w": torch.zeros(2)}, str(out / "target" / "model.safetensors"))
        (out / "target" / "config.json").write_text("{}")
        return info

    monkeypatch.setattr(bootstrap, "_build_into", build)
    old = os.umask(0o022)
    try:
        paths = build_pair(out_root=str(tmp_path), preset="tiny")
    finally:
        os.umask(old)
    target = tmp_path / "tiny-pair" / "target"
    assert paths["target"] == str(target)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644}
    assert stat.S_IMODE((tmp_path / "tiny-pair").stat().st_mode) == 0o755  # not mkdtemp's 0700


def test_a_waiting_build_reuses_a_same_content_build_it_waited_for(tmp_path, monkeypatch, capsys):
    """Process A builds from d.jsonl; the file is rewritten unchanged (a checkout), so B's key differs and
    B waits on A's lock. Once A is done, B found no build of its own key and trained a second copy."""
    calls = _counting_build(monkeypatch)
    data = _jsonl(tmp_path / "d.jsonl", [{"q": "a"}])
    root = tmp_path / "out"
    root.mkdir()
    st = os.stat(data)
    fd = os.open(root, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # A holds the lock
    got = {}
    waiting = threading.Thread(target=lambda: got.update(paths=build_pair([data], out_root=str(root), preset="tiny")))
    try:
        waiting.start()  # B: a miss before the lock, then waits
        said = ""
        for _ in range(500):  # B is past its first lookup once it says it waits
            said += capsys.readouterr().err
            if "another process is building a pair" in said:
                break
            time.sleep(0.01)
        assert "another process is building a pair" in said
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # what A saw: another time, same bytes
        a_final = root / bootstrap._cache_name([data], "tiny", TINY)
        bootstrap._build_and_publish(root, a_final, [data], TINY, "tiny", False)
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # B's key is of the original time
    finally:
        os.close(fd)  # A is done
    waiting.join(30)
    assert len(calls) == 1  # A's build only
    assert got["paths"]["target"] == str(a_final / "target")
    assert os.path.islink(root / bootstrap._cache_name([data], "tiny", TINY))  # B's key now aliases A's build


@pytest.mark.parametrize("again", ["dot", "symlink", "same", "hardlink"])
def test_a_data_file_given_twice_is_refused_by_name(tmp_path, monkeypatch, again):
    """Read twice, every held-out prompt document was also a training document."""
    calls = _counting_build(monkeypatch)
    data = _jsonl(tmp_path / "d.jsonl", [{"q": f"question {i}"} for i in range(30)])
    monkeypatch.chdir(tmp_path)
    if again == "symlink":
        os.symlink("d.jsonl", tmp_path / "link.jsonl")
    if again == "hardlink":  # a path of its own: realpath did not see it was the same file
        os.link("d.jsonl", tmp_path / "hard.jsonl")
    second = {"dot": "./d.jsonl", "symlink": "link.jsonl", "same": data, "hardlink": "hard.jsonl"}[again]
    with pytest.raises(ValueError, match=r"data file '.*' is '.*d\.jsonl' again"):
        build_pair([data, second], out_root=str(tmp_path / "out"), preset="tiny")
    assert not calls


def test_a_repeated_record_held_out_is_not_trained_on():
    docs = [f"doc {i}" for i in range(20)] * 2  # every record twice
    train, held = corpus.split_heldout(docs, 64, seed=0)
    assert held and not set(train) & set(held)
    assert set(train) | set(held) == set(docs)
    with pytest.raises(ValueError, match="more varied data"):
        corpus.split_heldout(["same"] * 5, 4, seed=0)


def test_chat_records_give_their_turns():
    """{"messages": [...]} records gave "contain no text" (only top-level strings were read)."""
    openai = {"id": "x1", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
                                       {"role": "tool", "content": None}]}
    sharegpt = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    assert corpus.record_text(openai) == "x1\nHi?\nHello."
    assert corpus.record_text(sharegpt) == "2+2?\n4"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url"}]}]}
    assert corpus.record_text(parts) == "Look:"
    assert corpus.record_text({"tags": ["a", "b"], "q": "text"}) == "text"  # lists of strings stay out


def test_a_removal_cut_short_leaves_a_temp_dir_the_next_sweep_claims(tmp_path, monkeypatch):
    """A second Ctrl-C during a build's clean-up could delete the PID file first and leave the weights
    in a directory no sweep claims (_ours needs the PID file or build.json)."""
    d = tmp_path / ".tmp-tiny-pair-abc"
    (d / "target").mkdir(parents=True)
    (d / "target" / "model.safetensors").write_bytes(b"0" * 1000)
    (d / "PID").write_text(f"{cache_dir.socket.gethostname()} 999999999")
    (d / "build.json").write_text("{}")
    real = cache_dir.shutil.rmtree

    def interrupted(path, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_dir.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache_dir.remove_tree(d)
    assert bootstrap._ours(d)
    monkeypatch.setattr(cache_dir.shutil, "rmtree", real)
    bootstrap._sweep_stale_tmp(tmp_path)  # its process is gone
    assert not d.exists()


def test_a_build_is_on_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    """Nothing was fsynced: after a power cut the file system could keep the rename and the marker but lose
    the weights, and the empty build was a cache hit for good."""
    monkeypatch.setattr(bootstrap, "_build_into", _fake_build)
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(bootstrap.os, "replace", lambda a, b: (renamed.append((str(a), len(synced))), real_replace(a, b)))
    build_pair(out_root=str(tmp_path), preset="tiny")
    [(tmp, before)] = renamed
    assert tmp + "/" + bootstrap.COMPLETE_MARKER in synced[:before] and tmp + "/target" in synced[:before]
    assert synced[before:] == [str(tmp_path)]  # the directory holding the rename


def test_a_data_build_of_an_older_data_recipe_is_rebuilt_the_default_pair_is_not(tmp_path, monkeypatch):
    """How data files become documents changed (chat turns, repeated held-out records): a build from data
    by the older reading must not be a cache hit (its prompts may be trained on); the default pair, read
    from the standard library, is unchanged by it and keeps its cache."""
    calls = _counting_build(monkeypatch)
    data = _jsonl(tmp_path / "d.jsonl", [{"q": "a"}])
    built = build_pair([data], out_root=str(tmp_path / "out"), preset="tiny")
    build_pair(out_root=str(tmp_path / "out"), preset="tiny")
    assert len(calls) == 2
    monkeypatch.setattr(bootstrap, "DATA_RECIPE", bootstrap.DATA_RECIPE + 1)
    assert build_pair([data], out_root=str(tmp_path / "out"), preset="tiny") != built  # a new key, built anew
    build_pair(out_root=str(tmp_path / "out"), preset="tiny")
    assert len(calls) == 3
    info = bootstrap._build_info(Path(built["target"]).parent, TINY)
    assert info is None  # and the old build itself no longer counts as complete


def test_a_dead_builds_temp_dir_with_this_processs_pid_is_swept(tmp_path):
    """A container's entrypoint is pid 1 at every start, on the same host name: a build killed (OOM)
    left a temp dir whose PID file named the pid the next start's builder has, so signal 0 found it
    alive and every such dir (~130 MB) was kept for good. Under the root's lock no build of this
    process is under way there."""
    d = tmp_path / ".tmp-tiny-pair-killed01"
    (d / "target").mkdir(parents=True)
    (d / "PID").write_text(f"{cache_dir.socket.gethostname()} {os.getpid()}")
    live = tmp_path / ".tmp-tiny-pair-live02"  # another live process's build stays
    live.mkdir()
    (live / "PID").write_text(f"{cache_dir.socket.gethostname()} {os.getppid()}")
    bootstrap._sweep_stale_tmp(tmp_path, locked=False)  # no lock (a mount without flock): maybe a live build of ours
    assert d.exists() and live.exists()
    bootstrap._sweep_stale_tmp(tmp_path)
    assert not d.exists() and live.exists()


def test_a_write_error_only_fsync_reports_fails_the_build(tmp_path, monkeypatch):
    """On NFS or under a quota a full disk may show only at fsync (safetensors ignores its close's
    error). sync_tree ignored every fsync error, so the damaged build was marked complete and served."""
    import errno

    monkeypatch.setattr(bootstrap, "_build_into", _fake_build)
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/" + bootstrap.COMPLETE_MARKER):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="No space left"):
        build_pair(out_root=str(tmp_path), preset="tiny")
    assert not (tmp_path / bootstrap._cache_name(None, "tiny", TINY)).exists()
    assert not list(tmp_path.glob(".tmp-*"))  # and the temp dir went
    # a file system that cannot fsync at all says EINVAL: still best effort, the build goes through
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EINVAL, "Invalid argument")))
    assert build_pair(out_root=str(tmp_path), preset="tiny")["target"].endswith("/target")


def test_one_huge_line_is_cut_in_linear_time():
    """_pieces copied the rest of the text at every piece (text = text[cut:]), so a 200 MB line took
    46 s to give a 6 MB corpus budget."""
    words = "word " * 400_000  # 2 MB, one line
    copied = []

    class Text(str):  # records the length of every slice taken of it
        def __getitem__(self, key):
            out = str.__getitem__(self, key)
            copied.append(len(out))
            return out

    pieces = list(corpus._pieces(Text(words)))
    assert "".join(pieces) == words and all(len(p) <= corpus.MAX_DOC_CHARS for p in pieces)
    assert all(p.endswith(" ") for p in pieces[:-1])  # cut at whitespace
    assert max(copied) <= corpus.MAX_DOC_CHARS  # each piece copied once; never the rest of the text
