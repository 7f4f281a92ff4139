"""The command line and the bootstrap from a hunt for what a demanding user runs into: settings and
paths refused before the pair loads, completions kept when a run stops halfway, Ctrl-C without a
traceback, and one build at a time per cache. In-process, on conftest's tiny models or a fake build."""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time

import pytest

from osd_serve import bootstrap, cli
from osd_serve.bootstrap import build_pair
from osd_serve.engine import SpecEngine
from tests.test_cli_inputs import _error, _jsonl, models  # noqa: F401  (models: the fixture)


def _stopped(argv) -> int:
    """cli.main's exit code where the run is stopped by a Ctrl-C. One that escapes as KeyboardInterrupt
    (a traceback to the user) fails the test here instead of stopping the whole pytest session."""
    try:
        cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C came out as KeyboardInterrupt (a traceback), not a one-line exit 130")
    except SystemExit as e:
        return e.code
    pytest.fail("the run was not stopped")


def _no_load(monkeypatch) -> None:
    def load(args):
        raise AssertionError("the pair loaded before the settings were checked")

    monkeypatch.setattr(cli, "_load", load)


def test_generate_checks_sampling_settings_before_loading(tmp_path, monkeypatch, capsys):
    """SamplingParams was built after _load: a NaN temperature waited for the pair (a minute for 7B)."""
    _no_load(monkeypatch)
    good = _jsonl(tmp_path / "p.jsonl", ["x"])
    out = tmp_path / "o.jsonl"
    for opt, value, field in [("--temperature", "nan", "temperature"), ("--temperature", "-1", "temperature"),
                              ("--top-p", "1.5", "top_p"), ("--top-p", "0", "top_p"), ("--top-k", "-5", "top_k"),
                              ("--seed", str(-(2**63) - 1), "seed")]:
        err = _error(["generate", "--prompts", good, opt, value, "--out", str(out)], capsys)
        assert f"{field} must be" in err, (opt, err)
    assert not out.exists()  # the writability probe leaves no empty file behind a refused run
    for k, why in (("17", "must be <= 16"), ("-1", "must be >= 0"), ("four", "expected an integer")):
        assert f"--num-speculative-tokens: {why}" in _error(["generate", "--prompts", good, "--num-speculative-tokens", k],
                                                            capsys)


