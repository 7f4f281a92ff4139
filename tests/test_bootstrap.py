"""The bootstrap pair builder: HF-loadable output, shared vocab, size ratio, caching, data readers.

One tiny build per session (module fixture) keeps the file to a few seconds of training.
"""

import gzip
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from osd_serve import bootstrap, cache_dir
from osd_serve.bootstrap import build_pair
from osd_serve import corpus
from osd_serve.corpus import load_corpus, read_documents, record_text


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("osd-home")
    return root, build_pair(out_root=str(root), preset="tiny")


def test_dirs_load_with_auto_classes(tiny_pair):
    _, paths = tiny_pair
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(paths[name])
        tok = AutoTokenizer.from_pretrained(paths[name])
        assert type(model).__name__ == "LlamaForCausalLM"
        ids = tok("def f(x):\n    return x", return_tensors="pt").input_ids  # [1, n]
        assert ids[0, 0].item() == tok.bos_token_id  # prompts start like training documents
        with torch.no_grad():
            logits = model(ids).logits  # [1, n, vocab]
        assert logits.shape == (1, ids.shape[1], len(tok))
        assert tok.eos_token_id is not None and tok.pad_token_id is not None
        for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
            assert os.path.isfile(os.path.join(paths[name], f)), f


def test_identical_vocab_and_size_ratio(tiny_pair):
    _, paths = tiny_pair
    t_tok = AutoTokenizer.from_pretrained(paths["target"])
    d_tok = AutoTokenizer.from_pretrained(paths["draft"])
    assert t_tok.get_vocab() == d_tok.get_vocab()
    text = "for i in range(10):\n    print(i, 'é')\n"
    assert t_tok(text).input_ids == d_tok(text).input_ids
    assert t_tok.decode(t_tok(text).input_ids, skip_special_tokens=True) == text  # byte-level round-trip
    target = AutoModelForCausalLM.from_pretrained(paths["target"])
    draft = AutoModelForCausalLM.from_pretrained(paths["draft"])
    assert target.config.vocab_size == draft.config.vocab_size == len(t_tok)
    assert target.num_parameters() >= 10 * draft.num_parameters()


def test_prompts_and_build_info(tiny_pair):
    root, paths = tiny_pair
    lines = [json.loads(l) for l in open(paths["prompts"], encoding="utf-8")]
    assert lines and all(isinstance(l["prompt"], str) and l["prompt"].strip() for l in lines)
    info = json.loads((root / "tiny-pair" / "build.json").read_text())
    assert info["params"]["target"] >= 10 * info["params"]["draft"]
    assert (root / "tiny-pair" / bootstrap.COMPLETE_MARKER).exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # temp dir renamed away


def test_second_call_is_cached(tiny_pair, monkeypatch):
    root, paths = tiny_pair
    # A cache hit must not build anything (corpus, tokenizer, training): make a build explode if it is
    # reached. The time bound only says "at once" without flaking on a paused 2-core runner.
    monkeypatch.setattr(bootstrap, "train_lm", lambda *a, **k: pytest.fail("rebuilt a cached pair"))
    monkeypatch.setattr(bootstrap, "_build_into", lambda *a, **k: pytest.fail("rebuilt a cached pair"))
    t0 = time.perf_counter()
    again = build_pair(out_root=str(root), preset="tiny")
    assert again == paths
    assert time.perf_counter() - t0 < 10.0


