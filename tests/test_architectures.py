"""Architectures beyond the Llama and GPT-2 tests: models whose keys and values differ in width (MLA),
models that keep no key/value cache or a recurrent one (refused when the engine is built, not at the
first request), and longrope models, capped where their positions stop depending on the batch."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.kv import BatchKV, make_hole_safe
from osd_serve.loading import max_positions
from tests.conftest import llama, perturbed
from tests.test_engine import _hf_greedy, _prompts

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=None, eos_token_id=None)


def _model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    m = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the default init: peaked logits, no near-ties
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3 / max(1.0, p.shape[-1] / 64) ** 0.5)
    return m


def _greedy_matches(target, draft, tok, prompts, n, batch, k, **engine):
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=batch, **engine))
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0, num_speculative_tokens=k, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_hf_greedy(target, p, n) for p in prompts]
    return eng


def test_keys_and_values_of_different_widths_are_cached_losslessly(tok):
    """DeepSeek-V2/V3, GLM-4-MoE-Lite and MiniCPM3 (MLA) cache a 16-wide latent as keys and an 8-wide
    rotary part as values: the cache sized both from the keys and every request failed; compaction and
    merges used the keys' shape for values too."""
    cfg = T.DeepseekV3Config(vocab_size=len(tok), num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                             topk_group=1, **SMALL)
    target = _model(cfg)
    draft = perturbed(target, 0.02)
    prompts = _prompts(len(tok), n=6, seed=4)
    for batch, k in ((1, 3), (4, 1), (4, 5)):  # batch 4: holes, compacted as soon as they pass 5% of the columns
        _greedy_matches(target, draft, tok, prompts, 12, batch, k, compact_hole_fraction=0.05)
    # a merge of a part without a cache (a row never fed) takes each tensor's own width
    a = BatchKV(target, 1, torch.device("cpu"))
    a.forward(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool))
    merged = BatchKV.merge(target, torch.device("cpu"), [a, BatchKV(target, 1, torch.device("cpu"))])
    lay = merged.cache.layers[0]
    assert lay.keys.shape[0] == lay.values.shape[0] == 2 and lay.keys.shape[-1] != lay.values.shape[-1]


def test_models_without_a_rollback_cache_are_refused_when_the_engine_is_built(tok):
    """OpenAI-GPT takes no past_key_values: the engine's cache was ignored, so each forward saw only its own
    inputs (other tokens than the target's, or a crash deep in a step). Recurrent and hybrid models (Jamba)
    were refused only at the first request, after a server had started healthy."""
    gpt = _model(T.OpenAIGPTConfig(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=256))
    with pytest.raises(ValueError, match="'openai-gpt' is not supported: its forward takes no past_key_values"):
        SpecEngine(gpt, gpt, tok, EngineConfig())
    jamba = _model(T.JambaConfig(vocab_size=len(tok), num_key_value_heads=2, num_experts=2, attn_layer_period=2,
                                 attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                                 mamba_dt_rank=8, use_mamba_kernels=False, **SMALL))
    with pytest.raises(ValueError, match="'jamba' is not supported: its LinearAttentionLayer cache layers are no plain key/value columns"):
        SpecEngine(jamba, jamba, tok, EngineConfig())


def test_a_lora_wrapped_or_compiled_model_passes_the_cache_check(tok):
    """peft's and torch.compile's forwards take **kwargs / *input: the check reads the wrapped model's own."""
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(llama(len(tok), seed=1), LoraConfig(r=2, target_modules=["q_proj"]))
    make_hole_safe(wrapped)
    make_hole_safe(torch.compile(llama(len(tok), seed=1), backend="eager"))  # OptimizedModule.forward(*input) too


def test_longrope_models_serve_up_to_their_original_context(tok):
    """Past original_max_position_embeddings transformers picks every position's rotary frequencies by the
    largest position in the forward's batch: a short request batched with a long one decoded with the long
    factors (other tokens than the target's alone). The limit is the original context, where outputs match."""
    head = 64 // 4 // 2
    cfg = T.Phi3Config(vocab_size=len(tok), num_key_value_heads=2, original_max_position_embeddings=48,
                       rope_scaling={"type": "longrope", "short_factor": [1.0] * head, "long_factor": [4.0] * head},
                       **SMALL)
    assert max_positions(cfg) == 48 and max_positions(T.Phi3Config(**SMALL)) == 256
    target = _model(cfg)
    eng = SpecEngine(target, perturbed(target, 0.02), tok, EngineConfig(max_batch_size=4))
    assert eng.max_model_len == 48
    with pytest.raises(ValueError, match="prompt and max_tokens exceed the context: 40 prompt tokens \\+ max_tokens 9 > max_model_len 48"):
        eng.generate([[5] * 40], SamplingParams(max_tokens=9))
    # within it, a short and a long request in one batch are each the target's own (ignore_eos: full lengths)
    prompts = [[7, 8, 9], [(i % 50) + 3 for i in range(30)]]
    _greedy_matches(target, perturbed(target, 0.02), tok, prompts, 18, 2, 3)
