"""generate and replay from a review of their inputs and outputs: replay never deletes a directory it did
not write, option errors are said as options before the pair loads, failures of a side measurement
are reported instead of timed, and every line of a bad data file is named."""

from __future__ import annotations

import gc
import gzip
import io
import json
import sys
import weakref

import pytest
import torch

from osd_serve import cli, replay
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.corpus import numbered_records
from osd_serve.distill.guard import GuardConfig
from osd_serve.distill.recorder import RecordConfig
from osd_serve.distill.replay import BufferConfig, make_record
from osd_serve.distill.trainer import DistillTrainer, TrainConfig
from osd_serve.engine import SpecEngine
from tests.conftest import llama, perturbed
from tests.test_cli_inputs import _error, _jsonl


@pytest.fixture(scope="module")
def models(tok):
    target = llama(len(tok), seed=0)  # max_position_embeddings 256
    return target, perturbed(target, 0.015), tok


def _no_load(monkeypatch):
    def load(args):
        raise AssertionError("the pair loaded before the options were checked")

    monkeypatch.setattr(cli, "_load", load)


def _replay(models, out, prompts, skip_baselines=True, max_tokens=4):
    target, draft, tok = models
    stream = [{"prompt": p, "source": "s.jsonl", "where": f"s.jsonl:{i + 1}"} for i, p in enumerate(prompts)]
    return replay.replay(target, draft, tok, stream, str(out), SamplingParams(max_tokens=max_tokens),
                         TrainConfig(steps_per_update=1, batch_size=2), BufferConfig(trigger_records=2), RecordConfig(),
                         GuardConfig(), EngineConfig(max_batch_size=4), offline_epochs=1, skip_baselines=skip_baselines)


def test_replay_refuses_to_delete_a_versions_folder_it_did_not_write(models, tmp_path, monkeypatch, capsys):
    """The online run deleted DIR/versions whatever it was: --out ~/.cache/osd-serve took the server's
    published drafts, and --out "" (the current directory) took ./versions."""
    data = _jsonl(tmp_path / "d.jsonl", ["def f("])
    mine = tmp_path / "cache" / "versions" / "default"
    mine.mkdir(parents=True)
    (mine / "keep.txt").write_text("a published draft")
    _no_load(monkeypatch)
    err = _error(["replay", "--data", data, "--out", str(tmp_path / "cache")], capsys)
    assert "versions/ is not a replay's" in err and (mine / "keep.txt").exists()
    assert "--out is empty" in _error(["replay", "--data", data, "--out", ""], capsys)
    with pytest.raises(ValueError, match="not a replay's"):  # the library call checks too
        _replay(models, tmp_path / "cache", ["def f("])
    assert (mine / "keep.txt").read_text() == "a published draft"


def test_a_replays_own_versions_go_at_its_start(models, tmp_path, monkeypatch):
    """A replay's own earlier versions/ is replaced, and at the start: a run stopped before its online run
    left the earlier run's versions beside a result.json of no runs."""
    out = tmp_path / "run"
    _replay(models, out, ["def f("])
    assert (out / "versions").is_dir()

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay, "run_stream", stopped)
    with pytest.raises(KeyboardInterrupt):  # in its static run
        _replay(models, out, ["def f("], skip_baselines=False)
    assert not (out / "versions").exists() and json.loads((out / "result.json").read_text())["runs"] == {}


def test_an_integer_too_long_to_read_names_its_line(tmp_path, monkeypatch, capsys):
    """json raises a plain ValueError (not JSONDecodeError) for an integer of over 4300 digits: the error
    named neither the file nor the line."""
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n" + '{"prompt": "y", "n": ' + "9" * 5000 + "}\n")
    _no_load(monkeypatch)
    assert f"{bad}:2: not valid JSON" in _error(["generate", "--prompts", str(bad)], capsys)
    assert f"{bad}:2: not valid JSON" in _error(["replay", "--data", str(bad), "--out", str(tmp_path / "r")], capsys)
    array = tmp_path / "a.json"
    array.write_text("[" + "9" * 5000 + "]")
    with pytest.raises(ValueError, match=f"{array}: not valid JSON"):
        list(numbered_records(str(array)))


