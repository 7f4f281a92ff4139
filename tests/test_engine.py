"""Lossless greedy decoding, draft == target, continuous batching, streaming and stops."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from osd_serve import bench
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine

MAX_TOKENS = 16
NEAR_TIE = bench.NEAR_TIE[torch.float32]  # a logit gap under which batch shapes may flip an argmax


def _prompts(vocab: int, n: int = 50, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # lengths 1..24 so rows in a batch have very different prompt lengths; ids 3.. skip pad/eos/unk
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 24))] for _ in range(n)]


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def count_mismatches(target, prompts, outputs, refs) -> tuple[int, int]:
    """(outputs that differ from the reference greedy decoding, not at a near-tie; those at one)."""
    assert all(len(o) == MAX_TOKENS for o in outputs)  # fixed lengths: every difference is a split
    m = bench.mismatches(target, prompts, outputs, refs)
    return m["differ"] - m["near_ties"], m["near_ties"]


@pytest.fixture(scope="module")
def reference(pair):
    arch, target, draft = pair
    prompts = _prompts(target.config.vocab_size)
    return prompts, [_hf_greedy(target, p, MAX_TOKENS) for p in prompts]


# Batch sizes per k: 1 and 8 at every k, and two of 2..7 each, so every size 1..8 runs per architecture.
BATCH_SIZES = {1: (1, 2, 5, 8), 3: (1, 3, 6, 8), 5: (1, 4, 7, 8), 8: (1, 2, 6, 8)}


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_equals_target(pair, tok, reference, k):
    """50 prompts of lengths 1..24, batch sizes 1..8: output == the target's own greedy decoding."""
    arch, target, draft = pair
    prompts, refs = reference
    mismatches, ties, proposed, accepted = 0, 0, 0, 0
    for bs in BATCH_SIZES[k]:
        eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=bs))
        stats = []
        outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k, ignore_eos=True), stats=stats)
        proposed += sum(s.proposed for s in stats)
        accepted += sum(s.accepted for s in stats)
        m, t = count_mismatches(target, prompts, [o.token_ids for o in outs], refs)
        mismatches, ties = mismatches + m, ties + t
    assert mismatches == 0, f"{arch} k={k}: {mismatches} outputs differ from target greedy decoding"
    assert ties <= 0.02 * 4 * len(prompts), f"{arch} k={k}: {ties} near-ties is not rare"
    # The draft must be neither useless nor perfect, or the rejection/rollback paths go untested.
    assert 0.1 < accepted / proposed < 0.95


def test_mixed_k_in_one_batch_and_joins_between_steps(pair, tok, reference):
    """Rows with k in {0..8} share a batch; new requests join while others are mid-generation."""
    arch, target, draft = pair
    prompts, refs = reference
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4))
    reqs = eng.submit(prompts[:6], [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=i % 9, ignore_eos=True) for i in range(6)])
    steps = 0
    while eng.has_unfinished():
        _, st = eng.step()
        steps += 1
        # Continuous batching: waiting requests fill every free row (the batch ran full whenever some
        # were left waiting), and a finished row leaves at the end of its step.
        assert st.batch_size == 4 or not eng.waiting
        assert not any(r.finished for r in eng.running)
        if steps == 3:  # join mid-run
            reqs += eng.submit(prompts[6:12], [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=(i * 5) % 9, ignore_eos=True) for i in range(6)])
    for r, ref in zip(reqs, refs[:12]):
        assert r.output_ids == ref


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_equal_to_target_accepts_everything(pair, tok, reference, k):
    arch, target, _ = pair
    prompts, _ = reference
    eng = SpecEngine(target, target, tok, EngineConfig(max_batch_size=8))
    stats = []
    outs = eng.generate(prompts[:16], SamplingParams(max_tokens=4 * (k + 1), num_speculative_tokens=k, ignore_eos=True), stats=stats)
    assert sum(s.accepted for s in stats) == sum(s.proposed for s in stats) > 0
    for o in outs:
        assert o.steps == 4  # every target forward yielded k+1 tokens
        assert o.tokens_per_step == k + 1


