"""The command line end to end on the tiny preset: bootstrap, generate, bench."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys

import pytest
import torch

from osd_serve.bench_report import full_batch_over_best_k, summary_table


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "osd_serve.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("osd")
    r = _cli("bootstrap", "--preset", "tiny", "--out", str(root))
    assert r.returncode == 0, r.stderr
    pair = json.loads(r.stdout.strip().splitlines()[-1])  # the last line printed is the JSON
    return root, pair


def test_bootstrap_prints_pair_json_and_is_cached(tiny_pair):
    root, pair = tiny_pair
    r = _cli("bootstrap", "--preset", "tiny", "--out", str(root))
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1]) == pair


def test_generate_writes_one_line_per_prompt(tiny_pair, tmp_path):
    _, pair = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(", "import os", "x = [1,"]))
    out = tmp_path / "out.jsonl"
    r = _cli("generate", "--target", pair["target"], "--draft", pair["draft"], "--prompts", str(prompts),
             "--max-tokens", "6", "--num-speculative-tokens", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["def f(", "import os", "x = [1,"]
    for x in lines:
        assert set(x) >= {"prompt", "text", "token_ids", "proposed", "accepted"}
        assert 1 <= len(x["token_ids"]) <= 6 and 0 <= x["accepted"] <= x["proposed"]


def test_generate_names_bad_input(tiny_pair, tmp_path):
    _, pair = tiny_pair
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    r = _cli("generate", "--target", pair["target"], "--draft", pair["draft"], "--prompts", str(bad))
    assert r.returncode != 0 and "prompt" in r.stderr
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "x"}\n')
    r = _cli("generate", "--target", pair["target"], "--draft", pair["draft"], "--prompts", str(good), "--top-p", "0")
    assert r.returncode != 0 and "top_p" in r.stderr
    r = _cli("generate", "--target", pair["target"], "--draft", pair["draft"], "--prompts", str(good), "--draft-dtype", "int8")
    assert r.returncode != 0 and "draft_dtype must be one of" in r.stderr  # the option reaches ModelConfig


def test_bench_report_is_complete_and_lossless(tiny_pair, tmp_path):
    """Structure only: speed is measured by running the bench, not by tests. Losslessness is pinned in
    test_engine.py; the tiny preset's 4-step models have near-flat logits, where batched HF generate and
    any other decoder may break float near-ties differently, so it is not asserted on them here."""
    _, pair = tiny_pair
    out = tmp_path / "bench.json"
    # The tiny build keeps a single held-out prompt; batch 2 needs more than one row to batch.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(3)))
    r = _cli("bench", "--target", pair["target"], "--draft", pair["draft"], "--prompts", str(prompts),
             "--num-prompts", "3", "--max-tokens", "6",
             "--batch-sizes", "1,2", "--max-k", "2", "--repeats", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["dtype"] == rep["draft_dtype"] == "float32" and rep["prompts"] == 3
    # a draft in another dtype than the target is named in the table's header, the same one is not
    assert "(draft" not in summary_table(rep, "t") and "bfloat16 (draft float32)" in summary_table(
        rep | {"dtype": "bfloat16"}, "t")
    # what was measured: the code (a clone of this repository has its commit), the attention path, no GPU
    assert rep["code"]["git"] and rep["code"]["torch"] == torch.__version__
    assert rep["gpu"] is None and rep["attn_implementation"] == "sdpa"
    assert rep["hf_assisted_settings"]["num_assistant_tokens"] >= 1  # HF's own drafting rule, whatever the engine's k
    assert "HF assisted tok/s (batch 1)" in summary_table(rep, "t")  # HF assists one prompt at a time
    if sys.platform == "linux":  # the host is recorded: reports from different CPUs are not comparable
        assert rep["cpu"]["model"] and set(rep["cpu"]["bf16_flags"]) <= {"avx512_bf16", "amx_bf16", "amx_tile"}
    for bs in ("batch_1", "batch_2"):
        s = rep["summary"][bs]
        assert s["c"] > 0 and s["target_alone_tok_s"] > 0 and s["hf_assisted_tok_s"] > 0 and s["hf_assisted_batch_size"] == 1
        for k in ("1", "2"):
            r = s["per_k"][k]
            assert 0 <= r["outputs_match_target"] <= 3 and 0 <= r["alpha"] <= 1
            assert r["mismatch"]["differ"] == rep["prompts"] - r["outputs_match_target"]
            assert 1 <= r["rows_per_step"] <= int(bs[-1])
            assert 1.0 <= r["tokens_per_target_forward"] <= int(k) + 1 and r["analytic_speedup"] > 0
            # S(v) is the same formula with the measured verification cost in place of 1
            tokens = (1 - r["alpha"] ** (int(k) + 1)) / (1 - r["alpha"]) if r["alpha"] < 1 else int(k) + 1
            assert r["verify_cost"] > 0
            assert r["analytic_speedup_measured_v"] == pytest.approx(tokens / (int(k) * s["c"] + r["verify_cost"]))
            assert 0 < r["prefill_share"] < 1 and r["measured_decode_only_over_analytic"] > 0
            # measured/analytic factors exactly into acceptance model x verification cost x loop
            assert r["tokens_over_expected"] == pytest.approx(r["tokens_per_target_forward"] / tokens)
            assert 1.0 <= r["uncut_tokens_per_target_forward"] <= int(k) + 1  # 6 tokens at k<=2: the first step is uncut
            assert r["uncut_tokens_over_expected"] == pytest.approx(r["uncut_tokens_per_target_forward"] / tokens)
            assert r["measured_over_analytic"] == pytest.approx(
                r["tokens_over_expected"] * (int(k) * s["c"] + 1) / (int(k) * s["c"] + r["verify_cost"])
                * r["measured_over_analytic_measured_v_tokens"])
            assert r["full_batch_measured_over_analytic"] > 0  # the first step of 3 prompts runs a full batch
            assert r["speedup_vs_hf_assisted_matched_k"] == pytest.approx(r["tok_s"] / r["hf_assisted_matched_k_tok_s"])
            # the loop's own time is what the forwards and prefill leave of the run
            assert 0 < r["loop_share"] < 1 - r["prefill_share"] and r["first_round_over_median"] > 0
        # HF assists at batch 1 whatever the size: timed once, in the first size's rounds
        assert s["hf_assisted_tok_s"] == rep["summary"]["batch_1"]["hf_assisted_tok_s"]
        res = {(x["name"], x["k"]): x for x in rep["results"] if x["batch_size"] == int(bs[-1])}
        best, k0 = res[("engine", s["best_k"])], res[("engine_k0", 0)]
        # every decoder keeps all its rounds, and its seconds are their median
        assert all(len(x["round_seconds"]) == 2 and x["seconds"] == pytest.approx(statistics.median(x["round_seconds"]))
                   for x in res.values())
        decode = best["tokens"] / (best["seconds"] - best["prefill_seconds"])
        decode0 = k0["tokens"] / (k0["seconds"] - k0["prefill_seconds"])
        assert s["measured_decode_only_over_analytic"] == pytest.approx(decode / decode0 / s["analytic_speedup_at_best_k"])
        assert s["tokens_over_expected_at_best_k"] == s["per_k"][str(s["best_k"])]["tokens_over_expected"]
        # k = auto, in the same rounds: its steps chose among the bench's ks, its ratios are of this run
        a, auto = s["auto"], res[("engine_auto", None)]
        assert set(a["k_steps"]) <= {"1", "2"} and sum(a["k_steps"].values()) > 0
        assert a["over_best_k"] == pytest.approx(auto["tokens_per_s"] / s["best_engine_tok_s"])
        assert a["over_each_k"]["2"] == pytest.approx(auto["tokens_per_s"] / s["per_k"]["2"]["tok_s"])
        assert 0 <= a["outputs_match_target"] <= 3 and len(auto["round_seconds"]) == 2
        fixed = [x["full_batch_tok_s"] for (name, _), x in res.items() if name == "engine"]
        assert full_batch_over_best_k(rep, int(bs[-1])) == pytest.approx(auto["full_batch_tok_s"] / max(fixed))
    assert "k = auto" in summary_table(rep, "t")


def test_replay_writes_result_and_figure(tiny_pair, tmp_path):
    """Structure of `osd-serve replay` (the distillation itself is tested in test_distill.py)."""
    _, pair = tiny_pair
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": f"def f{i}(x):"}) + "\n" for i in range(6)))
    other = tmp_path / "a.json"
    other.write_text(json.dumps([{"instruction": f"import m{i}"} for i in range(6)]))
    out = tmp_path / "run"
    r = _cli("replay", "--target", pair["target"], "--draft", pair["draft"], "--data", str(data), str(other),
             "--field", "question,instruction", "--max-requests", "8", "--max-tokens", "6", "--trigger-records", "2",
             "--steps-per-update", "2", "--offline-epochs", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "result.json").read_text())
    assert (out / "alpha.png").stat().st_size > 0 and res["complete"] is True
    assert res["sources"] == ["q.jsonl"] * 4 + ["a.json"] * 4  # sequential order: a shift
    for name in ("static", "offline", "online"):
        run = res["runs"][name]
        assert len(run["per_request"]) == 8 and len(run["running_mean_alpha"]) == 8 and run["wall_s"] > 0
        assert set(run["per_request"][0]) >= {"acceptance", "expected_acceptance", "tokens_per_target_forward", "draft_version"}
    assert res["runs"]["online"]["updates"] >= 1
    # the online run's loss curve is its updates' steps (2 each), not also the throughput check's
    assert len(res["runs"]["online"]["loss_curve"]) == 2 * res["runs"]["online"]["updates"]
    assert 0 < res["throughput_while_training"]["ratio"]
    assert res["draft_unchanged"] and res["outputs_identical"] in (True, False)
    one = _cli("replay", "--target", pair["target"], "--draft", pair["draft"], "--data", str(data), "--field", "question",
               "--max-requests", "2", "--max-tokens", "4", "--online-only", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    assert json.loads((tmp_path / "one" / "result.json").read_text())["outputs_identical"] is None  # one run: nothing compared
    bad = _cli("replay", "--target", pair["target"], "--draft", pair["draft"], "--data", str(data), "--field", "nope",
               "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "nope" in bad.stderr
    # Training settings fail before the static run, not in the first update (with --online-only
    # that error was swallowed by the training thread and the run exited 0).
    for opt, val, msg in (("--chunk-size", "-1", "chunk_size"), ("--beta", "2", "beta")):
        late = _cli("replay", "--target", pair["target"], "--draft", pair["draft"], "--data", str(data),
                    "--loss", "jsd" if opt == "--beta" else "forward_kl", opt, val, "--out", str(tmp_path / "late"))
        assert late.returncode != 0 and msg in late.stderr and "static" not in late.stderr


def test_analytic_speedup_formula():
    """Leviathan et al.'s S, with v = 1 (the paper) and with a measured verification cost."""
    from osd_serve.bench import analytic_speedup

    expected_tokens = (1 - 0.5**4) / (1 - 0.5)  # 1.875 tokens per step at α = 0.5, k = 3
    assert analytic_speedup(0.5, 3, 0.1) == pytest.approx(expected_tokens / 1.3)
    assert analytic_speedup(0.5, 3, 0.1, verify_cost=2.0) == pytest.approx(expected_tokens / 2.3)
    assert analytic_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)


