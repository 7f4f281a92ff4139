"""Engine edge cases: a target that yields NaN logits, a stream its consumer leaves early."""

from __future__ import annotations

import pytest
import torch

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from tests.conftest import llama, perturbed

BAD = 7  # the input id after which the broken target's logits are NaN


def _nan_after(model, bad: int):
    """``model`` whose logits are NaN at every position whose input id is ``bad`` (as a float16
    overflow inside the model leaves them)."""
    forward = model.forward

    def broken(*args, input_ids=None, **kwargs):
        out = forward(*args, input_ids=input_ids, **kwargs)
        out.logits[input_ids[:, -out.logits.shape[1]:] == bad] = float("nan")  # the logits kept (logits_to_keep)
        return out

    model.forward = broken
    return model


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_end_their_request_with_an_error(tok, k, temperature):
    """A NaN row ranks nothing: argmax and sampling both gave token 0, and the request went on from
    it as if the target had chosen it. It ends with finish_reason 'error' and without that token;
    the rows beside it are untouched."""
    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.015)
    prompts = [[10, 20, 30, 40], [10, 20, 30, BAD], [11, 21, 31]]
    params = SamplingParams(max_tokens=8, num_speculative_tokens=k, temperature=temperature, seed=0, ignore_eos=True)
    good = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=3)).generate([prompts[0], prompts[2]], params)
    assert all(BAD not in o.token_ids for o in good)  # so the other rows never meet a NaN
    _nan_after(target, BAD)
    stats = []
    outs = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=3)).generate(prompts, params, stats=stats)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    # The statistics describe the rows that went on, as the requests' own counts do (the broken row's
    # acceptance, read off NaN logits, was counted in them)
    assert sum(st.proposed for st in stats) == sum(o.proposed for o in outs)
    assert sum(st.accepted for st in stats) == sum(o.accepted for o in outs)
    assert [o.token_ids for o in (outs[0], outs[2])] == [o.token_ids for o in good]
    assert [o.finish_reason for o in (outs[0], outs[2])] == ["length", "length"]


def test_an_abandoned_stream_leaves_no_request_behind(tok):
    """A consumer that stops iterating stream() early (break, an exception) ends its requests: they
    were left running, so the next generate() ran them to the end too and stream() yielded their
    deltas among its own."""
    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2))
    params = SamplingParams(max_tokens=30, num_speculative_tokens=2, ignore_eos=True)
    for _ in eng.stream([[10, 20], [11, 21], [12, 22]], params):
        break
    seen = {d.request_id for d in eng.stream([[13, 23]], params)}
    assert len(seen) == 1
    assert not eng.has_unfinished()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_end_their_request_on_the_disaggregated_path_too(tok, temperature):
    """The disaggregated verifier applies the same rule: no token 0 from a NaN row, an 'error'."""
    from tests.test_disagg import _serve

    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.015)
    prompts = [[10, 20, 30, 40], [10, 20, 30, BAD], [11, 21, 31]]
    params = SamplingParams(max_tokens=8, num_speculative_tokens=3, temperature=temperature, seed=0, ignore_eos=True)
    good, *_ = _serve(target, draft, tok, [prompts[0], prompts[2]], params)
    assert all(BAD not in r.output_ids for r in good)
    _nan_after(target, BAD)
    reqs, _, _, verdicts = _serve(target, draft, tok, prompts, params)
    assert reqs[1].finish_reason == "error" and reqs[1].output_ids == []
    # The verdict still carries tokens: a router from before `broken` appends them and goes on, where an
    # empty verdict had it verify the same history forever
    assert all(v.tokens for v in verdicts) and sum(v.broken for v in verdicts) == 1
    assert [r.output_ids for r in (reqs[0], reqs[2])] == [r.output_ids for r in good]


def test_broken_rows_reads_only_the_positions_that_chose_the_tokens():
    """The end-to-end tests above put the NaN at position 0 only: a check of position 0 alone, or of every
    position (padding past a shorter k, drafts after a rejection), passed them too."""
    from osd_serve.spec import broken_rows

    logits = torch.randn(4, 4, 6)  # [B, k+1, V]
    logits[0, 2] = float("nan")  # decided: row 0 accepted 2 drafts, so position 2 chose its bonus token
    logits[1, 3] = float("nan")  # not decided: row 1 was corrected at position 1
    logits[2] = float("-inf")
    logits[2, :, 3] = 0.0  # one finite logit ranks it: a legitimate (if peaked) row
    logits[3, 1, 5] = float("nan")  # one NaN logit at a decided position is enough
    assert broken_rows(logits, torch.tensor([2, 1, 3, 1])).tolist() == [True, False, False, True]
    logits[1, 1] = float("-inf")  # no finite logit where row 1 chose: broken as well
    assert broken_rows(logits, torch.tensor([2, 1, 3, 1])).tolist() == [True, True, False, True]


def test_an_interrupted_generate_leaves_no_request_behind(tok):
    """As stream(): a generate() that a step's exception (or Ctrl-C) interrupts ends its requests, which
    the next generate() otherwise ran to the end beside its own."""
    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2))
    step, calls = eng.step, []

    def failing_second_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    eng.step = failing_second_step
    params = SamplingParams(max_tokens=30, num_speculative_tokens=2, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        eng.generate([[10, 20], [11, 21], [12, 22]], params)
    assert not eng.waiting and all(r.finish_reason == "abort" for r in eng.running)  # they leave at the next step
    eng.step = step
    stats = []
    eng.generate([[13, 23]], params, stats=stats)
    assert {st.batch_size for st in stats[1:]} == {1}
