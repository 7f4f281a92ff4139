"""The command line's inputs and outputs, in-process on conftest's tiny models (no bootstrap): a bad
input fails before the work and names what is wrong; a replay keeps what finished; bench measures
what the engine runs."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from types import SimpleNamespace

import pytest

from osd_serve import bench, cli, replay
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.distill.guard import GuardConfig
from osd_serve.distill.recorder import RecordConfig
from osd_serve.distill.replay import BufferConfig
from osd_serve.distill.trainer import DistillTrainer, TrainConfig
from tests.conftest import llama, perturbed


@pytest.fixture(scope="module")
def models():
    """(target, draft, tokenizer): max_position_embeddings 256, so a 300-character prompt is too long."""
    from tests.conftest import char_tokenizer

    tok = char_tokenizer()
    target = llama(len(tok), seed=0)
    return target, perturbed(target, 0.015), tok


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err + str(e.value.code)
    assert e.value.code != 0 and "Traceback" not in err, err
    return err


def _jsonl(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" if p else "\n" for p in prompts), encoding="utf-8")
    return str(path)


def _replay(models, tmp_path, prompts, max_bytes=1 << 20, skip_baselines=False):
    target, draft, tok = models
    stream = [{"prompt": p, "source": "s.jsonl", "where": f"s.jsonl:{i + 1}"} for i, p in enumerate(prompts)]
    return replay.replay(target, draft, tok, stream, str(tmp_path / "run"), SamplingParams(max_tokens=4),
                         TrainConfig(steps_per_update=1, batch_size=2), BufferConfig(max_bytes=max_bytes, trigger_records=2),
                         RecordConfig(), GuardConfig(), EngineConfig(max_batch_size=4), offline_epochs=1,
                         skip_baselines=skip_baselines)


def _stop_at(monkeypatch, run_name: str) -> None:
    """run_stream raises KeyboardInterrupt (a Ctrl-C) when the run named run_name starts."""
    real = replay.run_stream

    def run_stream(engine, prompts, params, desc):
        if desc == run_name:
            raise KeyboardInterrupt
        return real(engine, prompts, params, desc)

    monkeypatch.setattr(replay, "run_stream", run_stream)


def test_interrupted_replay_keeps_the_runs_that_finished(models, tmp_path, monkeypatch):
    """result.json was written once, after all three runs: a Ctrl-C in the online run lost the rest."""
    _stop_at(monkeypatch, "online")
    with pytest.raises(KeyboardInterrupt):
        _replay(models, tmp_path, ["def f(x):", "import os"])
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["complete"] is False and set(res["runs"]) == {"static", "offline"}
    assert len(res["runs"]["static"]["per_request"]) == 2 and res["offline_training"]["train_steps"] >= 1
    assert not list((tmp_path / "run").glob("*.tmp"))  # written beside, then renamed over


def test_a_new_replay_replaces_an_earlier_result_at_once(models, tmp_path, monkeypatch):
    """The online run deletes DIR/versions of an earlier run; its result.json stayed, describing it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"complete": True, "runs": {"earlier": {}}}))
    _stop_at(monkeypatch, "static")
    with pytest.raises(KeyboardInterrupt):
        _replay(models, tmp_path, ["def f(x):"])
    res = json.loads((run / "result.json").read_text())
    assert res["complete"] is False and res["runs"] == {} and res["requests"] == 1
    monkeypatch.undo()
    assert _replay(models, tmp_path, ["def f(x):"], skip_baselines=True)["complete"] is True
    assert json.loads((run / "result.json").read_text())["complete"] is True


def test_offline_bound_trains_on_at_most_buffer_mb(models, tmp_path, monkeypatch):
    """The static run kept every verified position's distribution of every request for the offline
    bound, whatever --buffer-mb said."""
    seen = []
    real = DistillTrainer.train

    def train(self, records, steps=None, progress=False):
        if progress:  # the offline bound's one call; the online trainer's are quiet
            seen.append(sum(r.nbytes for r in records))
        return real(self, records, steps, progress)

    monkeypatch.setattr(DistillTrainer, "train", train)
    max_bytes = 4000  # a record here: ~4 positions x ~80 ids x 2 bytes + ids, so about two fit
    res = _replay(models, tmp_path, [f"x{i} = [{i}," for i in range(8)], max_bytes=max_bytes)
    off = res["runs"]["offline"]
    assert len(seen) == 1 and 0 < seen[0] <= max_bytes
    assert off["records_offered"] == 8 > off["train_records"] >= 1
    # whatever the online buffer's eviction, the bound keeps a uniform sample (fifo would keep the last domain)
    target, draft, tok = models
    _, buf = replay._static_engine(target, draft, tok, EngineConfig(), BufferConfig(eviction="fifo"), 0)
    assert buf.cfg.eviction == "reservoir"


