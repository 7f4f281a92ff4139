"""A step prefills at most ``prefill_chunk_tokens`` positions (osd_serve/prefill.py): a longer prompt is
fed over several steps while the running rows go on decoding, and prompts of unlike lengths are
prefilled apart. Output stays the target's own decoding throughout."""

from __future__ import annotations

import random

import pytest
import torch

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.prefill import group_size
from tests.conftest import llama, perturbed
from tests.test_engine import MAX_TOKENS, _hf_greedy, count_mismatches

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=3, ignore_eos=True)


class Fed:
    """The input positions of each forward of a model (rows x columns), in order."""

    def __init__(self, model):
        self.sizes: list[int] = []
        model.register_forward_pre_hook(lambda m, args, kw: self.sizes.append(kw["input_ids"].numel()), with_kwargs=True)


def test_group_size_packs_the_head_of_the_queue_within_the_budget():
    assert group_size([10, 10, 10], 512) == 3
    assert group_size([10, 400, 10, 10], 512) == 1  # 2 x 400 padded positions would pass it
    assert group_size([100, 100, 100, 300], 512) == 3
    assert group_size([600, 1], 512) == 1  # over the budget alone: fed in chunks
    assert group_size([600, 1], None) == 2


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_output_is_the_targets_under_a_small_budget(pair, tok, k):
    """50 prompts of 1-40 tokens at batch 4 with a budget of 7 positions: most are fed in chunks,
    groups split, and rows join while others decode; every output is the target's greedy decoding."""
    arch, target, draft = pair
    rng = random.Random(1)
    prompts = [[rng.randrange(3, target.config.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(50)]
    refs = [_hf_greedy(target, p, MAX_TOKENS) for p in prompts]
    fed = Fed(target)
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=4, prefill_chunk_tokens=7))
    outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k, ignore_eos=True))
    differ, ties = count_mismatches(target, prompts, [o.token_ids for o in outs], refs)
    assert differ == 0 and ties <= 2
    # decode forwards feed k+1 (or 2 after a bonus) per row: 4 rows of 5 at most; prefills at most 7
    assert max(fed.sizes) <= max(7, 4 * 5)


def test_running_rows_decode_while_a_long_prompt_is_fed(tok):
    """A 60-token prompt under a budget of 8 is fed in 8 chunks, one a step; the running row gains
    tokens at each of those steps, and no target forward prefills more than 8 positions."""
    target = llama(len(tok), seed=3)
    fed = Fed(target)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=4, prefill_chunk_tokens=8))
    params = SamplingParams(max_tokens=40, num_speculative_tokens=2, ignore_eos=True)
    short = eng.add_request([5, 6, 7], params)
    eng.step()
    long_prompt = list(range(3, 63))
    eng.add_request(long_prompt, params)
    joined_after, gains = None, []
    for n in range(1, 20):
        deltas, _ = eng.step()
        gains.append(sum(len(d.token_ids) for d in deltas if d.request_id == short))
        if len(eng.running) == 2:
            joined_after = n
            break
    assert joined_after == 8  # 59 prefill tokens in chunks of 8
    assert all(g >= 1 for g in gains)
    assert max(s for s in fed.sizes if s > 4) <= 8  # the chunks; decode forwards feed <= k+1 = 3 per row
    while eng.has_unfinished():
        eng.step()
    assert eng.finished["length"] == 2


def test_prefill_time_is_reported_by_the_next_steps_stats(tok):
    """Steps that only feed a chunk (nothing running) return no stats; their prefill time is in the
    first stats after them, so the stats' prefill_time sums to every step's (bench.py's split)."""
    import time

    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=1, prefill_chunk_tokens=8))
    admit = eng._admit

    def slow_admit():  # 50 ms of prefill a step, whatever the chunk
        time.sleep(0.05)
        admit()

    eng._admit = slow_admit
    stats = []
    eng.generate([list(range(3, 63))], SamplingParams(max_tokens=3, num_speculative_tokens=0, ignore_eos=True), stats=stats)
    # 59 prefill tokens in chunks of 8: 7 steps with no stats, then the one that joins and decodes
    assert stats[0].prefill_time >= 8 * 0.05 and all(0.05 <= st.prefill_time < 0.4 for st in stats[1:])


def test_prompts_of_unlike_lengths_are_prefilled_apart(tok):
    """A 40-token prompt queued with three of 3 tokens under a budget of 50: two forwards of 39 and
    3 x 2 positions, not one of 4 x 39 (156, of which 45 real)."""
    target = llama(len(tok), seed=3)
    fed = Fed(target)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=4, prefill_chunk_tokens=50))
    prompts = [list(range(3, 43)), [5, 6, 7], [8, 9, 10], [11, 12, 13]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=6, num_speculative_tokens=0, ignore_eos=True))
    assert fed.sizes[0] == 39 and max(fed.sizes) == 39 and 6 in fed.sizes  # the rest: decodes, a position a row
    assert [o.token_ids for o in outs] == [_hf_greedy(target, p, 6) for p in prompts]


def test_an_abort_mid_prefill_frees_the_queue(tok):
    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2, prefill_chunk_tokens=8))
    params = SamplingParams(max_tokens=6, num_speculative_tokens=2, ignore_eos=True)
    rid = eng.add_request(list(range(3, 63)), params)
    eng.step(), eng.step()
    assert eng._partial is not None and len(eng.waiting) == 1  # being fed, and still queued
    eng.abort(rid)
    # gone at once, caches and all: an engine with nothing else to do takes no next step to drop them
    assert not eng.waiting and eng.finished["abort"] == 1 and eng._partial is None and not eng.has_unfinished()
    out = eng.generate([[5, 6, 7]], params)[0]
    assert eng._partial is None and out.token_ids == _hf_greedy(target, [5, 6, 7], 6)


