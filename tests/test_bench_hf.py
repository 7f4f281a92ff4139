"""The bench's HF baselines (bench_hf.py): EOS kept as the engine keeps it, assisted generation one
prompt at a time whatever the batch, and (b, k matched) drafting exactly k with HF's settings restored."""

from __future__ import annotations

from osd_serve.bench_hf import hf_drafting, hf_generate
from osd_serve.config import SamplingParams
from osd_serve.engine import SpecEngine
from tests.conftest import char_tokenizer, llama, perturbed


def test_hf_outputs_end_with_eos_as_the_engines_do_and_assist_one_prompt_at_a_time():
    """Outputs are compared with the engine's token_ids, which keep the EOS: cutting HF's before it made
    every output that stopped "differ". Assisted generation is batch 1 in transformers: a batch of 2
    must still run (per prompt), not fail the bench at its batch-8 size."""
    tok = char_tokenizer()
    eos = tok.eos_token_id
    target = llama(len(tok), seed=3, eos_id=eos)  # the seed test_engine's stop/EOS test uses: some outputs stop
    draft = perturbed(target, 0.015)
    ids = [tok.encode(p) for p in ("def f(x):", "a = 1", "print(", "x")]
    ref = [o.token_ids for o in SpecEngine(target, draft, tok).generate(ids, SamplingParams(max_tokens=40))]
    assert any(r[-1] == eos for r in ref)
    assert hf_generate(target, tok, ids, 40, 4) == ref
    assert hf_generate(target, tok, ids, 40, 2, assistant=draft) == ref


def test_matched_k_drafting_is_exactly_k_and_restores_the_drafts_settings():
    tok = char_tokenizer()
    draft = llama(len(tok), seed=0)
    gc = draft.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = 20, "heuristic", 0.4
    with hf_drafting(draft, 3):
        assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold) == (3, "constant", 0.0)
    assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold) == (20, "heuristic", 0.4)


def test_each_assisted_call_starts_from_the_drafts_own_settings():
    """Under a "heuristic" schedule transformers writes a call's final num_assistant_tokens back into the
    draft's config: (b) drafted by what the warm-up and earlier prompts left, and the report showed that."""
    from osd_serve.bench_hf import hf_assisted_settings

    tok = char_tokenizer()
    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.015)  # good enough that the heuristic grows the number it drafts
    gc = draft.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = 5, "heuristic"
    before = hf_assisted_settings(draft)
    ids = [tok.encode(p) for p in ("def f(x):", "a = 1")]
    first = hf_generate(target, tok, ids, 24, 1, assistant=draft)
    assert hf_assisted_settings(draft) == before and gc.num_assistant_tokens == 5
    assert hf_generate(target, tok, ids, 24, 1, assistant=draft) == first