def test_replay_names_the_line_of_a_too_long_prompt(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load", lambda args: models)
    data = _jsonl(tmp_path / "d.jsonl", ["def f(x):", "x" * 300])
    err = _error(["replay", "--data", data, "--field", "prompt", "--out", str(tmp_path / "run")], capsys)
    assert f"{data}:2" in err and "too long" in err and not (tmp_path / "run").exists()


def test_throughput_while_training_alternates_rounds_and_keeps_medians():
    """One idle and one busy sample gave 12.8-17.8x on a shared host."""
    log, calls = [], [0]

    class Engine:
        def generate(self, prompts, params):
            before = calls[0]
            time.sleep(0.05)  # long enough for a training thread, if one runs, to take steps
            log.append("busy" if calls[0] > before else "idle")
            return [SimpleNamespace(token_ids=[1, 2]) for _ in prompts]

    class Trainer:
        def train(self, records, steps):
            calls[0] += 1
            time.sleep(0.001)
            return [] if calls[0] % 2 else [0.5]  # every other step skipped (a non-finite gradient): not counted

        def revert(self):
            pass

    res = replay.throughput_ratio(Engine(), Trainer(), [], ["a", "b"], SamplingParams())
    assert log == ["idle", "busy"] * 3  # alternating: a slow spell of the host hits both alike
    assert len(res["idle_rounds"]) == len(res["training_rounds"]) == 3 and calls[0] >= 2
    assert res["train_steps_during"] == calls[0] // 2
    assert res["tokens_per_s_idle"] == statistics.median(res["idle_rounds"])
    assert res["ratio"] == pytest.approx(statistics.median(res["training_rounds"]) / statistics.median(res["idle_rounds"]))


def test_bench_refuses_a_too_long_prompt_before_timing(models, monkeypatch):
    """max_tokens beyond the models' positions failed in the engine's runs, after every HF baseline."""
    def timed(*a, **k):
        raise AssertionError("a decoder ran before the inputs were checked")

    monkeypatch.setattr(bench, "hf_generate", timed)
    target, draft, tok = models
    with pytest.raises(ValueError, match="prompt 2: prompt and max_tokens exceed the context"):
        bench.run_bench(target, draft, tok, ["def f(", "x" * 200], max_tokens=100, batch_sizes=(1,), ks=range(1, 2))


def test_bench_measures_costs_at_the_batch_the_engine_runs(models, monkeypatch):
    """c and v were timed at --batch-sizes even with fewer prompts, a batch the engine never ran."""
    batches = []
    real = bench.forward_cost

    def forward_cost(model, batch, *a, **k):
        batches.append(batch)
        return real(model, batch, *a, **{**k, "repeats": 2})

    monkeypatch.setattr(bench, "forward_cost", forward_cost)
    target, draft, tok = models
    rep = bench.run_bench(target, draft, tok, ["def f(", "x = 1"], max_tokens=3, batch_sizes=(4,), ks=range(1, 2),
                          log=lambda s: None)
    assert set(batches) == {2} and rep["summary"]["batch_4"]["rows"] == 2


def test_bench_prints_the_report_before_writing_it(tmp_path, monkeypatch, capsys):
    """A write that failed after the whole run printed nothing: the report was lost."""
    import pathlib

    monkeypatch.setattr(cli, "_load", lambda args: (None, None, None))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: {"summary": "measured"})

    def full_disk(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        f.write('{"prompt": "x"}\n')
    with pytest.raises(SystemExit):
        cli.main(["bench", "--target", str(tmp_path), "--draft", str(tmp_path), "--prompts", str(prompts),
                  "--out", str(tmp_path / "b.json")])
    assert json.loads(capsys.readouterr().out)["summary"] == "measured"


def test_generate_reads_a_prompts_file_with_a_bom(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "hello"}\n')
    assert cli._read_prompts(str(bom)) == ["hello"]


@pytest.mark.parametrize("end", ["\r", "\r\n", "\n"])
def test_generate_reads_any_line_end_and_names_lines_by_it(end, tmp_path, capsys):
    """Read as bytes split on \\n, a file of \\r line ends was one line: "not valid JSON (Extra data)",
    though replay and bootstrap read it (corpus.numbered_lines)."""
    f = tmp_path / "p.jsonl"
    f.write_bytes(end.join(['{"prompt": "a"}', "", '{"prompt": "b"}', ""]).encode())
    assert cli._read_numbered(str(f)) == [(1, "a"), (3, "b")]
    f.write_bytes(end.join(['{"prompt": "a"}', '{"prompt": "caf\xe9"}']).encode("latin-1"))
    assert f"{f}: not UTF-8 text (line 2" in _error(["generate", "--prompts", str(f)], capsys)


@pytest.mark.parametrize("argv", [["generate", "--prompts", "P", "--target", "", "--draft", ""],
                                  ["bench", "--target", " ", "--draft", "d"], ["replay", "--data", "P", "--out", "OUT", "--draft", ""]])
def test_an_empty_model_name_is_refused_not_read_as_the_default_pair(argv, tmp_path, monkeypatch, capsys):
    """--target "" --draft "" (unset shell variables) ran the default pair, building it on a fresh machine."""
    import osd_serve.bootstrap as bootstrap

    monkeypatch.setattr(bootstrap, "build_pair", lambda *a, **kw: pytest.fail("the default pair was used"))
    prompts = _jsonl(tmp_path / "p.jsonl", ["hello"])
    argv = [prompts if a == "P" else str(tmp_path / "run") if a == "OUT" else a for a in argv]
    assert "must not be empty" in _error(argv, capsys)


def test_generate_names_a_prompts_file_that_is_not_utf8(tmp_path, capsys):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert f"{latin}: not UTF-8" in _error(["generate", "--prompts", str(latin)], capsys)


def test_generate_names_the_line_of_a_too_long_prompt(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load", lambda args: models)
    long = _jsonl(tmp_path / "long.jsonl", ["def f(", "", "x" * 300])  # line 3: a blank line is not a prompt
    assert f"{long}:3: prompt is too long" in _error(["generate", "--prompts", long], capsys)


def test_seed_of_the_last_prompt_must_fit(tmp_path, capsys):
    """Prompt i runs with seed + i: 2**63 - 1 with two prompts failed naming a seed never given."""
    two = _jsonl(tmp_path / "two.jsonl", ["a", "b"])
    err = _error(["generate", "--prompts", two, "--seed", str(2**63 - 1)], capsys)
    assert f"--seed {2**63 - 1}" in err


def _replay_argv(tmp_path, monkeypatch) -> list[str]:
    """replay's arguments on a one-record file, with a _load that fails the test if reached."""
    def load(args):
        raise AssertionError("the models loaded before the settings were checked")

    monkeypatch.setattr(cli, "_load", load)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"n": 5, "q": "x"}) + "\n")
    return ["replay", "--data", str(data), "--out", str(tmp_path / "run")]


