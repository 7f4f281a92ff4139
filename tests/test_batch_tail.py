"""benchmarks/batch_tail.py: an engine run split into full steps and the tail, on a tiny pair on the CPU."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks import batch_tail
from tests.conftest import save_pair_dir

PROMPTS = ("def f(x):", "select a from", "x = 1", "import os", "for i in", "class A:")


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    # seed 4: the target's greedy outputs of PROMPTS reach no <eos>, so each request runs its 64 tokens
    return save_pair_dir(tmp_path_factory.mktemp("tailpair"), PROMPTS, seed=4)


def test_each_run_is_split_into_full_steps_tail_prefill_and_the_rest(pair_dir, tmp_path, monkeypatch):
    out = tmp_path / "tail.json"
    monkeypatch.setattr(sys, "argv", ["batch_tail.py", "--pair", str(pair_dir), "--ks", "0", "3", "--rounds", "1",
                                      "--prompts", "6", "--batch", "3", "--dtype", "float32", "--out", str(out)])
    batch_tail.main()
    report = json.loads(out.read_text())
    rows = {r["k"]: r for r in report["rows"]}
    assert report["prompts"] == 6 and report["batch"] == 3 and set(rows) == {0, 3}
    for r in rows.values():
        assert r["tokens"] == 6 * 64 == r["full_tokens"] + r["tail_tokens"]
        assert r["wall_s"] == pytest.approx(r["full_s"] + r["tail_s"] + r["prefill_s"] + r["rest_s"])
        assert 0 < r["full_steps"] <= r["steps"] and r["full_s"] > 0 and r["rest_s"] > 0
    # Plain decoding: one token a row a step, so both waves' rows end together and no step is short of rows
    k0 = rows[0]
    assert k0["steps"] == k0["full_steps"] == 2 * 64 and k0["tail_s"] == 0 and k0["tail_tok_s"] is None
    assert k0["over_k0"] == k0["full_over_k0_full"] == 1.0
    k3 = rows[3]
    # Speculation: the draft's acceptance differs by row, so rows end at different steps, and the last steps
    # run fewer rows than slots (greedy, so the same steps in every run)
    assert k3["full_steps"] < k3["steps"] and 1 <= k3["tail_rows_per_step"] < 3 and k3["tail_tokens"] > 0
    assert k3["tail_share_of_time"] == pytest.approx(k3["tail_s"] / k3["wall_s"])


def test_split_counts_a_step_as_full_only_with_every_slot_busy():
    from osd_serve.engine import StepStats

    def step(rows, emitted, prefill=0.0):
        return StepStats(rows, 0, 0, 0, [], [], emitted, 0.25, 0.5, prefill)

    got = batch_tail.split_run([step(4, 8, prefill=1.0), step(4, 8), step(3, 6), step(1, 2)], batch=4, wall=5.0)
    assert got["full_steps"] == 2 and got["steps"] == 4
    assert (got["full_s"], got["tail_s"], got["prefill_s"]) == (1.5, 1.5, 1.0)
    assert got["rest_s"] == pytest.approx(1.0)
    assert (got["full_tokens"], got["tail_tokens"], got["tail_rows_per_step"]) == (16, 8, 2.0)
