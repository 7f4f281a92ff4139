"""The bench's arithmetic on known numbers: run_bench with every decoder, forward cost and timer faked,
so alpha, best k, the speedup ratios and the analytic S it reports can be checked exactly (the CLI test
on real models checks the report's structure and internal consistency, not which numbers go where)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from osd_serve import bench
from osd_serve.bench_report import summary_table
from tests.conftest import char_tokenizer

MAX_TOKENS = 8
SECONDS = {"a": 4.0, "b": 2.0, "b1": 2.5, "b2": 5.0, 0: 3.2, 1: 2.0, 2: 1.6, "auto": 1.8}


class _Model(torch.nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name, self.head = name, torch.nn.Linear(2, 5, bias=False)
        self.config, self.dtype = SimpleNamespace(_attn_implementation="sdpa"), torch.float32

    def get_output_embeddings(self):
        return self.head


class _Timed(list):
    secs = 0.0


def _outs(name, rows, make):
    out = _Timed(make() for _ in range(rows))
    out.secs = SECONDS[name]
    return out


def _stats(k):
    """Two rows, 4 steps of 4 tokens each: 16 tokens. k=1 accepts everything (alpha 1); at k=2 one row
    accepts both drafts and the other rejects its first, so 8 of 16 proposed are accepted but alpha,
    per tested position, is 8 / (8 + 4) = 2/3."""
    step = lambda p, a, r: SimpleNamespace(proposed=p, accepted=a, rejected=r, batch_size=2, emitted=a + 2,  # noqa: E731
                                           prefill_time=0.1, draft_time=0.2 * max(k, 1), target_time=0.3, auto_k=k)
    if k == 0:
        return [step(0, 0, 0) for _ in range(8)]
    if k == 1:
        return [step(2, 2, 0) for _ in range(4)]
    return [step(4, 2, 1) for _ in range(4)]


@pytest.fixture
def report(monkeypatch):
    class Engine:
        max_model_len, vocab = 100, 5
        policy = SimpleNamespace(cost=lambda b: None, fork=lambda: None)

        def __init__(self, *a, **kw):
            pass

        def generate(self, *a, **kw):
            return []

    def engine_run(target, draft, tok, ids, bs, max_tokens, k, policy=None):
        name = k
        stats = _stats(2 if k == "auto" else k)
        return _outs(name, len(ids), lambda: SimpleNamespace(token_ids=[3] * max_tokens)), stats

    def hf_generate(model, tok, ids, max_tokens, batch, assistant=None):
        return _outs("a" if assistant is None else "b", len(ids), lambda: [3] * max_tokens)

    def hf_matched_k(target, tok, ids, max_tokens, draft, k):
        return _outs(f"b{k}", len(ids), lambda: [3] * max_tokens), None

    def timed(fn):
        out = fn()
        return out, (out[0] if isinstance(out, tuple) else out).secs

    def forward_cost(model, batch, context, vocab, device, repeats=30, tokens=1):
        return 0.1 if model.name == "draft" else 1.0 + 0.1 * (tokens - 1)

    for name, fn in (("SpecEngine", Engine), ("engine_run", engine_run), ("hf_generate", hf_generate),
                     ("hf_matched_k", hf_matched_k), ("timed", timed), ("forward_cost", forward_cost),
                     ("check_inputs", lambda *a: 100), ("hf_assisted_settings", lambda d: {})):
        monkeypatch.setattr(bench, name, fn)
    return bench.run_bench(_Model("target"), _Model("draft"), char_tokenizer(), ["ab", "cd"], max_tokens=MAX_TOKENS,
                           batch_sizes=(2,), ks=range(1, 3), log=lambda s: None)


def _s(alpha, k, c, v=1.0):
    return (1 - alpha ** (k + 1)) / (1 - alpha) / (k * c + v) if alpha < 1 else (k + 1) / (k * c + v)


def test_alpha_is_accepted_over_tested_and_acceptance_rate_accepted_over_proposed(report):
    """alpha (S's per-position acceptance) counts a rejected position, not the drafts after it that
    were never tested; vLLM's acceptance rate divides by all proposed. They differ at k=2 here."""
    k2 = next(r for r in report["results"] if r["name"] == "engine" and r["k"] == 2)
    assert k2["alpha"] == pytest.approx(2 / 3) and k2["acceptance_rate"] == pytest.approx(0.5)
    assert k2["tokens_per_target_forward"] == pytest.approx(2.0) and k2["rows_per_step"] == 2
    assert report["summary"]["batch_2"]["per_k"][1]["alpha"] == 1.0


def test_best_k_is_the_fastest_fixed_k_and_its_ratios_are_the_right_way_up(report):
    """Best k by tokens/s (k=2: 10 tok/s), not by alpha (k=1 has alpha 1); (c)/(a) and (c)/(b) are the
    engine over the baseline, and c and v are draft and k+1-token target costs over a 1-token one."""
    s = report["summary"]["batch_2"]
    assert s["best_k"] == 2 and s["engine_k0_tok_s"] == pytest.approx(5.0) and s["best_engine_tok_s"] == pytest.approx(10.0)
    assert s["c"] == pytest.approx(0.1) and s["verify_cost_at_best_k"] == pytest.approx(1.2)
    assert s["target_alone_tok_s"] == pytest.approx(4.0) and s["hf_assisted_tok_s"] == pytest.approx(8.0)
    # the engine at k=0 (5 tok/s) is not the target alone (4 tok/s): measured/analytic is over the former
    assert s["speedup_vs_target_alone"] == pytest.approx(2.5) and s["speedup_vs_engine_k0"] == pytest.approx(2.0)
    assert s["speedup_vs_hf_assisted"] == pytest.approx(1.25)
    assert s["speedup_vs_hf_assisted_matched_k"] == pytest.approx(10.0 / (16 / 5.0))  # (b, k matched) at k=2
    assert s["alpha_at_best_k"] == pytest.approx(2 / 3)
    assert s["analytic_speedup_at_best_k"] == pytest.approx(_s(2 / 3, 2, 0.1))
    assert s["measured_over_analytic"] == pytest.approx(2.0 / _s(2 / 3, 2, 0.1))
    assert s["measured_over_analytic_measured_v"] == pytest.approx(2.0 / _s(2 / 3, 2, 0.1, 1.2))
    k1 = s["per_k"][1]
    assert k1["analytic_speedup"] == pytest.approx(_s(1.0, 1, 0.1)) and k1["speedup_vs_target_alone"] == pytest.approx(2.0)
    assert k1["tokens_over_expected"] == pytest.approx(2.0 / 2)  # 2 tokens per forward, as alpha 1 at k=1 expects
    k2 = s["per_k"][2]
    # what is left for the loop: measured over S with v and tokens per forward measured, 2.0 x (2c + v) / 2
    assert k2["measured_over_analytic_measured_v_tokens"] == pytest.approx(2.0 * (2 * 0.1 + 1.2) / 2.0)
    assert k2["uncut_tokens_per_target_forward"] == pytest.approx(2.0)  # (8 accepted + 8 rows) / 8 rows
    assert s["auto"]["over_best_k"] == pytest.approx((16 / 1.8) / 10.0)
    assert s["auto"]["over_each_k"][1] == pytest.approx((16 / 1.8) / 8.0)


def test_summary_table_puts_each_number_in_its_column(report):
    """The table's first summary row, column by column: batch, c, best k, alpha, then the tok/s."""
    row = next(ln for ln in summary_table(report, "t").splitlines() if ln.startswith("| 2 | 0.100"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:8] == ["2", "0.100", "2", "0.667", "4.0", "8.0", "5.0", "10.0"]
    assert cells[8:10] == ["2.50", "1.25"] and cells[11] == f"{_s(2 / 3, 2, 0.1):.2f}"


def test_several_reports_print_the_shared_legends_once(report, tmp_path, capsys):
    """benchmarks/ENGINE.md renders 13 reports: each repeated the same column legends (6 lines), which
    pushed the file past 500 lines. One report keeps them; several get them once, above all tables,
    and lose none of their rows."""
    import json

    from osd_serve.bench_report import AUTO_LEGEND, LEGEND, main

    alone = summary_table(report, "t")
    assert all(text in alone for text in [*LEGEND, AUTO_LEGEND] if text)
    bare = summary_table(report, "t", legend=False)
    assert not any(text in bare for text in [*LEGEND, AUTO_LEGEND] if text)
    assert [ln for ln in bare.splitlines() if ln.startswith("|")] == [ln for ln in alone.splitlines() if ln.startswith("|")]
    paths = []
    for name in ("one", "two"):
        (path := tmp_path / f"{name}.json").write_text(json.dumps(report))
        paths.append(str(path))
    main(paths)
    both = capsys.readouterr().out
    assert all(both.count(text) == 1 for text in [*LEGEND, AUTO_LEGEND] if text)
    assert all(summary_table(report, name, legend=False) in both for name in ("one", "two"))
    main(paths[:1])
    assert capsys.readouterr().out.strip() == summary_table(report, "one").strip()


def test_full_batch_auto_is_compared_with_the_fastest_fixed_k(report):
    """Full-batch tok/s counts draft + target time only: k=1 8 tok/s, k=2 (and auto, which ran k=2's
    steps here) 16 / 2.8; "auto ÷ best k" divides by the fastest fixed k, not the slowest."""
    from osd_serve.bench_report import full_batch_over_best_k

    full = {(r["name"], r["k"]): r["full_batch_tok_s"] for r in report["results"] if r["name"].startswith("engine")}
    assert full[("engine", 1)] == pytest.approx(8.0) and full[("engine", 2)] == pytest.approx(16 / 2.8)
    assert full_batch_over_best_k(report, 2) == pytest.approx((16 / 2.8) / 8.0)


def test_the_outputs_column_names_a_split_that_is_not_a_near_tie():
    """A split at a gap of 4.2 (a lossless failure) read "15/16 (0 near-ties, gap ≤ 4.2)"."""
    from osd_serve.bench_report import _outputs

    assert _outputs(16, 16, None) == "16/16"
    assert _outputs(14, 16, {"differ": 2, "near_ties": 2, "max_gap": 0.01, "length_only": 0}) == "14/16 (2 near-ties, gap ≤ 0.01)"
    bad = _outputs(14, 16, {"differ": 2, "near_ties": 1, "max_gap": 4.2, "length_only": 0})
    assert bad == "14/16 (**1 split not at a near-tie, gap up to 4.2: not lossless**; 1 near-tie)"
    assert _outputs(15, 16, {"differ": 1, "near_ties": 0, "max_gap": None, "length_only": 1}) == "15/16 (1 length only)"


class _Logits:
    """A target whose next-token logits are fixed, in the dtype it claims (what bench.mismatches reads)."""

    def __init__(self, logits: list[float], dtype=torch.bfloat16):
        self.dtype, self.device = dtype, "cpu"
        self.logits = torch.tensor(logits, dtype=dtype).float()

    def __call__(self, ids):
        return SimpleNamespace(logits=self.logits.expand(1, ids.shape[1], -1))


def test_a_split_one_bfloat16_step_apart_at_a_large_logit_is_a_near_tie():
    """A bfloat16 step is 0.125 between 16 and 32: a fixed 0.1 called a flip between two tokens one step
    apart there a split 'not at a near-tie: not lossless', for any pair with logits that large."""
    top, runner_up = 30.0, 29.875  # one bfloat16 step apart
    model = _Logits([top, runner_up, 1.0, 0.0])
    got = bench.mismatches(model, [[2]], [[1, 3]], [[0, 3]])
    assert got["near_ties"] == 1 and got["max_gap"] == 0.125
    model = _Logits([top, top - 3 * 0.125, 1.0, 0.0])  # three steps apart: a real preference, not a tie
    got = bench.mismatches(model, [[2]], [[1, 3]], [[0, 3]])
    assert got["near_ties"] == 0 and got["max_gap"] == 0.375


def test_a_split_to_a_low_ranked_token_is_not_a_near_tie_where_the_top_two_are_close():
    """The gap is the split tokens', not the top two's: an output that left the target for its lowest-
    ranked token, where the top two happened to be 0.03 apart, was counted as a numerical tie."""
    model = _Logits([5.0, 4.97, 2.0, -4.0])
    got = bench.mismatches(model, [[2]], [[3]], [[0]])
    assert got["near_ties"] == 0 and got["max_gap"] == pytest.approx(9.0)
    got = bench.mismatches(model, [[2]], [[1]], [[0]])  # the runner-up: a tie
    assert got["near_ties"] == 1 and got["max_gap"] == pytest.approx(0.03, abs=0.02)


def test_hf_assisted_rows_say_the_batch_hf_decoded_at(report):
    """(b) and (b, k matched) run at batch 1 (HF's limit) and are compared at every batch size: their rows
    said only batch_size 2 here, as if HF had decoded two rows at once."""
    rows = [r for r in report["results"] if r["name"].startswith("hf_assisted")]
    assert len(rows) == 3 and all(r["batch_size"] == 2 and r["decoded_at_batch"] == 1 for r in rows)
    assert all(r["decoded_at_batch"] is None for r in report["results"] if not r["name"].startswith("hf_assisted"))