def test_replay_names_a_template_that_does_not_fit(tmp_path, monkeypatch, capsys):
    base = _replay_argv(tmp_path, monkeypatch)
    assert "--template" in _error([*base, "--template", "{n[0]}"], capsys)  # int is not subscriptable: TypeError
    assert "--template" in _error([*base, "--template", "{q"], capsys)  # a lone '{': ValueError
    # a backslash escape that does not decode: the codec's error named neither the option nor the text
    for bad in ("{q}\\", "{q}\\x4"):
        assert f"--template {bad!r}" in _error([*base, "--template", bad], capsys)


def test_replay_refuses_non_finite_lr_and_tolerance_before_loading(tmp_path, monkeypatch, capsys):
    base = _replay_argv(tmp_path, monkeypatch)
    assert "lr must be finite" in _error([*base, "--lr", "nan"], capsys)
    for tol in ("nan", "inf"):
        assert "tolerance must be finite" in _error([*base, "--guard-tolerance", tol], capsys)


def test_replay_refuses_k_0_before_loading(tmp_path, monkeypatch, capsys):
    """Replay measures acceptance: at k = 0 nothing is drafted, and all three runs reported α None."""
    base = _replay_argv(tmp_path, monkeypatch)
    assert "--num-speculative-tokens" in _error([*base, "--num-speculative-tokens", "0"], capsys)