def test_interrupted_build_never_looks_complete(tmp_path, monkeypatch):
    def interrupted(out, *args):
        (out / "target").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(bootstrap, "_build_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_pair(out_root=str(tmp_path), preset="tiny")
    assert list(tmp_path.iterdir()) == []  # the half-written temp dir is gone, nothing renamed in
    # A leftover directory without the marker (e.g. killed -9 mid-rename) is not a cache hit.
    (tmp_path / "tiny-pair" / "target").mkdir(parents=True)
    assert not bootstrap._is_complete(tmp_path / "tiny-pair", bootstrap.PRESETS["tiny"])


def test_seeded_build_is_reproducible(tiny_pair, tmp_path):
    _, paths = tiny_pair
    again = build_pair(out_root=str(tmp_path), preset="tiny")
    for name in ("target", "draft"):
        a = AutoModelForCausalLM.from_pretrained(paths[name]).state_dict()
        b = AutoModelForCausalLM.from_pretrained(again[name]).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert open(paths["prompts"]).read() == open(again["prompts"]).read()


def test_default_root_and_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("OSD_SERVE_HOME", str(tmp_path))
    assert bootstrap._default_root() == tmp_path
    with pytest.raises(ValueError, match="preset"):
        build_pair(preset="huge")
    with pytest.raises(FileNotFoundError):
        build_pair([str(tmp_path / "missing.jsonl")], preset="tiny")
    with pytest.raises(ValueError, match="ModelDims.kv_heads"):
        bootstrap.ModelDims(hidden=64, layers=1, intermediate=64, heads=4, kv_heads=3)


def test_killed_builds_temp_dirs_are_swept(tmp_path):
    dead = tmp_path / ".tmp-default-pair-dead"
    dead.mkdir()
    (dead / "PID").write_text("999999999")  # above any pid_max: no such process
    alive = tmp_path / ".tmp-default-pair-alive"
    alive.mkdir()
    (alive / "PID").write_text(str(os.getppid()))  # a live process, not this one (whose pid under the lock is a dead build's)
    young = tmp_path / ".tmp-default-pair-young"  # no PID file yet: a build that just started
    young.mkdir()
    here = tmp_path / ".tmp-default-pair-here"  # this host's dead pid, as the PID file is written now
    here.mkdir()
    (here / "PID").write_text(f"{socket.gethostname()} 999999999")
    # another node's build on shared storage: its pid means nothing here, so it is kept for a day
    other = tmp_path / ".tmp-default-pair-other"
    other.mkdir()
    (other / "PID").write_text("some-other-node 999999999")
    bootstrap._sweep_stale_tmp(tmp_path)
    assert not dead.exists() and not here.exists() and alive.exists() and young.exists() and other.exists()
    bootstrap._sweep_stale_tmp(tmp_path, foreign_after_s=0.0)
    assert not other.exists() and alive.exists()


def test_sweep_leaves_temp_dirs_it_did_not_make(tmp_path):
    """--out may be a directory of the user's: any .tmp-* an hour old without our PID file was deleted."""
    old = time.time() - 7200
    mine = tmp_path / ".tmp-myproject"  # the user's own, however old
    unmarked = tmp_path / ".tmp-default-pair-abc"  # our name, but neither PID file nor build.json
    aside = tmp_path / ".tmp-tiny-pair-old-1-2"  # a finished build moved aside by a killed process
    for d in (mine, unmarked, aside):
        d.mkdir()
    (mine / "notes.txt").write_text("important")
    (mine / "build.json").write_text("{}")  # even with a file of that name: not a name we make
    (aside / "build.json").write_text("{}")
    for d in (mine, unmarked, aside):
        os.utime(d, (old, old))
    bootstrap._sweep_stale_tmp(tmp_path)
    assert (mine / "notes.txt").read_text() == "important" and unmarked.exists() and not aside.exists()


def test_record_text_joins_string_fields():
    rec = {"question": "How many?", "answer": "4", "id": 7, "tags": ["a"], "empty": "", "x": None}
    assert record_text(rec) == "How many?\n4"


def test_readers(tmp_path):
    recs = [{"q": f"question {i}", "a": f"answer {i}", "n": i} for i in range(3)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + "\n")
    (tmp_path / "d.json").write_text(json.dumps(recs))
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "d.txt").write_text("first paragraph\nline two\n\nsecond paragraph\n")
    want = [f"question {i}\nanswer {i}" for i in range(3)]
    assert list(read_documents(str(tmp_path / "d.jsonl"))) == want
    assert list(read_documents(str(tmp_path / "d.json"))) == want
    assert list(read_documents(str(tmp_path / "d.jsonl.gz"))) == want
    assert [d.strip() for d in read_documents(str(tmp_path / "d.txt"))] == [
        "first paragraph\nline two", "second paragraph"]
    with pytest.raises(ValueError, match="unsupported"):
        list(read_documents(str(tmp_path / "d.csv")))