def test_a_draft_in_another_dtype_keeps_the_output_the_targets(pair, tok, reference):
    """The draft may run in another dtype than the target (ModelConfig.draft_dtype: float32 under a
    bfloat16 target on CPU): greedy output is still the target's own, and sampled rows still run."""
    arch, target, draft = pair
    prompts, refs = reference
    half = copy.deepcopy(draft).to(torch.bfloat16)
    stats = []
    eng = SpecEngine(target, half, tok, EngineConfig(max_batch_size=4))
    outs = eng.generate(prompts[:12], SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=3, ignore_eos=True), stats=stats)
    assert count_mismatches(target, prompts[:12], [o.token_ids for o in outs], refs[:12])[0] == 0
    assert sum(s.accepted for s in stats) > 0  # the bfloat16 draft still agrees with the target
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=3, temperature=0.8, top_p=0.9, seed=i,
                              ignore_eos=True) for i in range(4)]
    assert all(len(o.token_ids) == MAX_TOKENS for o in eng.generate(prompts[:4], sampled))


def test_rows_keep_their_own_acceptance(pair, tok, reference):
    """A batch is never cut to its shortest acceptance: beside a k=0 row (which accepts nothing) and a
    k=1 row, rows drafting with the target itself emit k+1 tokens from every target forward."""
    arch, target, _ = pair
    prompts, refs = reference
    eng = SpecEngine(target, target, tok, EngineConfig(max_batch_size=4))
    params = [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k, ignore_eos=True) for k in (0, 4, 1, 4)]
    outs = eng.generate(prompts[:4], params)
    # 16 tokens: k=0 one per step; k=1 two per step; k=4 three steps of 5, then 1 (max_tokens caps k)
    assert [o.steps for o in outs] == [16, 4, 8, 4]
    assert [o.token_ids for o in outs] == refs[:4]


def test_seeded_request_does_not_depend_on_its_batch(pair, tok, reference):
    """Each sampled request draws from its own seeded generator, only the uniforms it uses: the same
    seed gives the same tokens alone or beside other sampled requests (other seeds, other k, a
    greedy row), and another seed gives other tokens."""
    arch, target, draft = pair
    prompts, _ = reference

    def sampled(seed: int, k: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k, temperature=1.0, seed=seed, ignore_eos=True, **kw)

    alone = SpecEngine(target, draft, tok).generate([prompts[0]], sampled(7, 3))[0].token_ids
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4))
    batch = eng.generate([prompts[1], prompts[0], prompts[2], prompts[3]],
                         [sampled(1, 8), sampled(7, 3), sampled(2, 0, top_k=5), SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=5)])
    assert batch[1].token_ids == alone
    assert SpecEngine(target, draft, tok).generate([prompts[0]], sampled(8, 3))[0].token_ids != alone


