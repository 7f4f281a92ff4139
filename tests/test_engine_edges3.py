"""Engine edge cases, third pass: what a call that fails part-way leaves behind, and calls from other threads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve import output
from osd_serve.engine import SpecEngine
from tests.conftest import byte_fallback_tokenizer, gpt2, llama, perturbed


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


def _scripted_llama(vocab: int, successor: dict[int, int]):
    """A tiny Llama whose greedy next token depends on the last token only, as ``successor`` says: the
    layers add nothing to the residual stream, and the head scores each successor by its input's embedding."""
    model = llama(vocab, seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight  # [V, H]
        head = torch.zeros_like(model.lm_head.weight)  # [V, H]
        for x, y in successor.items():
            head[y] += 10 * emb[x] / emb[x].pow(2).mean().sqrt()
        model.lm_head.weight = torch.nn.Parameter(head)
    return model


def _rewriting_pair():
    """The byte-fallback tokenizer and a scripted target: ▁The -> ▁a -> é (2 bytes) -> a character's first
    byte -> ▁a ... ; ▁is -> a -> a ... The run <0xC3><0xA9><0xE6> is not UTF-8 once " a" ends it."""
    sp = byte_fallback_tokenizer()
    byte = {b: sp.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xE6)}
    the, is_, a, sp_a = (sp.convert_tokens_to_ids(t) for t in ("▁The", "▁is", "a", "▁a"))
    successor = {the: sp_a, sp_a: byte[0xC3], byte[0xC3]: byte[0xA9], byte[0xA9]: byte[0xE6], byte[0xE6]: sp_a,
                 is_: a, a: a}
    return sp, _scripted_llama(len(sp), successor), byte, (the, is_, a, sp_a)


@pytest.mark.parametrize("bytes_known", [True, False])
def test_output_that_a_byte_fallback_decoder_rewrites_fails_no_step(tok, monkeypatch, bytes_known):
    """A byte-fallback decoder rewrites text it already gave: "é" from <0xC3><0xA9>, then <0xE6> (a
    character's first byte) and " a" decode as three U+FFFD and " a". The tokenizers DecodeStream then
    raises "Invalid prefix" (vLLM #17448), out of Request.append and the engine step: every request of
    the batch failed (AsyncSpecServer ends them all with an error). The request is decoded in full from
    then on, and its text is the tokenizer's decode: once its run stops being UTF-8, or, for a decoder
    whose byte tokens are not known (bytes_known False), once the stream raises."""
    sp, target, byte, (the, is_, a, sp_a) = _rewriting_pair()
    if not bytes_known:
        monkeypatch.setattr(output, "byte_tokens", lambda tokenizer: output.ByteTokens({}, frozenset()))
    eng = SpecEngine(target, target, sp, EngineConfig(max_batch_size=2))
    params = SamplingParams(max_tokens=9, num_speculative_tokens=0, ignore_eos=True)
    broken, other = eng.generate([[1, the], [1, is_]], params)
    assert broken.token_ids == [sp_a, byte[0xC3], byte[0xA9], byte[0xE6]] * 2 + [sp_a]
    assert broken.finish_reason == other.finish_reason == "length"
    assert broken.text == sp.decode([1, the] + broken.token_ids, skip_special_tokens=True)[len("The"):]
    assert other.token_ids == [a] * 9 and other.text == "aaaaaaaaa"
    # the same through the stream, whatever the tokens per step: no step fails, ids add up; and the text
    # does where the byte tokens are known. The stream holds back the run's "é" until " a" ends it, when
    # it becomes U+FFFD: it had streamed " aé\ufffd\ufffd a..." (one token per step) for the final " a\ufffd\ufffd\ufffd a...".
    for k in (0, 1, 4):
        ids, text = [], ""
        for d in SpecEngine(target, target, sp).stream([[1, the]], replace(params, num_speculative_tokens=k)):
            ids, text = ids + d.token_ids, text + d.text
        assert ids == broken.token_ids and (text == broken.text or not bytes_known)


