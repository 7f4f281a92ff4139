"""Bootstrap behaviour a mutation audit of bootstrap.py, corpus.py, lm_train.py and cache_dir.py found
untested: each test here failed on a changed line that the rest of the suite let pass.

Fast on purpose: builds go through test_bootstrap's _fake_build or a tiny build whose training is
skipped, and training tests use conftest's tiny models on synthetic token streams.
"""

import dataclasses
import json
import os
import threading

import pytest
import torch

from osd_serve import bootstrap, cache_dir, corpus, lm_train
from osd_serve.bootstrap import build_pair
from tests.conftest import llama
from tests.test_bootstrap import _fake_build

TINY = bootstrap.PRESETS["tiny"]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _counting_build(monkeypatch) -> list:
    """_fake_build, counting the builds: a count that stays put is a cache hit."""
    calls = []

    def build(out, *args):
        calls.append(out)
        return _fake_build(out, *args)

    monkeypatch.setattr(bootstrap, "_build_into", build)
    return calls


# --- the cache key and what counts as a cached build ---------------------------------------------------

def test_cache_key_changes_with_recipe_version_and_file_size(tmp_path, monkeypatch):
    """A recipe, a BUILD_VERSION bump or a file's size changed must give a new key (or an old pair is
    served for new inputs); the same inputs give the same key."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a"}\n')
    files = [str(data)]
    key = bootstrap._cache_name(files, "tiny", TINY)
    assert bootstrap._cache_name(files, "tiny", TINY) == key
    assert bootstrap._cache_name(files, "tiny", dataclasses.replace(TINY, seed=1)) != key
    with monkeypatch.context() as mp:
        mp.setattr(bootstrap, "BUILD_VERSION", bootstrap.BUILD_VERSION + 1)
        assert bootstrap._cache_name(files, "tiny", TINY) != key
    st = os.stat(data)
    data.write_text('{"q": "ab"}\n')  # one byte more, same modification time
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert bootstrap._cache_name(files, "tiny", TINY) != key


def test_same_relative_name_in_two_directories_is_two_keys(tmp_path, monkeypatch):
    """--data d.jsonl run from two directories names two files: one key would serve one's pair for the other."""
    keys = []
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "d.jsonl").write_text('{"q": "same size"}\n')
        os.utime(tmp_path / sub / "d.jsonl", ns=(0, 10**18))  # same size and time: only the path differs
        monkeypatch.chdir(tmp_path / sub)
        keys.append(bootstrap._cache_name(["d.jsonl"], "tiny", TINY))
    assert keys[0] != keys[1]


@pytest.mark.parametrize("stale", ["version", "config", "marker"])
def test_a_stale_or_unmarked_build_is_rebuilt(tmp_path, monkeypatch, stale):
    """An older recipe's build.json, an edited preset's, or a build.json without the COMPLETE marker
    (a copy cut short) is not a cache hit."""
    calls = _counting_build(monkeypatch)
    build_pair(out_root=str(tmp_path), preset="tiny")
    entry = tmp_path / "tiny-pair"
    info = json.loads((entry / "build.json").read_text())
    if stale == "version":
        info["version"] -= 1
    elif stale == "config":
        info["config"]["seed"] += 1
    else:
        (entry / bootstrap.COMPLETE_MARKER).unlink()
    (entry / "build.json").write_text(json.dumps(info))
    build_pair(out_root=str(tmp_path), preset="tiny")
    assert len(calls) == 2
    build_pair(out_root=str(tmp_path), preset="tiny")  # and the rebuild is a hit
    assert len(calls) == 2