def test_a_data_file_that_is_not_utf8_names_its_line(tmp_path):
    """replay's reader named a byte offset in a read block, which no editor can find; generate's named the line."""
    lines = [json.dumps({"q": f"question {i}"}).encode() for i in range(3000)]
    lines[2999] = b'{"q": "caf\xe9"}'
    raw = b"\n".join(lines) + b"\n"
    plain, packed = tmp_path / "d.jsonl", tmp_path / "d.jsonl.gz"
    plain.write_bytes(raw)
    packed.write_bytes(gzip.compress(raw))
    for f in (plain, packed):
        with pytest.raises(ValueError, match=rf"{f}: not UTF-8 text \(line 3000: "):
            list(numbered_records(str(f)))


def test_max_tokens_too_large_is_an_option_error_before_the_prompts(models, tmp_path, monkeypatch, capsys):
    """It was found at the first prompt, after the pair had loaded, and blamed on that prompt's line."""
    data = _jsonl(tmp_path / "d.jsonl", ["def f("])
    _no_load(monkeypatch)
    for cmd in (["generate", "--prompts", data], ["replay", "--data", data, "--out", str(tmp_path / "r")]):
        err = _error([*cmd, "--max-tokens", "5000"], capsys)
        assert "--max-tokens 5000 leaves no room for a prompt within the engine's max_model_len 2048" in err, err
    monkeypatch.setattr(cli, "_load", lambda args: models)  # the pair's own limit: 256 positions
    err = _error(["generate", "--prompts", data, "--max-tokens", "300"], capsys)
    assert "--max-tokens 300 leaves no room for a prompt within the pair's max_model_len 256" in err and f"{data}:" not in err
    with pytest.raises(ValueError, match=r"^--max-tokens 300 leaves no room .* the pair's max_model_len 256$"):
        _replay(models, tmp_path / "r", ["def f("], max_tokens=300)


def test_replay_refuses_options_under_which_nothing_is_measured(tmp_path, monkeypatch, capsys):
    """--max-tokens 1 drafts nothing (each request's last step proposes no token), so every α was None;
    --threads past a C int failed with "Overflow when unpacking long", naming no option."""
    data = _jsonl(tmp_path / "d.jsonl", ["def f("])
    _no_load(monkeypatch)
    base = ["replay", "--data", data, "--out", str(tmp_path / "r")]
    assert "--max-tokens: must be >= 2" in _error([*base, "--max-tokens", "1"], capsys)
    assert "--threads: must be <= 4096" in _error([*base, "--threads", str(2**31)], capsys)
    assert "--threads: must be <= 4096" in _error(["bench", "--threads", str(2**64)], capsys)


def test_files_of_one_name_in_two_folders_are_two_sources(tmp_path):
    """code/train.jsonl then math/train.jsonl were both "train.jsonl": the result could not tell them
    apart and alpha.png drew no line at the shift."""
    files = []
    for domain in ("code", "math"):
        (tmp_path / domain).mkdir()
        files.append(_jsonl(tmp_path / domain / "train.jsonl", [f"{domain} {i}" for i in range(3)]))
    sources = [s["source"] for s in replay.load_stream(files)]
    assert sources == [files[0]] * 3 + [files[1]] * 3
    other = _jsonl(tmp_path / "other.jsonl", ["x"])
    assert {s["source"] for s in replay.load_stream([files[0], other])} == {"train.jsonl", "other.jsonl"}


def test_a_training_thread_that_fails_fails_the_measurement(models, tmp_path, monkeypatch):
    """A trainer that raised (out of memory beside generation) killed its thread with a traceback, and the
    "while training" tokens/s was timed with nothing training beside it and reported as valid."""
    target, draft, tok = models
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=2))
    trainer = DistillTrainer(draft, TrainConfig(batch_size=2), vocab=eng.vocab)
    reverted = []
    monkeypatch.setattr(trainer, "revert", lambda: reverted.append(True))

    def out_of_memory(records, steps=None, progress=False):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(trainer, "train", out_of_memory)
    records = [make_record([5, 6, 7], [8, 9], [0], torch.full((1, eng.vocab), 1.0 / eng.vocab))]
    with pytest.raises(RuntimeError, match=r"training thread failed \(RuntimeError: CUDA out of memory"):
        replay.throughput_ratio(eng, trainer, records, ["def f("], SamplingParams(max_tokens=4), rounds=1)
    assert reverted == [True]  # its steps are never published, failed or not

    def failed(*a, **k):
        raise RuntimeError("the training thread failed (RuntimeError: simulated)")

    monkeypatch.setattr(replay, "throughput_ratio", failed)
    res = _replay(models, tmp_path / "run", ["def f(", "x = 1"])
    assert res["complete"] is True and res["throughput_while_training"] == {
        "ratio": None, "error": "the training thread failed (RuntimeError: simulated)"}