def test_sampled_rows_process_p_and_q_alike(pair, tok, reference, monkeypatch):
    """temperature, top-k and top-p reach the draft's q exactly as the target's p (spec.row_probs with
    each row's own params), and every proposal is the inverse-CDF sample of the q verification gets."""
    from osd_serve import spec
    from kernels.verify import inverse_cdf_sample

    arch, target, draft = pair
    prompts, _ = reference
    real_propose, real_accept = spec.propose, spec.accept
    seen = {"q": 0, "p": 0, "filtered": 0}

    def propose(kv, rows, k, vocab, u):
        tokens, probs, logits = real_propose(kv, rows, k, vocab, u)  # [B, k], [B, k, V], [B, k, V]
        if rows.all_greedy:  # the greedy row alone, once the sampled ones ended (EOS): argmax only
            return tokens, probs, logits
        assert probs is not None and torch.equal(probs, spec.row_probs(logits, rows))
        assert torch.equal(tokens, inverse_cdf_sample(probs.flatten(0, 1), u.flatten()).view_as(tokens))
        sampled = probs[rows.temperature > 0]  # [S, k, V]
        seen["filtered"] += int(((sampled == 0).sum(-1) > 0).sum())  # top-k/top-p cut these rows
        seen["q"] += 1
        return tokens, probs, logits

    def accept(logits, rows, draft_tokens, draft_probs, u):
        tokens, n, probs = real_accept(logits, rows, draft_tokens, draft_probs, u)
        if rows.all_greedy:
            return tokens, n, probs
        assert torch.equal(probs, spec.row_probs(logits, rows))  # [B, k+1, V]
        seen["p"] += 1
        return tokens, n, probs

    monkeypatch.setattr(spec, "propose", propose)
    monkeypatch.setattr(spec, "accept", accept)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=3, temperature=0.8, top_p=0.7, seed=1),
        SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=5, temperature=1.2, top_k=5, seed=2),
        SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=2, temperature=1.0, top_k=20, top_p=0.9, seed=3),
        SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=4),
    ]
    SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4)).generate(prompts[:4], params)
    assert seen["p"] >= seen["q"] > 0 and seen["filtered"] > 0  # a last step with k = 0 for all rows proposes nothing


def test_no_draft_past_max_tokens(pair, tok, reference):
    """A row with n tokens left drafts at most n - 1: more could only be thrown away. With the draft
    equal to the target every draft is accepted, so 12 tokens at k=8 are one step of 8 drafts + 1 and
    one of 2 + 1; drafting 8 again in the last step would verify 6 columns for nothing."""
    arch, target, _ = pair
    prompts, _ = reference
    eng = SpecEngine(target, target, tok, EngineConfig(max_batch_size=4))
    stats = []
    outs = eng.generate(prompts[:4], SamplingParams(max_tokens=12, num_speculative_tokens=8, ignore_eos=True), stats=stats)
    assert [(s.batch_size, s.proposed, s.accepted, s.emitted) for s in stats] == [(4, 32, 32, 36), (4, 8, 8, 12)]
    assert [len(o.token_ids) for o in outs] == [12] * 4


def test_batch_one_caches_never_hold_holes_and_greedy_proposals_are_the_argmax(pair, tok, reference, monkeypatch):
    """At batch 1 every rejected column is a suffix, cropped by truncate: a hole would make every later
    forward build a 4D mask (the draft step then cost ~40% more on CPU). The all-greedy propose path
    skips the per-token processing: its tokens must be what row_probs and sampling would give, and it
    returns no q (accept() verifies an all-greedy batch from the tokens alone)."""
    from osd_serve import spec
    from kernels.verify import inverse_cdf_sample

    arch, target, draft = pair
    prompts, refs = reference
    seen = []
    real = spec.propose

    def checked(kv, rows, k, vocab, u):
        tokens, probs, logits = real(kv, rows, k, vocab, u)  # [B, k], [B, k, V], [B, k, V]
        q = spec.row_probs(logits, rows)  # [B, k, V] the general path's processing
        assert probs is None and bool((q.amax(-1) == 1).all())  # greedy: q would be one-hot
        assert torch.equal(tokens, inverse_cdf_sample(q.flatten(0, 1), u.flatten()).view_as(tokens))
        seen.append(k)
        return tokens, probs, logits

    monkeypatch.setattr(spec, "propose", checked)
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=1))
    reqs = eng.submit(prompts[:3], SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=4, ignore_eos=True))
    rejected = 0
    while eng.has_unfinished():
        _, st = eng.step()
        rejected += st.rejected
        if eng.running:
            assert bool(eng._draft_kv.valid.all()) and bool(eng._target_kv.valid.all())
    assert rejected > 0 and len(seen) > 0  # rollbacks happened, and every proposal was checked
    assert [r.output_ids for r in reqs] == refs[:3]