def test_data_errors_name_the_file_and_line_and_long_texts_are_cut(tmp_path):
    """Each line was parsed alone, so every JSON error said "line 1" and none named the file; a BOM
    refused the file; a .txt without line breaks (or a huge record) was one document, and a corpus of
    one document has none to hold out, so a 2 MB file could not build a pair."""
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"q": "a"}\n{"q": "b"}\n{"q": "c\u0001 \n')
    bad.write_bytes(bad.read_bytes().replace(b"\\u0001", b"\x01"))
    with pytest.raises(ValueError, match=f"{bad}:3: not valid JSON"):
        list(read_documents(str(bad)))
    latin = tmp_path / "l.jsonl"
    latin.write_bytes(b'{"q": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"{latin}: not UTF-8"):
        list(read_documents(str(latin)))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"q": "hello"}\n')
    assert list(read_documents(str(bom))) == ["hello"]
    binary = tmp_path / "bin.txt"  # read with errors="replace", it built a pair from U+FFFD noise
    binary.write_bytes(bytes(range(128, 256)) * 64)
    with pytest.raises(ValueError, match=f"{binary}: not UTF-8"):
        list(read_documents(str(binary)))
    one = tmp_path / "one.txt"
    one.write_text("word " * 20_000)  # 100,000 characters, no line break
    docs = list(read_documents(str(one)))
    assert len(docs) == 7 and all(len(d) <= corpus.MAX_DOC_CHARS for d in docs) and "".join(docs) == one.read_text()


def test_records_sharing_their_first_field_still_give_distinct_prompts():
    """Chat records all opening with one system prompt gave one prompt for the bench and one distillation
    prompt, and the default build then failed after all its training."""
    held = [f"You are a helpful assistant.\nWhat is {i} times {i}?\n{i * i}" for i in range(50)]
    prompts = corpus.make_prompts(held, 16, seed=0)
    assert len(prompts) == 16 and len(set(prompts)) == 16
    assert prompts[0] == "You are a helpful assistant.\n"  # the records' own first field comes first
    varied = [f"Question {i}: what is {i} squared?\n{i * i}" for i in range(50)]
    assert corpus.make_prompts(varied, 8, seed=0) == [f"Question {i}: what is {i} squared?\n" for i in range(8)]


def test_build_from_data_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    recs = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}"} for i in range(300)]
    (data / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (data / "b.json").write_text(json.dumps([{"query": f"SELECT {i} FROM t", "db": 3} for i in range(200)]))
    (data / "c.txt").write_text("\n\n".join(f"Paragraph {i} of plain text." for i in range(200)))
    files = [str(data / n) for n in ("a.jsonl", "b.json", "c.txt")]
    paths = build_pair(files, out_root=str(tmp_path / "out"), preset="tiny")
    assert os.path.basename(os.path.dirname(paths["target"])).startswith("pair-")
    info = json.loads(open(os.path.join(os.path.dirname(paths["target"]), "build.json")).read())
    assert [d["path"] for d in info["data_files"]] == [os.path.abspath(f) for f in files]
    tok = AutoTokenizer.from_pretrained(paths["draft"])
    assert len(tok) > 259  # BPE learnt merges from this data, not only the byte alphabet
    # The printed paths are absolute whatever --out was (a Ray replica reads them from elsewhere), and
    # the pair's directory is readable by others as the umask allows (mkdtemp made it 0700).
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert build_pair(files, out_root="out", preset="tiny") == paths and os.path.isabs(paths["target"])
    assert os.stat(os.path.dirname(paths["target"])).st_mode & 0o777 == 0o777 & ~cache_dir.umask()
    # Different data files are a different cache entry.
    assert bootstrap._cache_name(files[:1], "tiny", bootstrap.PRESETS["tiny"]) != os.path.basename(
        os.path.dirname(paths["target"]))

    # A file rewritten unchanged (a copy, a checkout: a new modification time) is a new key, found by its
    # content and reused without training; the new key becomes an alias, so the next call hashes nothing.
    # The same size with other content is a rebuild.
    def no_training(*a, **k):
        raise RuntimeError("rebuilt")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bootstrap, "train_lm", no_training)
        st = os.stat(files[0])
        os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert build_pair(files, out_root=str(tmp_path / "out"), preset="tiny") == paths
        alias = tmp_path / "out" / bootstrap._cache_name(files, "tiny", bootstrap.PRESETS["tiny"])
        assert alias.is_symlink() and alias.resolve() == Path(paths["target"]).parent
        mp.setattr(bootstrap, "_digest", lambda p: pytest.fail("hashed on a plain hit"))
        assert build_pair(files, out_root=str(tmp_path / "out"), preset="tiny")["target"] == str(alias / "target")
        mp.undo()
        # --force builds in the alias's place: the link goes, the build it pointed to stays
        forced = build_pair(files, out_root=str(tmp_path / "out"), preset="tiny", force=True)
        assert not alias.is_symlink() and forced["target"] == str(alias / "target") and os.path.isdir(paths["target"])
        assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith((".tmp-", ".link-"))]
        mp.setattr(bootstrap, "train_lm", no_training)
        text = Path(files[0]).read_text()
        Path(files[0]).write_text(text.replace("What", "Whut", 1))  # same size, other content
        with pytest.raises(RuntimeError, match="rebuilt"):
            build_pair(files, out_root=str(tmp_path / "out"), preset="tiny")


