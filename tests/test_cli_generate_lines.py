"""What `osd-serve generate` writes, field by field, against the engine run directly on the same
prompts: text, token ids, finish reason, the per-prompt seed, and the run's summary acceptance."""

from __future__ import annotations

import json

import pytest

from osd_serve import cli
from osd_serve.config import SamplingParams
from osd_serve.engine import SpecEngine
from tests.test_cli_inputs import _jsonl, models  # noqa: F401  (models: the fixture)

PROMPTS = ["def f(", "x = 1", "import os"]


def test_generate_lines_are_the_engines_completions(models, tmp_path, monkeypatch, capsys):
    """Each line: the prompt, the generated text only (not the prompt again), the generated ids and
    the finish reason, as the engine returns them; the summary's acceptance is accepted over proposed."""
    monkeypatch.setattr(cli, "_load", lambda args: models)
    out = tmp_path / "o.jsonl"
    cli.main(["generate", "--prompts", _jsonl(tmp_path / "p.jsonl", PROMPTS), "--max-tokens", "6",
              "--num-speculative-tokens", "2", "--out", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    refs = SpecEngine(*models).generate(PROMPTS, SamplingParams(max_tokens=6, num_speculative_tokens=2))
    assert [x["prompt"] for x in lines] == PROMPTS
    assert [x["text"] for x in lines] == [c.text for c in refs]
    assert [x["token_ids"] for x in lines] == [c.token_ids for c in refs]
    assert [x["finish_reason"] for x in lines] == [c.finish_reason for c in refs]
    assert all(x["finish_reason"] in ("stop", "length") for x in lines)
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    proposed, accepted = sum(x["proposed"] for x in lines), sum(x["accepted"] for x in lines)
    assert proposed > accepted > 0  # a perturbed draft: some drafts rejected, so the ratio is not trivial
    assert summary == {"out": str(out), "prompts": 3, "acceptance": pytest.approx(accepted / proposed)}


def test_generate_samples_prompt_i_with_seed_plus_i(models, tmp_path, monkeypatch, capsys):
    """--seed is the first prompt's seed; prompt i uses seed + i (so repeated prompts are sampled
    independently, and any one line can be reproduced alone)."""
    monkeypatch.setattr(cli, "_load", lambda args: models)
    same = ["x = 1"] * 3
    cli.main(["generate", "--prompts", _jsonl(tmp_path / "p.jsonl", same), "--max-tokens", "8",
              "--temperature", "1.0", "--seed", "7"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    refs = [SpecEngine(*models).generate(same[:1], SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i))[0].token_ids
            for i in range(3)]
    assert len({tuple(r) for r in refs}) > 1  # the seeds give different samples, so the check below can tell
    assert [x["token_ids"] for x in lines] == refs


def test_the_largest_seed_that_fits_every_prompt_is_accepted():
    """seed + n - 1 must be below 2**63: the bound itself is allowed, one past it is not."""
    cli._check_seed_range(2**63 - 2, 2)  # prompts use 2**63 - 2 and 2**63 - 1
    cli._check_seed_range(2**63 - 1, 1)
    cli._check_seed_range(None, 10**6)
    with pytest.raises(SystemExit, match=f"--seed {2**63 - 2}"):
        cli._check_seed_range(2**63 - 2, 3)


def test_generate_logprobs_are_the_engines(models, tmp_path, monkeypatch, capsys):
    """--logprobs N: each line carries its tokens' logprobs and N alternatives, as the chat API renders them;
    without it a line has no such key, and a count past 20 is a usage error before anything loads."""
    from osd_serve.logprobs import render

    monkeypatch.setattr(cli, "_load", lambda args: models)
    out = tmp_path / "o.jsonl"
    cli.main(["generate", "--prompts", _jsonl(tmp_path / "p.jsonl", PROMPTS), "--max-tokens", "6", "--logprobs", "2",
              "--out", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    refs = SpecEngine(*models).generate(PROMPTS, SamplingParams(max_tokens=6, logprobs=2))
    for line, c in zip(lines, refs):
        assert len(line["logprobs"]) == len(line["token_ids"]) and all(len(e["top_logprobs"]) == 2 for e in line["logprobs"])
        want = render(models[2], c.token_ids, c.logprobs)
        assert [e["token"] for e in line["logprobs"]] == [e["token"] for e in want]
        assert [e["logprob"] for e in line["logprobs"]] == pytest.approx([e["logprob"] for e in want], abs=1e-5)
    cli.main(["generate", "--prompts", _jsonl(tmp_path / "p.jsonl", PROMPTS), "--max-tokens", "2", "--out", str(out)])
    assert all("logprobs" not in json.loads(x) for x in out.read_text().splitlines())
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompts", str(tmp_path / "p.jsonl"), "--logprobs", "21"])
    assert e.value.code == 2 and "--logprobs" in capsys.readouterr().err