def test_config_values_must_be_finite():
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="tolerance"):
            GuardConfig(tolerance=bad)
        with pytest.raises(ValueError, match="lr"):
            TrainConfig(lr=bad)



@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full, whose every write fails with ENOSPC")
def test_generate_prints_its_output_when_the_write_fails(models, tmp_path, monkeypatch, capsys):
    """A write to --out that failed after the whole run (a full disk) lost every completion."""
    monkeypatch.setattr(cli, "_load", lambda args: models)
    prompts = _jsonl(tmp_path / "p.jsonl", ["def f(", "x = 1"])
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompts", prompts, "--max-tokens", "3", "--out", "/dev/full"])
    out = capsys.readouterr().out
    assert e.value.code != 0 and "No space left" in str(e.value.code)
    assert [json.loads(x)["prompt"] for x in out.splitlines()] == ["def f(", "x = 1"]


@pytest.mark.parametrize("argv", [["generate", "--prompts", "P", "--dtype", "fp16"],
                                  ["bench", "--draft-dtype", "half"],
                                  ["replay", "--data", "P", "--out", "OUT", "--device", "gpu"]])
def test_dtype_and_device_are_checked_before_the_default_pair_is_built(argv, tmp_path, monkeypatch, capsys):
    """With no --target/--draft a fresh machine first trains the default pair (minutes): a typo in
    --dtype, --draft-dtype or --device must fail before that, not after."""
    import osd_serve.bootstrap as bootstrap

    def build_pair(*a, **kw):
        raise AssertionError("the default pair was built before the options were checked")

    monkeypatch.setattr(bootstrap, "build_pair", build_pair)
    prompts = _jsonl(tmp_path / "p.jsonl", ["hello"])
    argv = [prompts if a == "P" else str(tmp_path / "run") if a == "OUT" else a for a in argv]
    err = _error(argv, capsys)
    assert ("dtype" in err or "device" in err) and "AssertionError" not in err, err


def test_json_nested_too_deeply_names_its_file_and_line(tmp_path, capsys):
    """json's decoder recurses per level: a RecursionError came out as a traceback."""
    from osd_serve.corpus import numbered_records

    deep = '{"prompt": ' + "[" * 100_000 + "}"
    jsonl, arr = tmp_path / "d.jsonl", tmp_path / "d.json"
    jsonl.write_text('{"prompt": "ok"}\n' + deep + "\n")
    arr.write_text(deep)
    assert f"{jsonl}:2: JSON nested too deeply" in _error(["generate", "--prompts", str(jsonl)], capsys)
    for path, where in ((jsonl, f"{jsonl}:2"), (arr, str(arr))):
        with pytest.raises(ValueError, match=f"^{where}: JSON nested too deeply"):
            list(numbered_records(str(path)))


def test_replay_refuses_a_seed_torch_cannot_take_before_any_work(tmp_path, capsys):
    """torch.manual_seed refused it at the trainer's build, after the whole static run, naming nothing."""
    data = _jsonl(tmp_path / "d.jsonl", ["hello"])
    for seed in (2**63, -(2**63) - 1):
        err = _error(["replay", "--data", data, "--out", str(tmp_path / "run"), "--seed", str(seed)], capsys)
        assert "--seed" in err and not (tmp_path / "run").exists()


def test_bench_finds_the_prompts_beside_a_pair_given_with_a_tilde(tmp_path, monkeypatch):
    """bash leaves the ~ of --target=~/pair/target as it is; the loaders expand it, and so must the
    look for the pair's prompts.jsonl."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "pair").mkdir()
    _jsonl(tmp_path / "pair" / "prompts.jsonl", ["one", "two", "three"])
    args = SimpleNamespace(target="~/pair/target", prompts=None, out=None, num_prompts=2)
    assert cli._bench_prompts(args) == ["one", "two"]


def test_a_data_file_whose_name_is_not_utf8_keys_the_cache(tmp_path):
    """Its name holds surrogate escapes, which str.encode refused, naming neither file nor option."""
    from pathlib import Path

    from osd_serve import bootstrap

    path = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"bad\xffname.jsonl"))
    _jsonl(Path(path), ["x"])
    other = _jsonl(tmp_path / "other.jsonl", ["x"])
    names = {bootstrap._cache_name([p], "default", bootstrap.PRESETS["default"]) for p in (path, other)}
    assert len(names) == 2 and all(n.startswith("pair-") for n in names)