def test_the_offline_draft_is_freed_before_the_online_run(models, tmp_path, monkeypatch):
    """`del off_draft` freed nothing: the offline run's engine still held it, so a second draft stayed
    resident through the online run."""
    seen, real_train, real_online = {}, replay._train_offline, replay._online

    def train_offline(*a, **k):
        off, stats = real_train(*a, **k)
        seen["draft"] = weakref.ref(off)
        return off, stats

    def online(*a, **k):
        gc.collect()
        seen["alive"] = seen["draft"]() is not None
        return real_online(*a, **k)

    monkeypatch.setattr(replay, "_train_offline", train_offline)
    monkeypatch.setattr(replay, "_online", online)
    _replay(models, tmp_path / "run", ["def f(", "x = 1"], skip_baselines=False)
    assert seen["alive"] is False


def test_generate_clears_the_progress_bar_before_each_completion_on_a_terminal(models, tmp_path, monkeypatch):
    """On a terminal stdout and stderr are one screen: each completion was printed after the bar's text on
    its line, and the bar's next redraw wrote over the completion."""
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(cli, "_load", lambda args: models)
    cli.main(["generate", "--prompts", _jsonl(tmp_path / "p.jsonl", ["def f(", "x = 1", "y"]), "--max-tokens", "3",
              "--batch-size", "1"])
    text = screen.getvalue()
    starts = [i for i in range(len(text)) if text.startswith('{"prompt"', i)]
    assert len(starts) == 3 and "generate:" in text
    assert all(i == 0 or text[i - 1] in "\r\n" for i in starts), [text[max(0, i - 30) : i] for i in starts]


def test_a_bench_report_names_the_prompts_it_measured(tmp_path, monkeypatch, capsys):
    """The report held only how many prompts it used, so benchmarks/draft_confidence.py replayed the pair's
    prompts.jsonl beside a report measured on --prompts FILE, and set its model beside other text's speedups."""
    from osd_serve import bench

    monkeypatch.setattr(cli, "_load", lambda args: (None, None, None))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: {})
    pair = tmp_path / "pair"
    (pair / "target").mkdir(parents=True)
    beside = _jsonl(pair / "prompts.jsonl", ["def f("])
    given = _jsonl(tmp_path / "mine.jsonl", ["zzzz qqqq"])
    args = ["bench", "--target", str(pair / "target"), "--draft", str(pair / "target")]
    for extra, used in (([], beside), (["--prompts", given], given)):
        cli.main([*args, *extra])
        assert json.loads(capsys.readouterr().out)["prompts_file"] == used


def test_a_versions_link_or_file_is_refused(models, tmp_path):
    """rmtree refuses a link (and the error was ignored), so the online run resumed from, and pruned, the
    store it points to; a versions file failed only after the static and offline runs."""
    out = tmp_path / "run"
    _replay(models, out, ["def f("])
    elsewhere = tmp_path / "store"
    (out / "versions").rename(elsewhere)
    (out / "versions").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="versions is a link or not a directory"):
        _replay(models, out, ["def f("])
    (out / "versions").unlink()
    (out / "versions").write_text("")
    with pytest.raises(ValueError, match="versions is a link or not a directory"):
        _replay(models, out, ["def f("], skip_baselines=False)
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(["manifest.json", ".lock", "v000000"])


def test_jsonl_lines_may_end_in_cr_or_crlf(tmp_path):
    """Reading bytes to name a bad byte's line split on \\n alone: a file of \\r line ends became one line."""
    from osd_serve.corpus import read_documents

    for end in ("\r", "\r\n"):
        f = tmp_path / "d.jsonl"
        f.write_bytes(("\ufeff" + end.join(json.dumps({"prompt": p}) for p in "ab") + end).encode())
        assert list(read_documents(str(f))) == ["a", "b"]
        assert [s["prompt"] for s in replay.load_stream([str(f)])] == ["a\n", "b\n"]