def test_stop_string_eos_and_streaming(tok):
    from tests.conftest import llama, perturbed

    eos = tok.eos_token_id
    target = llama(len(tok), seed=3, eos_id=eos)
    draft = perturbed(target, 0.015)
    prompts = ["def f(x):", "a = 1", "print(", "x"]
    ref_eng = SpecEngine(target, draft, tok)
    full = ref_eng.generate(prompts, SamplingParams(max_tokens=40, num_speculative_tokens=3))
    # Streaming: the deltas of each request concatenate to the final text, and the ids to token_ids.
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=2))
    texts, ids, reasons = {}, {}, {}
    for d in eng.stream(prompts, SamplingParams(max_tokens=40, num_speculative_tokens=3)):
        texts[d.request_id] = texts.get(d.request_id, "") + d.text
        ids[d.request_id] = ids.get(d.request_id, []) + d.token_ids
        if d.finished:
            reasons[d.request_id] = d.finish_reason
    assert [texts[k] for k in sorted(texts)] == [c.text for c in full]
    assert [ids[k] for k in sorted(ids)] == [c.token_ids for c in full]
    for c in full:  # EOS ends generation and is never part of the text
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos
    # A stop string taken from inside an output truncates the text right before it.
    c = next(c for c in full if len(c.text) > 6)
    stop = c.text[3:5]
    # Its token ids end with the token completing it, whatever k (one char per token here).
    for k in (0, 3, 8):
        got = SpecEngine(target, draft, tok).generate([c.prompt], SamplingParams(max_tokens=40, num_speculative_tokens=k, stop=[stop]))[0]
        assert got.finish_reason == "stop" and got.text == c.text[: c.text.find(stop)]
        assert got.token_ids == c.token_ids[: c.text.find(stop) + len(stop)], k


def test_abort_frees_the_row(pair, tok, reference):
    arch, target, draft = pair
    prompts, refs = reference
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4))
    reqs = eng.submit(prompts[:4], SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=2, ignore_eos=True))
    eng.step()
    eng.abort(reqs[1].request_id)
    eng.step()
    assert len(eng.running) == 3 and eng._target_kv.batch_size == 3
    while eng.has_unfinished():
        eng.step()
    assert reqs[1].finish_reason == "abort"
    for i in (0, 2, 3):
        assert reqs[i].output_ids == refs[i]


def test_bad_input_is_rejected_with_the_field_named(tok):
    from tests.conftest import llama

    eng = SpecEngine(llama(len(tok)), llama(len(tok), hidden=32, layers=1), tok, EngineConfig(max_model_len=64))
    for kwargs, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),  # -1 disables, as 0 does (vLLM's spelling); below it is refused
        ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"stop": [""]}, "stop"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("x" * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request([], SamplingParams())


def test_bench_counts_mismatches_and_near_ties(pair, tok, reference, monkeypatch):
    """The bench's lossless column: equal outputs are not counted, a wrong token is a split at a real
    gap (not a near-tie), a shorter output that agrees is length-only."""
    arch, target, _ = pair
    prompts, refs = reference
    wrong = list(refs[1])
    wrong[3] = (wrong[3] + 1) % target.config.vocab_size
    outs = [refs[0], wrong, refs[2][:5]] + refs[3:6]
    got = bench.mismatches(target, prompts[:6], outs, refs[:6])
    gap, _ = bench.divergence(target, prompts[1], refs[1], wrong)
    assert got == {"differ": 2, "near_ties": 0, "max_gap": gap, "length_only": 1}
    assert gap > NEAR_TIE  # peaked logits (conftest): the target really prefers refs[1][3]
    monkeypatch.setitem(bench.NEAR_TIE, torch.float32, gap * 2)
    assert bench.mismatches(target, prompts[:6], outs, refs[:6])["near_ties"] == 1