def test_bad_options_and_paths_are_one_line_errors(tmp_path, capsys):
    """Checked before any work, named, and never a traceback (in-process: no model is loaded)."""
    from osd_serve.cli import main

    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "x"}\n')
    pair = ["--target", str(tmp_path), "--draft", str(tmp_path)]
    cases = [
        (["bench", "--max-k", "0"], "--max-k: must be >= 1"),
        (["bench", "--max-k", "17"], "--max-k: must be <= 16"),  # the engine refused it after the HF baselines
        (["bench", "--max-tokens", "1"], "--max-tokens: must be >= 2"),  # nothing drafted: it failed after the whole run
        (["bench", "--batch-sizes", "1,x"], "--batch-sizes: expected an integer"),
        (["generate", "--prompts", str(good), "--max-tokens", "-1"], "--max-tokens: must be >= 1"),
        (["generate", "--prompts", str(good), "--out", str(tmp_path / "no" / "o.jsonl")], "does not exist"),
        # a directory passed the parent check: the whole run, then a failed write
        (["generate", "--prompts", str(good), "--out", str(tmp_path), *pair], f"--out {tmp_path} is a directory"),
        (["bench", "--prompts", str(good), "--out", str(tmp_path), *pair], f"--out {tmp_path} is a directory"),
        (["generate", "--prompts", str(tmp_path / "missing.jsonl")], "No such file"),
        (["generate", "--prompts", str(good), "--device", "bogus", *pair], "device must be auto, cpu, cuda or cuda:N"),
        (["bootstrap", "--data", str(tmp_path)], "not a regular file"),
    ]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err + str(e.value.code)
        assert e.value.code != 0 and msg in err and "Traceback" not in err, (argv, err)


def test_hf_assisted_with_k_matched_drafts_exactly_k():
    """(b, k matched): HF assisted generation drafting the engine's k each step (HF's defaults draft up
    to 20 and stop below confidence 0.4), and the draft's own settings restored afterwards."""
    from osd_serve.bench_hf import hf_drafting as _hf_drafting
    from osd_serve.bench_hf import hf_generate as _hf_generate
    from tests.conftest import char_tokenizer, llama

    tok = char_tokenizer()
    target, draft = llama(len(tok), seed=0), llama(len(tok), seed=0)  # the draft is the target: every token accepted
    calls = []
    target.register_forward_hook(lambda m, i, o: calls.append(1))

    def steps(k=None):
        calls.clear()
        with _hf_drafting(draft, k) if k else contextlib.nullcontext():
            out = _hf_generate(target, tok, [[5, 6, 7]], 24, 1, assistant=draft)
        assert len(out[0]) == 24 and draft.generation_config.num_assistant_tokens is None
        return len(calls)

    matched = steps(3)
    assert 6 <= matched <= 7  # 24 tokens at 4 a step (3 drafted, all accepted, + 1), plus the prefill
    assert steps() > matched  # HF's default stops drafting below confidence 0.4: this flat draft drafts 1 a step
