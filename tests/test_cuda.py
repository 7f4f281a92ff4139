"""The CUDA attention path (issues 2 and 4), through the real loading code: flash-attention-2 when
flash_attn is installed, else PyTorch SDPA. Greedy output on the GPU must still equal the target's own
greedy decoding. Run on a lent GPU with `python -m pytest -q tests/test_cuda.py`. Each test also runs on
the CPU (float32, SDPA), so CI executes this file's own code: a bug in it once waited for a GPU to show."""

from __future__ import annotations

import random

import pytest
import torch

from osd_serve.bench import divergence
from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.loading import ModelConfig, attention_backend, flash_attn_importable, load_pair
from tests.test_engine import _hf_greedy

MAX_TOKENS = 16
BACKENDS = ["sdpa"] + (["flash_attention_2"] if flash_attn_importable() else [])
# (device, dtype, attention): the CPU case everywhere, the GPU's where there is one
CASES = [("cpu", "float32", "sdpa")] + ([("cuda", "bfloat16", b) for b in BACKENDS] if torch.cuda.is_available() else [])
PLACES = sorted({c[:2] for c in CASES})


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory, tok):
    from tests.conftest import llama, perturbed

    root = tmp_path_factory.mktemp("cuda_pair")
    target = llama(len(tok), hidden=128, layers=2)
    dirs = {}
    for name, model in (("target", target), ("draft", perturbed(target, 0.015))):
        dirs[name] = str(root / name)
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    return dirs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_backend_on_cuda():
    expected = "flash_attention_2" if flash_attn_importable() else "sdpa"
    assert attention_backend(torch.device("cuda")) == expected


@pytest.mark.parametrize("device,dtype,backend", CASES)
def test_greedy_on_cuda_equals_target(pair_dirs, device, dtype, backend):
    target, draft, tok = load_pair(ModelConfig(pair_dirs["target"], pair_dirs["draft"], device=device,
                                               dtype=dtype, attn_implementation=backend))
    assert target.config._attn_implementation == backend and target.device.type == device
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 24))] for _ in range(24)]
    refs = [_hf_greedy(target, p, MAX_TOKENS) for p in prompts]
    for bs in (1, 8):  # batch 8 mixes prompt lengths, so the KV cache has holes and a 2D mask
        eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=bs))
        outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=3, ignore_eos=True))
        _assert_target_greedy(target, prompts, [o.token_ids for o in outs], refs, f"{device} {backend} batch {bs}")


def _assert_target_greedy(target, prompts, outs, refs, label: str) -> None:
    ties = 0
    for p, o, ref in zip(prompts, outs, refs):
        if o != ref:  # the bench's rule: a split is a near-tie only within two bf16 steps of the top logit
            with torch.inference_mode():
                gap, tie = divergence(target, p, ref, o)
            assert gap < tie, f"{label}: output leaves target greedy (gap {gap:.3f}, tie {tie:.3f})"
            ties += 1
    assert ties <= 0.1 * len(prompts), f"{label}: {ties} near-ties is not rare"


@pytest.mark.parametrize("device,dtype,backend", CASES)
def test_disaggregated_verifier_on_cuda_equals_target(pair_dirs, device, dtype, backend):
    """The disaggregated topology's core (the TargetVerifier and DraftWorker that deployments/disagg.py
    wraps) on the GPU: concurrent requests batched into one verification, a share of calls sent to the
    replica without the row's cache (recomputed), output still the target's greedy decoding."""
    from tests.test_disagg import _serve

    target, draft, tok = load_pair(ModelConfig(pair_dirs["target"], pair_dirs["draft"], device=device,
                                               dtype=dtype, attn_implementation=backend))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 24))] for _ in range(16)]
    refs = [_hf_greedy(target, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=3, ignore_eos=True)
    reqs, _, _, verdicts = _serve(target, draft, tok, prompts, params)
    assert sum(v.recomputed > 0 for v in verdicts) > 0  # a row verified where its cache was not
    _assert_target_greedy(target, prompts, [r.output_ids for r in reqs], refs, f"disaggregated {device} {backend}")


@pytest.mark.parametrize("device,dtype", PLACES)
def test_sdpa_flash_kernel_serves_plain_decoding(pair_dirs, device, dtype):
    """With only SDPA's flash kernel allowed, batch-1 decoding (no mask) still runs and stays exact:
    evidence that SDPA takes its flash path (on CUDA the one that matters), not only that it is allowed to."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    target, draft, tok = load_pair(ModelConfig(pair_dirs["target"], pair_dirs["draft"], device=device,
                                               dtype=dtype, attn_implementation="sdpa"))
    prompt = [5, 9, 13, 7]
    ref = _hf_greedy(target, prompt, MAX_TOKENS)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = SpecEngine(target, draft, tok).generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=0,
                                                                              ignore_eos=True))
    assert out[0].token_ids == ref
