"""`osd-serve bench` at its edges, in-process on conftest's tiny models (no bootstrap): prompts near the
pair's positions, a bad prompts file or batch list, and what the bench leaves open."""

from __future__ import annotations

import warnings

from osd_serve import bench, cli
from tests.conftest import char_tokenizer, gpt2, llama, perturbed
from tests.test_cli_inputs import _error


def _quick_costs(monkeypatch) -> None:
    """forward_cost with 2 timed forwards, not 30: these tests check what is run, not its speed."""
    real = bench.forward_cost
    monkeypatch.setattr(bench, "forward_cost", lambda model, batch, *a, **k: real(model, batch, *a, **{**k, "repeats": 2}))


def test_bench_measures_costs_within_the_pairs_positions(monkeypatch):
    """c and v were timed on a cache of median prompt + max_tokens/2 tokens plus k+1 more, whatever the
    pair's positions: a prompt that check_inputs let through (252 + 4 <= 256) ran every decoder, then
    the k=2 verification cost reached position 256 of GPT-2's 256 (IndexError, after the whole round)."""
    _quick_costs(monkeypatch)
    tok = char_tokenizer()
    target = gpt2(len(tok), seed=0)  # n_positions 256: learned positions, no room past them
    rep = bench.run_bench(target, perturbed(target, 0.015), tok, ["x" * 252], max_tokens=4, batch_sizes=(1,),
                          ks=range(1, 3), log=lambda s: None)
    assert rep["summary"]["batch_1"]["per_k"][2]["verify_cost"] > 0


def test_bench_warm_up_fits_a_small_max_tokens(monkeypatch):
    """The warm-up generated 4 tokens whatever --max-tokens was: a prompt that fits with max_tokens 3
    (253 + 3 <= 256) failed there as too long, after check_inputs had passed it."""
    _quick_costs(monkeypatch)
    tok = char_tokenizer()
    target = llama(len(tok), seed=0)
    rep = bench.run_bench(target, perturbed(target, 0.015), tok, ["x" * 253], max_tokens=3, batch_sizes=(1,),
                          ks=range(1, 2), log=lambda s: None)
    assert rep["summary"]["batch_1"]["per_k"][1]["tok_s"] > 0


def test_bench_reads_its_prompts_before_loading_the_pair(tmp_path, monkeypatch, capsys):
    """A missing, empty or absent prompts file was found only once the pair had loaded (a 7B pair: a
    minute), unlike generate's."""
    def load(args):
        raise AssertionError("the models loaded before the prompts were read")

    monkeypatch.setattr(cli, "_load", load)
    pair = ["bench", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d")]
    assert "No such file" in _error([*pair, "--prompts", str(tmp_path / "missing.jsonl")], capsys)
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "holds no prompts" in _error([*pair, "--prompts", str(tmp_path / "empty.jsonl")], capsys)
    assert "--prompts FILE.jsonl is needed" in _error(pair, capsys)  # no prompts.jsonl beside this pair
    # and with the default pair, before it is built (or loaded)
    assert "No such file" in _error(["bench", "--prompts", str(tmp_path / "missing.jsonl")], capsys)


def test_bench_refuses_a_repeated_batch_size(monkeypatch, capsys):
    """--batch-sizes 1,1 ran the whole bench twice: results held both runs, the summary only the last."""
    def load(args):
        raise AssertionError("the models loaded before --batch-sizes was checked")

    monkeypatch.setattr(cli, "_load", load)
    assert "--batch-sizes" in _error(["bench", "--batch-sizes", "1,8,1"], capsys)


def test_cpu_info_closes_proc_cpuinfo():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bench.cpu_info()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_hf_baselines_decode_greedily_whatever_the_generation_config():
    """(a) and (b) are greedy, as the engine: a target whose generation config sets a repetition penalty
    (Qwen2.5-Instruct's: 1.05) had HF apply it, and the engine's lossless outputs then "differed" from
    the target alone at large logit gaps."""
    from osd_serve.bench_hf import hf_generate
    from osd_serve.config import SamplingParams
    from osd_serve.engine import SpecEngine

    tok = char_tokenizer()
    target = llama(len(tok), seed=0)
    draft = perturbed(target, 0.015)
    ids = [tok.encode("def f(x):"), tok.encode("x = [1,")]
    greedy = [o.token_ids for o in SpecEngine(target, draft, tok).generate(ids, SamplingParams(max_tokens=12))]
    assert hf_generate(target, tok, ids, 12, 2) == greedy
    gc = target.generation_config
    gc.repetition_penalty, gc.no_repeat_ngram_size = 10.0, 1
    assert hf_generate(target, tok, ids, 12, 2) == greedy
    assert hf_generate(target, tok, ids, 12, 1, assistant=draft) == greedy
    assert (target.generation_config.repetition_penalty, target.generation_config.no_repeat_ngram_size) == (10.0, 1)


def test_bench_refuses_to_write_its_report_over_its_prompts(tmp_path, monkeypatch, capsys):
    """--out naming the --prompts file (or a link to it) replaced the prompts with the report, after the
    whole run; generate refused it already. Refused before the pair loads."""
    def load(args):
        raise AssertionError("the models loaded before --out was checked against --prompts")

    monkeypatch.setattr(cli, "_load", load)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    (tmp_path / "link.jsonl").symlink_to(prompts)
    for out in (prompts, tmp_path / "link.jsonl"):
        assert "is the --prompts file" in _error(["bench", "--prompts", str(prompts), "--out", str(out)], capsys)
    assert prompts.read_text() == '{"prompt": "x"}\n'
    # the prompts.jsonl beside a bootstrapped pair, read when --prompts is not given
    pair = ["bench", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d")]
    beside = tmp_path / "prompts.jsonl"
    beside.write_text('{"prompt": "y"}\n')
    assert "the pair's prompts" in _error([*pair, "--out", str(beside)], capsys)
    assert beside.read_text() == '{"prompt": "y"}\n'