def test_a_stop_string_that_a_later_byte_of_the_step_rewrites_stops_whatever_k(tok):
    """stop "é": one token a step, the output stops once <0xC3><0xA9> give "é". With k=4 one step brought
    <0xE6> and " a" too, the step's text had U+FFFD where "é" had been, and the stop was never seen: 9
    tokens to max_tokens instead of 3."""
    sp, target, byte, (the, _, _, sp_a) = _rewriting_pair()
    params = SamplingParams(max_tokens=9, ignore_eos=True, stop=["é"])
    for k in (0, 1, 2, 4, 8):
        (out,) = SpecEngine(target, target, sp).generate([[1, the]], replace(params, num_speculative_tokens=k))
        assert (out.token_ids, out.text, out.finish_reason) == ([sp_a, byte[0xC3], byte[0xA9]], " a", "stop"), k


def test_the_engine_counts_how_requests_ended(tok, target):
    """engine.finished (what /admin/experts reports as "finished") counts each request once, when it
    leaves: run out, stopped, aborted while queued or while running, or ended by a reset."""
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2, max_model_len=64))
    params = SamplingParams(max_tokens=6, num_speculative_tokens=3, ignore_eos=True)
    eng.generate([[10, 20], [11, 21, 31]], params)
    assert dict(eng.finished) == {"length": 2}
    first = eng.generate([[12, 22]], params)[0].text
    eng.generate([[12, 22]], replace(params, stop=[first[2:4]]))  # the greedy output again, cut at its 3rd character
    assert dict(eng.finished) == {"length": 3, "stop": 1}
    running, _, queued = (eng.add_request([13 + i, 23], replace(params, max_tokens=40)) for i in range(3))
    eng.step()  # two rows run, the third waits for a slot
    eng.abort(queued)  # leaves the queue at once
    assert eng.finished["abort"] == 1 and len(eng.waiting) == 0
    eng.abort(running)  # leaves the batch at the next step
    eng.step()
    assert eng.finished["abort"] == 2 and len(eng.running) == 1
    eng.reset()  # after a failed step: the server ends what was left with an error
    assert dict(eng.finished) == {"length": 3, "stop": 1, "abort": 2, "error": 1}
    assert not eng.has_unfinished()


def test_an_abort_from_another_thread_while_a_step_admits_its_request_stops_it(tok, target, monkeypatch):
    """A caller thread's abort that lands while the driving thread's step has taken the request off the
    queue but not yet into the batch (its prefill) found it in neither, and the request ran to its
    max_tokens. The abort now waits for the step and stops the row at the next one."""
    import threading

    import osd_serve.engine as engine_mod

    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2, max_model_len=64))
    params = SamplingParams(max_tokens=30, num_speculative_tokens=2, ignore_eos=True)
    rid = eng.add_request([10, 20, 30], params)
    req = eng.waiting[0]
    real, caller = engine_mod.pad_right, []

    def admitting(rows):  # _admit's first call, after it popped the request from the queue
        if not caller:
            caller.append(threading.Thread(target=eng.abort, args=(rid,)))
            caller[0].start()
            caller[0].join(0.5)  # broken: the abort is done (it found nothing); fixed: it waits for this step
        return real(rows)

    monkeypatch.setattr(engine_mod, "pad_right", admitting)
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        caller[0].join(10)
    assert eng.finished == {"abort": 1} and steps == 2  # the admitting step's tokens, then it left
    assert req.finish_reason == "abort" and 1 <= len(req.output_ids) <= 3


