"""The HF baselines of the bench: the target alone, and HF's assisted generation with the draft, with
its own drafting rule (b) or drafting exactly the engine's k (b, k matched)."""

from __future__ import annotations

import contextlib

from .kv import pad_left
from .output import eos_token_ids

HF_ASSISTED_BATCH = 1  # transformers raises "assisted generate is only supported for batch_size = 1"


def hf_assisted_settings(draft) -> dict:
    """How HF's assisted generation drafts with this draft: its generation config's values, else the
    defaults transformers applies when they are unset."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})()
    return {n: v if (v := getattr(draft.generation_config, n, None)) is not None else defaults.get(n) for n in _DRAFTING}


_DRAFTING = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@contextlib.contextmanager
def _drafting_kept(draft, **settings):
    """The draft's drafting settings, set to ``settings`` meanwhile and restored after. Restored after every
    assisted call too: under a "heuristic" schedule transformers writes each call's final
    num_assistant_tokens back into the draft's config, so (b) drafted by what the warm-up, earlier
    prompts and earlier rounds left, and the report showed the last call's value, not the one (b) ran with."""
    gc = draft.generation_config
    before = {n: getattr(gc, n, None) for n in _DRAFTING}
    for n, v in settings.items():
        setattr(gc, n, v)
    try:
        yield
    finally:
        for n, v in before.items():
            setattr(gc, n, v)


@contextlib.contextmanager
def plain_greedy(model):
    """The model's generation config without its decoding settings while HF generates: transformers
    applies a config's repetition penalty, n-gram ban, minimum length or beams even to greedy
    decoding (Qwen2.5-Instruct ships repetition_penalty 1.05), and the engine applies none of them."""
    from transformers import GenerationConfig

    before = model.generation_config
    model.generation_config = GenerationConfig(
        bos_token_id=before.bos_token_id, eos_token_id=before.eos_token_id, pad_token_id=before.pad_token_id)
    try:
        yield
    finally:
        model.generation_config = before


def hf_generate(model, tok, prompts: list[list[int]], max_tokens: int, batch: int, assistant=None) -> list[list[int]]:
    """HF generate, greedy (plain_greedy). Assisted generation only supports batch 1 in transformers, so
    it runs per prompt whatever ``batch`` is (reported as such: HF_ASSISTED_BATCH). It stops at the EOS
    ids the engine stops at (the tokenizer's where the generation config has none)."""
    outs: list[list[int]] = []
    step = HF_ASSISTED_BATCH if assistant is not None else batch
    eos = sorted(eos_token_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    for i in range(0, len(prompts), step):
        chunk = prompts[i : i + step]
        ids, mask = pad_left(chunk, pad)
        ids, mask, width = ids.to(model.device), mask.to(model.device), ids.shape[1]
        kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, attention_mask=mask, eos_token_id=eos or None)
        if assistant is not None:
            kw["assistant_model"] = assistant
        with plain_greedy(model), (_drafting_kept(assistant) if assistant is not None else contextlib.nullcontext()):
            gen = model.generate(ids, **kw)[:, width:]
        for row in gen.tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            outs.append(row[:cut])
    return outs


@contextlib.contextmanager
def hf_drafting(draft, k: int):
    """HF assisted generation drafting exactly k tokens a step, as the engine does: a constant
    schedule and no confidence cut-off (HF's defaults draft up to 20 and stop below 0.4)."""
    with _drafting_kept(draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                        assistant_confidence_threshold=0.0):
        yield


def hf_matched_k(target, tok, ids, max_tokens: int, draft, k: int):
    with hf_drafting(draft, k):
        return hf_generate(target, tok, ids, max_tokens, HF_ASSISTED_BATCH, assistant=draft), None
