"""Engine edge cases, third pass: what a call that fails part-way leaves behind."""

from __future__ import annotations

import pytest

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from tests.conftest import llama, perturbed


@pytest.fixture(scope="module")
def target(tok):
    return llama(len(tok), seed=3)


@pytest.mark.parametrize("call", ["generate", "stream", "submit"])
def test_a_refused_prompt_leaves_none_of_its_batch_queued(tok, target, call):
    """generate/stream/submit of [good, too long]: the good prompt was queued before the long one was
    refused, and stayed queued. The caller got the ValueError and no request objects, yet the next
    stream() yielded the orphan's deltas among its own and the next generate() decoded it too."""
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_model_len=32))
    params = SamplingParams(max_tokens=8, num_speculative_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt is too long"):
        run = getattr(eng, call)([[10, 20], [11] * 40], params)
        if call == "stream":
            next(run)
    assert not eng.has_unfinished()
    seen = {d.request_id for d in eng.stream([[12, 22]], params)}
    assert len(seen) == 1