def test_generate_takes_num_speculative_tokens_auto(models, tmp_path, monkeypatch, capsys):
    """The engine takes "auto" (auto_k.py), and the error for 17 offered it, but the option's type=int refused it."""
    monkeypatch.setattr(cli, "_load", lambda args: models)
    prompts = _jsonl(tmp_path / "p.jsonl", ["def f(", "x = 1"])
    cli.main(["generate", "--prompts", prompts, "--max-tokens", "4", "--num-speculative-tokens", "auto"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [len(x["token_ids"]) for x in lines] == [4, 4] and all(x["proposed"] > 0 for x in lines)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be created")
def test_generate_and_bench_refuse_an_unwritable_out_before_loading(tmp_path, monkeypatch, capsys):
    """Its parent exists, so --out passed the check, and the write failed after the whole run."""
    _no_load(monkeypatch)
    good = _jsonl(tmp_path / "p.jsonl", ["x"])
    pair = ["--target", str(tmp_path), "--draft", str(tmp_path)]
    for cmd in ("generate", "bench"):
        err = _error([cmd, "--prompts", good, "--out", "/proc/osd-serve-out.jsonl", *pair], capsys)
        assert "--out /proc/osd-serve-out.jsonl: cannot write there" in err, err


def _stop_after_first(monkeypatch) -> list:
    """engine.step raises KeyboardInterrupt (a Ctrl-C) once the first prompt is done and the last is not."""
    reqs: list = []
    real_submit, real_step = SpecEngine.submit, SpecEngine.step

    def submit(self, *a, **k):
        got = real_submit(self, *a, **k)
        reqs.extend(got)
        return got

    def step(self):
        if reqs[0].finished and not reqs[-1].finished:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SpecEngine, "submit", submit)
    monkeypatch.setattr(SpecEngine, "step", step)
    return reqs


def test_generate_keeps_the_finished_completions_of_a_stopped_run(models, tmp_path, monkeypatch, capsys):
    """Every line was written after the last prompt finished: a Ctrl-C (or a crash) an hour in lost them all,
    and printed a traceback."""
    monkeypatch.setattr(cli, "_load", lambda args: models)
    _stop_after_first(monkeypatch)
    prompts = _jsonl(tmp_path / "p.jsonl", ["def f(", "x = 1", "import os"])
    out = tmp_path / "o.jsonl"
    code = _stopped(["generate", "--prompts", prompts, "--max-tokens", "3", "--batch-size", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err and "interrupted: 1 of 3" in err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["def f("] and len(lines[0]["token_ids"]) == 3


def test_generate_to_stdout_prints_each_completion_as_it_finishes(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load", lambda args: models)
    _stop_after_first(monkeypatch)
    prompts = _jsonl(tmp_path / "p.jsonl", ["def f(", "x = 1", "import os"])
    assert _stopped(["generate", "--prompts", prompts, "--max-tokens", "3", "--batch-size", "1"]) == 130
    assert [json.loads(x)["prompt"] for x in capsys.readouterr().out.splitlines()] == ["def f("]


def test_a_write_that_fails_midway_sends_every_completion_to_stdout(models, tmp_path, monkeypatch, capsys):
    """The file may hold a half line after a failed write: every completion, the earlier ones too, goes
    to stdout, and the exit names --out."""
    monkeypatch.setattr(cli, "_load", lambda args: models)
    real_open = open

    class FillsUp:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, text):
            self.writes += 1
            if self.writes > 1:
                raise OSError(28, "No space left on device")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return FillsUp(f) if mode == "w" else f

    monkeypatch.setattr(cli, "open", fake_open, raising=False)
    prompts = _jsonl(tmp_path / "p.jsonl", ["def f(", "x = 1", "import os"])
    out = tmp_path / "o.jsonl"
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompts", prompts, "--max-tokens", "2", "--out", str(out)])
    assert f"--out {out}: No space left" in str(e.value.code)
    printed = [json.loads(x)["prompt"] for x in capsys.readouterr().out.splitlines()]
    assert printed == ["def f(", "x = 1", "import os"]


def test_prompts_file_errors_name_the_line_and_come_before_loading(tmp_path, monkeypatch, capsys):
    """A lone surrogate escape reached the tokenizer after the load ("TextEncodeInput must be Union[...]");
    a non-UTF-8 byte on line 2 was reported without a line (the text stream decodes 8 KB blocks)."""
    _no_load(monkeypatch)
    surrogate = tmp_path / "s.jsonl"
    surrogate.write_text('{"prompt": "ok"}\n{"prompt": "a\\ud800b"}\n', encoding="utf-8")
    assert f"{surrogate}:2: 'prompt' is not text" in _error(["generate", "--prompts", str(surrogate)], capsys)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    assert f"{latin}: not UTF-8 text (line 2" in _error(["generate", "--prompts", str(latin)], capsys)
    missing = tmp_path / "missing.jsonl"
    assert f"prompts file {missing}: No such file" in _error(["generate", "--prompts", str(missing)], capsys)


def test_generate_refuses_to_write_over_its_prompts(tmp_path, monkeypatch, capsys):
    """--out naming the --prompts file replaced the prompts with the completions."""
    _no_load(monkeypatch)
    prompts = _jsonl(tmp_path / "p.jsonl", ["x"])
    os.symlink(prompts, tmp_path / "link.jsonl")
    for out in (prompts, str(tmp_path / "link.jsonl")):
        assert "is the --prompts file" in _error(["generate", "--prompts", prompts, "--out", out], capsys)
    assert json.loads((tmp_path / "p.jsonl").read_text()) == {"prompt": "x"}


def test_bootstrap_out_that_is_a_file_is_named(tmp_path, capsys):
    """mkdir's "[Errno 17] File exists" named neither the option nor what was wrong with it."""
    f = tmp_path / "f"
    f.write_text("x")
    assert f"--out {f} is not a directory" in _error(["bootstrap", "--preset", "tiny", "--out", str(f)], capsys)


def test_bootstrap_out_empty_and_a_full_disk_are_one_line_errors(tmp_path, monkeypatch, capsys):
    """--out "" (an unset shell variable) built into the default cache without a word; a disk that
    filled while safetensors saved the weights gave a traceback (SafetensorError is not an OSError)."""
    from safetensors import SafetensorError

    assert "--out is empty" in _error(["bootstrap", "--preset", "tiny", "--out", ""], capsys)

    def full(**kw):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(bootstrap, "build_pair", full)
    assert "No space left on device" in _error(["bootstrap", "--preset", "tiny", "--out", str(tmp_path)], capsys)


def test_replay_out_that_is_a_file_fails_before_loading(tmp_path, monkeypatch, capsys):
    """replay made --out after loading the pair: a file there failed only then."""
    _no_load(monkeypatch)
    data = _jsonl(tmp_path / "d.jsonl", ["x"])
    f = tmp_path / "f"
    f.write_text("x")
    assert f"--out {f} is not a directory" in _error(["replay", "--data", data, "--out", str(f)], capsys)


def test_a_mistyped_model_path_is_not_blamed_on_the_hub(tmp_path, monkeypatch):
    """'/no/such/target' was reported as a hub id that could not be fetched ("Repo id must use alphanumeric
    chars ..."), though no hub id starts with '/'."""
    from osd_serve.loading import _load_error

    err = str(_load_error("/no/such/target", "target", OSError("Repo id must use alphanumeric chars")))
    assert err == "target model directory '/no/such/target' does not exist"
    (tmp_path / "w.safetensors").write_bytes(b"")
    assert "is not a directory" in str(_load_error(str(tmp_path / "w.safetensors"), "draft", OSError("x")))
    # relative: a file, and a path that is no hub id (more than one '/'), were blamed on the Hub too
    monkeypatch.chdir(tmp_path)
    assert str(_load_error("w.safetensors", "draft", OSError("x"))) == "draft model directory 'w.safetensors' is not a directory"
    err = str(_load_error("models/llama/draft", "draft", OSError("Repo id must be in the form")))
    assert err.startswith("draft model 'models/llama/draft' is neither a local directory nor a hub id (Repo id must")
    assert "could not be fetched" in str(_load_error("org/model", "draft", OSError("We couldn't connect")))


def _fake_build(out, data_files, cfg, preset):
    """What build_pair needs of _build_into, in milliseconds (as test_bootstrap's)."""
    (out / "target").mkdir()
    (out / "draft").mkdir()
    return {"version": bootstrap.BUILD_VERSION, "preset": preset, "config": bootstrap.asdict(cfg), "data_files": []}


def test_concurrent_builds_of_one_cache_train_once(tmp_path, monkeypatch):
    """Two callers at once (two replicas on a fresh machine) each trained the whole pair on the same
    cores; the second now waits for the first and returns its build."""
    started, builds = threading.Event(), []

    def slow_build(out, data_files, cfg, preset):
        builds.append(out)
        started.set()
        time.sleep(0.5)  # the second caller arrives while this build runs
        return _fake_build(out, data_files, cfg, preset)

    monkeypatch.setattr(bootstrap, "_build_into", slow_build)
    results = []
    first = threading.Thread(target=lambda: results.append(build_pair(out_root=str(tmp_path), preset="tiny")))
    first.start()
    assert started.wait(10)
    second = build_pair(out_root=str(tmp_path), preset="tiny")
    first.join(10)
    assert len(builds) == 1 and results == [second]
    assert bootstrap._is_complete(tmp_path / "tiny-pair", bootstrap.PRESETS["tiny"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-pair"]  # no lock file left in the user's --out


def test_ctrl_c_in_a_build_leaves_no_complete_entry_and_no_traceback(tmp_path, monkeypatch, capsys):
    calls = []

    def interrupted(out, data_files, cfg, preset):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return _fake_build(out, data_files, cfg, preset)

    monkeypatch.setattr(bootstrap, "_build_into", interrupted)
    code = _stopped(["bootstrap", "--preset", "tiny", "--out", str(tmp_path)])
    assert code == 130 and "Traceback" not in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither an entry nor its temp dir
    cli.main(["bootstrap", "--preset", "tiny", "--out", str(tmp_path)])  # the next call builds, not trusts
    assert len(calls) == 2
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"target": str(tmp_path / "tiny-pair" / "target"),
                                                                    "draft": str(tmp_path / "tiny-pair" / "draft")}


def test_an_unsupported_data_file_is_refused_before_any_work(tmp_path, monkeypatch):
    """Its type was checked when its turn to be read came: after every data file had been hashed
    (minutes for a few GB) and the ones before it read."""
    def no_build(*a, **k):
        raise AssertionError("the build started")

    monkeypatch.setattr(bootstrap, "_build_into", no_build)
    good = _jsonl(tmp_path / "a.jsonl", ["x"])
    (tmp_path / "b.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match="b.csv.*unsupported type"):
        build_pair([good, str(tmp_path / "b.csv")], out_root=str(tmp_path / "out"), preset="tiny")


# runpy warns that the module is imported already; a second copy in sys.modules would split monkeypatches
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_python_m_osd_serve_bootstrap_is_the_cli_command(tmp_path, monkeypatch):
    """`python -m osd_serve.bootstrap` had a parser of its own: a missing data file was a traceback, and the
    last line printed was "}" of an indented JSON, not the pair."""
    monkeypatch.setattr(sys, "argv", ["bootstrap", "--data", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("osd_serve.bootstrap", run_name="__main__")
    assert "data file not found" in str(e.value.code)