def test_reuse_by_content_is_reported(tmp_path, monkeypatch, capsys):
    """A file rewritten unchanged reuses its build: the user is told why nothing was trained."""
    _counting_build(monkeypatch)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a"}\n')
    first = build_pair([str(data)], out_root=str(tmp_path / "out"), preset="tiny")
    st = os.stat(data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    capsys.readouterr()
    assert build_pair([str(data)], out_root=str(tmp_path / "out"), preset="tiny") == first
    assert "built from the same content" in capsys.readouterr().err


# --- temp dirs, the PID file, threads -------------------------------------------------------------------

def test_a_build_sweeps_killed_builds_of_data_files_first(tmp_path, monkeypatch):
    """A killed data-file build's temp dir (up to ~130 MB) is deleted by the next build in the directory."""
    _counting_build(monkeypatch)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a"}\n')
    root = tmp_path / "out"
    root.mkdir()
    dead = root / f".tmp-{bootstrap._cache_name([str(data)], 'tiny', TINY)}-x1"
    dead.mkdir()
    (dead / "PID").write_text("some-host 999999999")
    os.utime(dead, (0, 0))  # old enough for any host's build to be over
    build_pair(out_root=str(root), preset="tiny")  # another entry's build sweeps it too
    assert not dead.exists()


def test_a_running_build_survives_another_nodes_sweep(tmp_path, monkeypatch):
    """On shared storage another node sweeps too: the PID file must name this host, or its pid is looked
    up there, found dead, and the running build deleted under it."""
    def build(out, *args):
        with monkeypatch.context() as mp:
            mp.setattr(cache_dir.socket, "gethostname", lambda: "other-node")

            def no_such_process(pid, sig):
                raise ProcessLookupError

            mp.setattr(bootstrap.os, "kill", no_such_process)
            bootstrap._sweep_stale_tmp(out.parent)
        assert out.is_dir(), "the other node deleted a running build"
        return _fake_build(out, *args)

    monkeypatch.setattr(bootstrap, "_build_into", build)
    build_pair(out_root=str(tmp_path), preset="tiny")


def test_a_build_trains_on_every_core_and_restores_the_setting(tmp_path, monkeypatch):
    """Ray runs replicas with one thread; the build must use every core, then give the caller's back."""
    seen = []

    def build(out, *args):
        seen.append(torch.get_num_threads())
        return _fake_build(out, *args)

    monkeypatch.setattr(bootstrap, "_build_into", build)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        build_pair(out_root=str(tmp_path), preset="tiny")
        assert seen == [len(os.sched_getaffinity(0))] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_umask_reads_the_process_umask():
    """It sets the pair directory's mode: a misread umask left a shared cache unreadable to others."""
    old = os.umask(0o027)
    try:
        assert cache_dir.umask() == 0o027
    finally:
        os.umask(old)


def test_a_waiting_build_says_so(tmp_path, capsys):
    """A second build of one cache waits silently for minutes unless it says what it waits for."""
    import fcntl

    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a build in another process
    entered = threading.Event()

    def second():
        with cache_dir.build_lock(tmp_path):
            entered.set()

    t = threading.Thread(target=second, daemon=True)
    try:
        t.start()
        assert not entered.wait(0.5)  # blocked on the held lock ...
    finally:
        os.close(fd)  # ... until the first build ends
    t.join(10)
    assert entered.is_set() and "another process is building a pair" in capsys.readouterr().err


# --- what each stage of a build sees -------------------------------------------------------------------

# the tiny preset, with a draft schedule unlike the target's so the two cannot be confused
SPIED = dataclasses.replace(TINY, draft_train=bootstrap.TrainSchedule(steps=3, batch=2, lr=2e-3, warmup=0))


@pytest.fixture
def spied_build(tmp_path, monkeypatch):
    """A tiny build from data files with training skipped, recording what each stage was given."""
    monkeypatch.setitem(bootstrap.PRESETS, "tiny", SPIED)
    seen = {"make_prompts": [], "encode_stream": [], "train_lm": []}
    for name in ("make_prompts", "encode_stream", "split_heldout", "train_tokenizer"):
        real = getattr(bootstrap, name)

        def spy(*args, _real=real, _name=name):
            out = _real(*args)
            if _name in ("make_prompts", "encode_stream"):
                seen[_name].append(args[0])
            else:
                seen[_name] = out if _name == "split_heldout" else args[0]
            return out

        monkeypatch.setattr(bootstrap, name, spy)

    def train_lm(model, stream, seq_len, sched, seed, desc, teacher=None):
        seen["train_lm"].append((model, sched, teacher))
        return 0.0

    monkeypatch.setattr(bootstrap, "train_lm", train_lm)
    recs = [{"q": f"Question {i} is here?", "a": f"answer {i} " * 20} for i in range(80)]
    paths = build_pair([_jsonl(tmp_path / "d.jsonl", recs)], out_root=str(tmp_path / "out"), preset="tiny")
    return paths, seen


def test_prompts_and_held_out_loss_come_only_from_unseen_documents(spied_build):
    """Bench prompts from training text overstate acceptance; so does a held-out loss on training text."""
    paths, seen = spied_build
    train, held = seen["split_heldout"]
    assert held and not set(held) & set(train)
    assert seen["train_tokenizer"] == train
    assert seen["encode_stream"] == [train, held]
    assert seen["make_prompts"] == [held, train]  # bench prompts, then distillation prompts
    prompts = [json.loads(line)["prompt"] for line in open(paths["prompts"])]
    assert prompts and all(any(p in d for d in held) and not any(p in d for d in train) for p in prompts)


def test_each_model_trains_on_its_own_schedule_and_the_draft_distils_from_the_target(spied_build):
    _, seen = spied_build
    (target, t_sched, t_teacher), (draft, d_sched, d_teacher), (distilled, k_sched, teacher) = seen["train_lm"]
    assert (t_sched, d_sched, k_sched) == (SPIED.target_train, SPIED.draft_train, SPIED.draft_distill)
    assert t_teacher is None and d_teacher is None and distilled is draft and teacher is target


def test_too_little_distillation_data_fails_before_training(tmp_path, monkeypatch):
    """Checked first, so a corpus too small to distil fails at once, not after minutes of training."""
    monkeypatch.setattr(bootstrap, "train_lm", lambda *a, **k: pytest.fail("trained before the check"))
    data = _jsonl(tmp_path / "d.jsonl", [{"q": f"a{i}"} for i in range(12)])
    with pytest.raises(ValueError, match="distillation prompts"):
        build_pair([data], out_root=str(tmp_path / "out"), preset="tiny")


# --- tokenizer, token stream, fresh models -------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe():
    return bootstrap.train_tokenizer([f"def f{i}(x):\n    return x + {i}\n" for i in range(50)], 300)


def test_tokenizer_round_trips_bytes_it_never_saw(bpe):
    """Byte-level with the whole byte alphabet: text outside an ASCII corpus still round-trips."""
    text = "naïve 日本語 🙂\n"
    assert bpe.decode(bpe(text)["input_ids"], skip_special_tokens=True) == text


def test_stream_is_each_document_between_bos_and_eos(bpe):
    """Every document, in order, each closed by EOS (the models learn to stop), past one 256-doc batch."""
    docs = [f"x = {i}\n" for i in range(300)]
    want = [t for d in docs for t in bpe(d)["input_ids"] + [bpe.eos_token_id]]
    assert bootstrap.encode_stream(docs, bpe).tolist() == want


def test_fresh_models_bigram_tied_draft_and_served_settings(bpe):
    """An untrained model is an exact bigram model (residual outputs zeroed); the draft's embeddings are
    tied as its dims say; the served context is not the 32-token training window; HF generate stops at EOS."""
    target = bootstrap.make_model(TINY.target, TINY, bpe, 0)
    draft = bootstrap.make_model(TINY.draft, TINY, bpe, 1)
    a, b = torch.tensor([[5, 9, 7, 42]]), torch.tensor([[88, 3, 42]])  # different prefixes, last token 42
    with torch.no_grad():
        torch.testing.assert_close(target(a).logits[0, -1], target(b).logits[0, -1])
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    assert target.lm_head.weight.data_ptr() != target.model.embed_tokens.weight.data_ptr()
    for m in (target, draft):
        assert m.config.max_position_embeddings >= 2048 > TINY.seq_len
        assert (m.generation_config.eos_token_id, m.generation_config.pad_token_id) == (bpe.eos_token_id, bpe.pad_token_id)


# --- corpus ----------------------------------------------------------------------------------------------

def test_text_without_blank_lines_is_still_several_documents(tmp_path):
    """Fixed line chunks leave documents to hold out when a .txt has no paragraph breaks."""
    f = tmp_path / "lines.txt"
    f.write_text("".join(f"line {i}\n" for i in range(100)))
    docs = list(corpus.read_documents(str(f)))
    assert len(docs) > 1 and "".join(docs) == f.read_text()


def test_records_without_text_are_not_documents(tmp_path):
    """An empty document became an empty prompt."""
    f = _jsonl(tmp_path / "d.jsonl", [1, {"q": "a"}, {"n": 2}, {"q": ""}, None])
    assert list(corpus.read_documents(f)) == ["a"]
    empty = _jsonl(tmp_path / "e.jsonl", [1, {"q": ""}])
    with pytest.raises(ValueError, match="contain no text"):
        corpus.load_corpus([empty], TINY)


def test_long_lines_are_cut_between_words():
    text = "words " * 20_000  # 6-character words: a cut at a fixed offset lands inside one
    pieces = list(corpus._pieces(text))
    assert len(pieces) > 1 and "".join(pieces) == text and all(p.endswith(" ") for p in pieces)


def test_stdlib_corpus_has_no_tests_spans_the_library_and_keeps_its_budget():
    files = corpus.stdlib_files()
    root = os.path.commonpath([str(p) for p in files])
    tops = [os.path.relpath(p, root).split(os.sep)[0].lower() for p in files]
    assert not {"test", "tests", "idle_test"} & {part for p in files for part in p.parts}
    head = tops[: len(tops) // 10]  # any prefix samples the whole library, not its first letters
    assert min(head) < "f" and max(head) > "p"
    docs = corpus.load_corpus(None, TINY)
    assert docs and sum(map(len, docs)) <= TINY.corpus_max_bytes


def test_held_out_split_is_small_disjoint_and_complete():
    docs = [f"doc {i}" for i in range(20)]
    train, held = corpus.split_heldout(docs, 64, seed=0)
    assert len(held) == 2  # a small corpus keeps 90% for training
    assert sorted(train + held) == sorted(docs) and not set(train) & set(held)
    with pytest.raises(ValueError, match="at least 2 documents"):
        corpus.split_heldout(["only one"], 4, seed=0)


def test_prompts_are_short_and_start_with_text():
    import random

    rng = random.Random(0)
    assert len(corpus.make_prompt("x" * 5000, rng)) <= 320  # one huge line: still a short prompt
    assert corpus.make_prompt("\n\n\nWhat is two plus two, exactly?\nfour", rng).startswith("What is")


# --- training ------------------------------------------------------------------------------------------

def _cycle(period: int = 5, n: int = 400) -> torch.Tensor:
    return (torch.arange(n) % period + 3).long()  # [n]: 3 4 5 6 7 3 4 ...


def test_training_learns_the_next_token_on_a_warmup_then_cosine_schedule(monkeypatch):
    lrs = []

    class AdamW(torch.optim.AdamW):
        def step(self, *a, **k):
            lrs.append(self.param_groups[0]["lr"])
            return super().step(*a, **k)

    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    sched = bootstrap.TrainSchedule(steps=25, batch=4, lr=1e-2, warmup=5)
    model = llama(16, hidden=32, layers=1, seed=0)
    lm_train.train_lm(model, _cycle(), 16, sched, seed=0, desc="t")
    # each step's gradients are dropped after use: none accumulate into the next step, none are left
    # holding memory while the trained model goes on to generate
    assert all(p.grad is None for p in model.parameters())
    window = _cycle()[:16][None]  # [1, 16]
    with torch.no_grad():
        pred = model(window).logits[0, :-1].argmax(-1)
    assert (pred == window[0, 1:]).float().mean() > 0.9  # predicts the *next* token
    # linear warmup from above zero to the peak, then cosine down towards 10% of it
    assert len(lrs) == 25 and 0 < lrs[0] < lrs[4] and lrs[5] == pytest.approx(sched.lr)
    assert all(x >= y for x, y in zip(lrs[5:], lrs[6:])) and 0.1 * sched.lr <= lrs[-1] < 0.2 * sched.lr


def test_distillation_moves_the_draft_towards_the_teacher():
    teacher, draft = llama(16, hidden=32, layers=1, seed=0), llama(16, hidden=32, layers=1, seed=1)
    stream = torch.randint(3, 16, (16 * 8,), generator=torch.Generator().manual_seed(0))
    windows = stream.view(-1, 16)

    def agreement() -> float:
        with torch.no_grad():
            return (draft(windows).logits.argmax(-1) == teacher(windows).logits.argmax(-1)).float().mean().item()

    before = agreement()
    lm_train.train_lm(draft, stream, 16, bootstrap.TrainSchedule(steps=25, batch=4, lr=2e-2, warmup=0), 0, "d", teacher)
    assert agreement() > before + 0.4  # from chance (1 in 13) to agreeing on most positions


def test_eval_and_training_edges():
    model = llama(16, hidden=32, layers=1)
    assert torch.isfinite(torch.tensor(lm_train.eval_loss(model, _cycle(n=10), 16)))  # held-out shorter than a window
    with pytest.raises(ValueError, match="seq_len=16"):
        lm_train.train_lm(model, _cycle(n=16), 16, TINY.target_train, 0, "t")


def test_greedy_paths_and_acceptance(tok, monkeypatch):
    """Continuations are each prompt's own greedy path (left padding masked) closed by EOS; a draft
    identical to the target accepts every token."""
    # float32 on both sides: where bf16 autocast times faster on this CPU (measured per process, so it
    # varies with load) a padded batch and a lone row round differently, and greedy paths split at near-ties.
    monkeypatch.setattr(lm_train, "use_bf16_autocast", lambda: False)
    target = llama(len(tok), hidden=32, seed=0)
    prompts = ["ab", "a much longer prompt"]
    got = lm_train.greedy_continuations(target, tok, prompts, new_tokens=4)
    want = []
    for p in prompts:  # one at a time: no padding to get wrong
        ids = torch.tensor([tok(p)["input_ids"]])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)
        want += out[0].tolist() + [tok.eos_token_id]
    assert got.tolist() == want
    assert lm_train.greedy_acceptance(target, target, tok, prompts, 6) == 1.0