def test_a_reset_mid_prefill_leaves_no_partial(tok):
    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2, prefill_chunk_tokens=8))
    params = SamplingParams(max_tokens=6, num_speculative_tokens=2, ignore_eos=True)
    eng.add_request(list(range(3, 63)), params)
    eng.step()
    eng.reset()
    assert eng._partial is None and not eng.has_unfinished()
    prompt = list(range(10, 40))
    assert eng.generate([prompt], params)[0].token_ids == _hf_greedy(target, prompt, 6)


def test_a_draft_swap_mid_prefill_refeeds_the_draft(tok):
    """The draft starts as noise and is swapped for the target's own weights half-way through a long
    prompt's chunks: every draft token is then accepted, which needs the whole prompt in the draft's
    cache under the new weights (kept, the first chunks' keys came from the noise)."""
    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.5)
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=1, prefill_chunk_tokens=8))
    params = SamplingParams(max_tokens=12, num_speculative_tokens=3, ignore_eos=True)
    prompt = list(range(3, 63))
    req = eng.submit([prompt], params)[0]
    for _ in range(4):
        eng.step()
    assert eng._partial is not None and eng._partial.fed[1] == 32
    eng.swap_draft({n: t.clone() for n, t in target.state_dict().items()}, 1)
    while eng.has_unfinished():
        eng.step()
    assert req.output_ids == _hf_greedy(target, prompt, 12)
    assert req.accepted == req.proposed > 0


def test_swaps_faster_than_the_chunks_do_not_keep_a_prompt_out(tok):
    """A swap every 3 steps while a 59-token prefill goes in chunks of 8: the draft starts over at each,
    and once the target's cache is complete it takes the rest at once, so the prompt joins at step 8
    (it never joined: each swap reset the draft before it caught up)."""
    target = llama(len(tok), seed=3)
    eng = SpecEngine(target, perturbed(target, 0.015), tok, EngineConfig(max_batch_size=2, prefill_chunk_tokens=8))
    params = SamplingParams(max_tokens=60, num_speculative_tokens=2, ignore_eos=True)
    eng.add_request([5, 6, 7], params)
    eng.step()
    prompt = list(range(3, 63))
    long_req = eng.submit([prompt], SamplingParams(max_tokens=6, num_speculative_tokens=2, ignore_eos=True))[0]
    state = {n: t.clone() for n, t in eng.draft.state_dict().items()}
    for n in range(1, 9):
        if n % 3 == 0:
            eng.swap_draft(state, n)
        eng.step()
    assert long_req in eng.running
    while eng.has_unfinished():
        eng.step()
    assert long_req.output_ids == _hf_greedy(target, prompt, 6)


def test_seeded_sampling_does_not_depend_on_the_budget(tok):
    """Each request's uniforms come from its own generator: chunked or not, the same seed samples the
    same tokens (the prefill's values agree to float rounding, far from any sampled boundary here)."""
    target = llama(len(tok), seed=3)
    draft = perturbed(target, 0.015)
    prompts = [list(range(3, 40)), [5, 6, 7, 8], list(range(20, 45))]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, num_speculative_tokens=3, ignore_eos=True)
    outs = [SpecEngine(target, draft, tok, EngineConfig(max_batch_size=3, prefill_chunk_tokens=b)).generate(prompts, params)
            for b in (None, 6)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_the_budget_is_checked():
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be an integer >= 1"):
        EngineConfig(prefill_chunk_tokens=0)
    from deployments.config import AppConfig
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        AppConfig(prefill_chunk_tokens=8)
    assert AppConfig(prefill_chunk_tokens=None).prefill_chunk_tokens is None
    # the disaggregated Verifier feeds whole prompts: a budget set there would be ignored without a word
    with pytest.raises(ValueError, match="prefill_chunk_tokens: only the colocated engine"):
        AppConfig(topology="disaggregated", prefill_chunk_tokens=512, distill={"backend": "ray_train"})
    dis = AppConfig(topology="disaggregated", distill={"backend": "ray_train"})
    # as each deployment validates it again: the dumped default must pass (it failed every disaggregated replica)
    assert AppConfig(**dis.without_keys()).prefill_chunk_tokens == 2048


def test_the_serve_configs_budget_reaches_every_experts_engine(tok, tmp_path):
    """AppConfig.prefill_chunk_tokens is what each expert's engine prefills a step, through SpecService."""
    import asyncio

    from deployments.config import AppConfig
    from osd_serve.service import SpecService

    target = llama(len(tok), seed=3)
    cfg = AppConfig(prefill_chunk_tokens=16, experts=[{"name": "default"}, {"name": "code", "keywords": ["def "]}],
                    distill={"enabled": False, "versions_dir": str(tmp_path)}, wandb={"mode": "disabled"})
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    try:
        assert {n: e.config.prefill_chunk_tokens for n, e in svc.server.engines.items()} == {"default": 16, "code": 16}
        fed = Fed(target)

        async def run():
            return [d async for d in svc.stream("default", "x" * 60, SamplingParams(max_tokens=4, temperature=0))]

        assert asyncio.run(run())
        assert max(fed.sizes) <= 16  # 60 characters' prompt in chunks of 16 (the decode forwards feed 1 row of k+1)
    finally:
        svc.close()