def test_requests_added_and_aborted_from_another_thread_while_one_thread_steps(tok, target):
    """One thread steps; another queues 24 requests and aborts every third, with the interpreter
    switching threads every microsecond. Every request ends exactly once, and every one not aborted
    with the target's own greedy tokens (the draft is perturbed: rows are rejected and rolled back
    while the queue changes under the step). Unlocked, abort's walk over the queue met the step's
    popleft ("deque mutated during iteration"), and a request queued during an abort could be lost."""
    import sys
    import threading

    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=4, max_model_len=64))
    params = SamplingParams(max_tokens=8, num_speculative_tokens=3, ignore_eos=True)
    prompts = [[10 + i, 20 + i % 7, 30] for i in range(24)]
    refs = [c.token_ids for c in SpecEngine(target, target, tok).generate(prompts, replace(params, num_speculative_tokens=0))]
    reqs, done, errors = [], threading.Event(), []

    def caller():
        try:
            for i, p in enumerate(prompts):
                reqs.extend(eng.submit([p], params))
                if i % 3 == 2:
                    eng.abort(reqs[i - 1].request_id)
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)
        finally:
            done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        t = threading.Thread(target=caller)
        t.start()
        while not done.is_set() or eng.has_unfinished():
            eng.step()
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    assert len(reqs) == 24 and sum(eng.finished.values()) == 24
    assert all(r.finished for r in reqs) and eng.finished["abort"] == sum(r.finish_reason == "abort" for r in reqs)
    for i, (r, ref) in enumerate(zip(reqs, refs)):
        if r.finish_reason == "abort":  # only those asked to (one may have run out first)
            assert i % 3 == 1 and r.output_ids == ref[: len(r.output_ids)]
        else:
            assert r.finish_reason == "length" and r.output_ids == ref, i


@pytest.mark.parametrize("k", [0, 3])
def test_the_cache_stays_narrow_under_traffic_that_never_empties_the_batch(tok, target, k):
    """Rows that left stayed as leading hole columns: with compact_hole_fraction 1.0 (never compact) the
    width grew a column a step for as long as the batch never emptied (402 columns after 400 steps for
    rows of 9 tokens at k = 0), and so did every forward's attention. Outputs stay the target's."""
    from tests.test_engine import _hf_greedy

    eng = SpecEngine(target, perturbed(target, 0.05), tok, EngineConfig(max_batch_size=4, compact_hole_fraction=1.0))
    params = SamplingParams(max_tokens=8, num_speculative_tokens=k, ignore_eos=True)
    prompts, out, widths = {}, {}, []
    for step in range(60):
        if len(eng.waiting) + len(eng.running) < 4:  # one new row a step at most: rows overlap
            prompt = [5 + step % 7, 6, 7]
            prompts[eng.add_request(prompt, params)] = prompt
        for d in eng.step()[0]:
            out.setdefault(d.request_id, []).extend(d.token_ids)
        assert eng.running
        widths.append(eng._target_kv.width)
    assert max(widths[20:]) <= 3 + 8 + k + 1  # one row's prompt, output and a step's drafts
    done = [r for r in out if len(out[r]) == 8]
    assert len(done) >= 20 and all(out[r] == _hf_greedy(target, prompts[r], 8) for r in done)


def test_a_row_at_the_context_limit_shares_a_step_with_a_wider_row(tok):
    """A row verifies only its own k_i + 1 columns; the rest of the batch's width is padding, placed at
    the row's last valid position. Marked valid, that padding ran at real positions, past the model's
    last one for a row at the context end beside a row of larger k: GPT-2's learned position table has
    no entry there (IndexError). Outputs elsewhere were unchanged, so only this case shows it."""
    target = gpt2(len(tok), seed=0)  # n_positions 256
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2))
    near = [5 + i % 7 for i in range(target.config.n_positions - 2)]  # 254 prompt tokens + 2 outputs: the whole context
    params = [SamplingParams(max_tokens=2, num_speculative_tokens=1, ignore_eos=True),
              SamplingParams(max_tokens=12, num_speculative_tokens=8, ignore_eos=True)]
    outs = eng.generate([near, [5, 6, 7]], params)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [len(o.token_ids) for o in outs] == [2, 12]