def test_a_long_first_record_does_not_leave_its_source_empty(tmp_path):
    """Each data file gets an even share of the corpus budget; a file whose first record is longer
    than that share contributed nothing (and a single such file was 'no text')."""
    cfg = bootstrap.PRESETS["tiny"]
    share = cfg.corpus_max_bytes // 2
    (tmp_path / "long.txt").write_text("word " * share + "\n\nshort paragraph\n")
    (tmp_path / "small.jsonl").write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(5)))
    docs = load_corpus([str(tmp_path / "long.txt"), str(tmp_path / "small.jsonl")], cfg)
    # (now cut into pieces of at most MAX_DOC_CHARS: the first fits the share, the next would not)
    assert len(docs[0]) == min(share, corpus.MAX_DOC_CHARS) and docs[0].startswith("word word")
    assert docs[1:] == [f"question {i}" for i in range(5)]


def _fake_build(out, data_files, cfg, preset):
    """A build in milliseconds: what build_pair needs of _build_into (the directories and the build info)."""
    (out / "target").mkdir()
    (out / "draft").mkdir()
    files = [{"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256": bootstrap._digest(p)}
             for p in data_files or []]
    return {"version": bootstrap.BUILD_VERSION, "data_recipe": bootstrap.DATA_RECIPE, "preset": preset,
            "config": bootstrap.asdict(cfg), "data_files": files}


def test_a_dangling_alias_is_replaced_not_fatal(tmp_path, monkeypatch):
    """An alias (_alias) whose build was deleted (cache clean-up) made every later call of those files
    train the whole pair and then fail: final.exists() follows the link, so the dangling link was not
    moved aside and renaming the new build over it raised NotADirectoryError."""
    monkeypatch.setattr(bootstrap, "_build_into", _fake_build)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a"}\n')
    root = tmp_path / "out"
    root.mkdir()
    final = root / bootstrap._cache_name([str(data)], "tiny", bootstrap.PRESETS["tiny"])
    os.symlink("pair-0123456789ab", final)  # its build is gone
    paths = build_pair([str(data)], out_root=str(root), preset="tiny")
    assert paths["target"] == str(final / "target") and not final.is_symlink()
    assert bootstrap._is_complete(final, bootstrap.PRESETS["tiny"])
    assert sorted(p.name for p in root.iterdir()) == [final.name]


def test_sweep_keeps_a_live_build_of_another_user(tmp_path, monkeypatch):
    """os.kill(pid, 0) on another user's live process raises PermissionError: the build was taken for a
    dead one without a PID file and, an hour old, deleted under its owner."""
    d = tmp_path / ".tmp-default-pair-theirs"
    d.mkdir()
    (d / "PID").write_text(f"{socket.gethostname()} 4242")
    old = time.time() - 7200
    os.utime(d, (old, old))

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(bootstrap.os, "kill", kill)
    bootstrap._sweep_stale_tmp(tmp_path)
    assert d.exists()
