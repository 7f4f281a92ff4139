"""A prefill computes no logits it never reads (``BatchKV.forward(keep=)``, transformers' logits_to_keep).

Why it matters: a prefill's logits are [B, T, V]. At Qwen2's 152k vocabulary, 4 prompts of 512 tokens
make 1.2 GB of float32 logits, and a 4-layer Qwen2-shaped model prefilled 2.9x faster without them
(benchmarks/results/prefill_logits.jsonl).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.disagg import DraftWorker, ProposeItem, Sampling, TargetVerifier, VerifyItem
from osd_serve.engine import SpecEngine
from osd_serve.kv import BatchKV, make_hole_safe, pad_right
from tests.conftest import gpt2, llama, perturbed
from tests.test_engine import _hf_greedy


class NoKeepLlama(LlamaForCausalLM):
    """A causal LM whose forward takes no logits_to_keep (a custom model, or transformers 4.4x's num_logits_to_keep)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                **kwargs):  # generate()'s own arguments (return_dict, ...); logits_to_keep is not among them
        assert "logits_to_keep" not in kwargs
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, use_cache=use_cache, **kwargs)


def _no_keep(vocab: int) -> NoKeepLlama:
    model = NoKeepLlama(llama(vocab).config)
    model.load_state_dict(llama(vocab).state_dict())
    return model.eval()


class LogitColumns:
    """The widest input the model's lm_head has been given (columns = sequence positions)."""

    def __init__(self, model):
        self.widest = 0
        model.get_output_embeddings().register_forward_hook(self._seen)

    def _seen(self, module, args, out):
        self.widest = max(self.widest, args[0].shape[1])  # hidden [B, T, H]


@pytest.mark.parametrize("keep", [1, 2])
@pytest.mark.parametrize("make", [llama, gpt2, _no_keep], ids=["llama", "gpt2", "no-logits_to_keep"])
def test_keep_returns_the_last_columns_logits(make, keep):
    """keep=n gives the last n columns of the full forward's logits, and leaves the same cache: a second
    forward over holes (rows rolled back by different counts) and right padding agrees too."""
    model = make(40)
    make_hole_safe(model)
    full, cut = BatchKV(model, 3, torch.device("cpu")), BatchKV(model, 3, torch.device("cpu"))
    assert full.keeps_logits == (make is not _no_keep)
    for step, feed in enumerate(([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15]], [[20, 21, 22], [23], [24, 25]])):
        ids, valid = pad_right(feed)  # [3, T]
        want = full.forward(ids, valid)  # [3, T, V]
        got = cut.forward(ids, valid, keep=keep)  # [3, keep, V]
        assert got.shape == (3, keep, 40)
        torch.testing.assert_close(got, want[:, -keep:], rtol=1e-5, atol=1e-5)
        if step == 0:
            for kv in (full, cut):
                kv.truncate(torch.tensor([6, 2, 1]))  # lengths were 7, 3, 1


def test_a_batchkv_reads_its_models_signature_once_per_class(monkeypatch):
    """A disaggregated slab splits into a BatchKV per row whenever its batch changes: inspect.signature
    for each made a split of 256 rows 2.4x slower."""
    import inspect

    import osd_serve.kv as kv_mod

    model = llama(40)
    BatchKV(model, 1, torch.device("cpu"))  # the class's parameters read once
    calls = []
    real = inspect.signature
    monkeypatch.setattr(kv_mod.inspect, "signature", lambda f: calls.append(f) or real(f))
    kvs = [BatchKV(model, 1, torch.device("cpu")) for _ in range(50)]
    assert calls == [] and all(kv.keeps_logits for kv in kvs)


def test_keep_outside_the_inputs_is_refused():
    kv = BatchKV(llama(40), 1, torch.device("cpu"))
    ids, valid = pad_right([[5, 6, 7]])
    for keep in (0, 4):
        with pytest.raises(ValueError, match="keep must be in"):
            kv.forward(ids, valid, keep=keep)
    assert kv.width == 0  # refused before the forward: nothing appended


@pytest.mark.parametrize("make", [llama, _no_keep], ids=["llama", "no-logits_to_keep"])
def test_the_engines_prefill_computes_no_prompt_logits(tok, make):
    """Prompts of 40 and 25 tokens, k=3: the target's lm_head never sees more than k+1 = 4 columns (the
    whole prompt, 39, before), a draft's never more than its 2 pending tokens; output stays the target's greedy decoding."""
    target = make(len(tok))
    draft = perturbed(target, 0.02)
    seen_t, seen_d = LogitColumns(target), LogitColumns(draft)
    prompts = [list(range(3, 43)), list(range(50, 75))]
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=2))
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, num_speculative_tokens=3, ignore_eos=True))
    if make is _no_keep:  # computes them all, as before; the cut is after the model
        assert seen_t.widest == 39
    else:
        assert seen_t.widest == 4 and seen_d.widest <= 2  # the draft's pending tokens: 2 after a bonus
    assert [o.token_ids for o in outs] == [_hf_greedy(target, p, 12) for p in prompts]


def test_a_disaggregated_first_step_computes_no_prompt_logits(tok):
    """A sequence's first propose feeds the draft its whole history and its first verify feeds the
    target the same: they score only its last token on (and the k drafts)."""
    target = llama(len(tok))
    draft = perturbed(target, 0.02)
    seen_t, seen_d = LogitColumns(target), LogitColumns(draft)
    vocab = target.config.vocab_size
    worker, verifier = DraftWorker(draft, vocab, ahead=False), TargetVerifier(target, vocab)
    hist = [list(range(3, 43)), list(range(50, 60))]
    items = [ProposeItem(f"s{i}", h, 3, Sampling()) for i, h in enumerate(hist)]
    props = worker.propose(items)
    verdicts, _ = verifier.verify([VerifyItem(f"s{i}", h, p.tokens, None, Sampling()) for i, (h, p) in
                                   enumerate(zip(hist, props))])
    # The draft's first forward keeps from the shorter row's last input on (10 - 1 = column 9 of 40);
    # the target's from the shorter row's last history token on, with the longer row's k drafts
    assert seen_d.widest == 40 - 9 and seen_t.widest == 43 - 9
    for h, v in zip(hist, verdicts):  # each verdict's first token is the target's own greedy choice
        assert v.tokens[0] == _hf_greedy(target, h, 1)[0]
