"""Cache rollback: after rejections, each row's cache equals a fresh forward over its accepted tokens."""

from __future__ import annotations

import pytest
import torch

from osd_serve.config import EngineConfig, SamplingParams
from osd_serve.engine import SpecEngine
from osd_serve.kv import BatchKV, GrowingLayer, new_cache
from tests.conftest import llama, perturbed


def _row_cache(kv, row: int, layer: int) -> torch.Tensor:
    """Keys and values of one row's valid columns, in logical order. [2, H, n, D]"""
    pos = kv.col_pos[row]
    cols = torch.nonzero(pos >= 0)[:, 0]
    cols = cols[torch.argsort(pos[cols])]
    assert torch.equal(pos[cols], torch.arange(len(cols))), "valid positions must be exactly 0..n-1"
    cached = kv.cache.layers[layer]
    return torch.stack([cached.keys[row][:, cols], cached.values[row][:, cols]])


@torch.inference_mode()
def _fresh(model, ids: list[int], layer: int) -> torch.Tensor:
    cached = model(torch.tensor([ids]), use_cache=True).past_key_values.layers[layer]
    return torch.stack([cached.keys[0], cached.values[0]])  # [2, H, n, D]


def test_caches_match_fresh_forward_after_every_step(tok):
    target = llama(len(tok), layers=3, seed=5)
    draft = perturbed(target, 0.02)
    prompts = [[5 + i] * (1 + 3 * i) for i in range(5)]
    # compact rarely, so holes pile up and both the hole path and compaction get checked
    eng = SpecEngine(target, draft, tok, EngineConfig(max_batch_size=5, compact_hole_fraction=0.8))
    eng.submit(prompts, [SamplingParams(max_tokens=24, num_speculative_tokens=k, ignore_eos=True) for k in (1, 3, 4, 5, 8)])
    rejections = holes_seen = 0
    while eng.has_unfinished():
        _, st = eng.step()
        rejections += st.proposed - st.accepted
        holes_seen += eng._target_kv.hole_fraction() > 0
        for i, r in enumerate(eng.running):
            seq = r.prompt_ids + r.output_ids
            for layer in (0, 2):
                # target holds everything but the last token; the draft everything but its pending ones
                assert torch.allclose(_row_cache(eng._target_kv, i, layer), _fresh(target, seq[:-1], layer), atol=1e-5)
                n = int(eng._draft_kv.length[i])
                assert n == len(seq) - int(eng._rows.pending_n[i])
                assert torch.allclose(_row_cache(eng._draft_kv, i, layer), _fresh(draft, seq[:n], layer), atol=1e-5)
    assert rejections > 10 and holes_seen > 0


def test_compaction_keeps_content(tok):
    target = llama(len(tok), seed=6)
    eng = SpecEngine(target, perturbed(target, 0.02), tok, EngineConfig(max_batch_size=3, compact_hole_fraction=1.0))
    eng.submit([[7] * 3, [8] * 9, [9]], SamplingParams(max_tokens=60, num_speculative_tokens=6, ignore_eos=True))
    kv = eng._target_kv
    for _ in range(8):  # until rows disagree in length, leaving holes that are not a common suffix
        eng.step()
        if kv.hole_fraction() > 0:
            break
    assert kv.hole_fraction() > 0
    before = [_row_cache(kv, i, 1).clone() for i in range(3)]
    width = kv.width
    kv.compact()
    assert kv.width == int(kv.length.max()) < width
    for i in range(3):
        assert torch.equal(_row_cache(kv, i, 1), before[i])


def test_compact_hole_fraction_holds_when_rows_leave(tok, monkeypatch):
    """A finished row leaving the batch compacted past half holes whatever compact_hole_fraction said:
    1.0 (never compact) compacted anyway. Now select() takes the engine's threshold."""
    from osd_serve import kv as kv_module

    calls = []
    compact = kv_module.BatchKV.compact
    monkeypatch.setattr(kv_module.BatchKV, "compact", lambda self: calls.append(self.hole_fraction()) or compact(self))
    target = llama(len(tok), seed=6)
    prompts = [[8] * 40, [9] * 40, [7] * 3]  # the two long rows leave first: the short one is left in a wide cache
    params = [SamplingParams(max_tokens=n, num_speculative_tokens=6, ignore_eos=True) for n in (4, 4, 30)]
    for fraction, compacts in ((1.0, False), (0.5, True)):
        calls.clear()
        eng = SpecEngine(target, perturbed(target, 0.02), tok, EngineConfig(compact_hole_fraction=fraction))
        eng.generate(prompts, params)
        assert bool(calls) == compacts, (fraction, calls)


@torch.inference_mode()
def test_growing_cache_matches_dynamic_cache_and_appends_in_place(tok):
    """Same logits as Hugging Face's concatenating cache through appends and crops, and appends within
    capacity reuse the buffer (no copy of the cache per forward)."""
    from transformers import DynamicCache

    model = llama(len(tok), layers=2, seed=7)
    grow, ref = new_cache(model.config), DynamicCache(config=model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in grow.layers)
    g = torch.Generator().manual_seed(0)
    in_place = 0
    for step, (t, crop) in enumerate([(7, 0), (1, 0), (4, 2), (1, 0), (6, 3), (1, 1), (3, 0)] * 12):
        ids = torch.randint(3, len(tok), (2, t), generator=g)
        before = grow.layers[0]._kbuf
        out_g = model(ids, past_key_values=grow, use_cache=True).logits
        out_r = model(ids, past_key_values=ref, use_cache=True).logits
        torch.testing.assert_close(out_g, out_r, rtol=1e-5, atol=1e-5)
        in_place += grow.layers[0]._kbuf is before
        assert grow.layers[0].keys.data_ptr() == grow.layers[0]._kbuf.data_ptr()
        if crop:
            grow.crop(-crop)
            ref.crop(-crop)
        for a, b in zip(grow.layers, ref.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert grow.get_seq_length() == ref.get_seq_length() > 200
    assert in_place > 70  # of 84 forwards; only growth (by half each time) reallocates


@torch.inference_mode()
def test_split_rows_keep_their_cache_when_the_batch_writes_on(tok):
    """split() hands out views of the batch's buffers: rolling the batch back and appending again must
    not write into memory a split row still reads (copy-on-write after _copy_cache)."""
    model = llama(len(tok), layers=2, seed=8)
    kv = BatchKV(model, 2, torch.device("cpu"))
    ids = torch.randint(3, len(tok), (2, 9), generator=torch.Generator().manual_seed(1))
    kv.forward(ids, torch.ones(2, 9, dtype=torch.bool))
    rows = kv.split()
    kept = [[(layer.keys.clone(), layer.values.clone()) for layer in r.cache.layers] for r in rows]
    kv.truncate(torch.tensor([4, 4]))  # crops the common suffix: the next append reuses those columns
    kv.forward(ids[:, :5].flip(1), torch.ones(2, 5, dtype=torch.bool))
    rows[0].forward(ids[:1, :3], torch.ones(1, 3, dtype=torch.bool))  # a split row appends too
    for r, saved in zip(rows, kept):
        for layer, (k, v) in zip(r.cache.layers, saved):
            assert torch.equal(layer.keys[:, :, :9], k) and torch.equal(layer.values[:, :, :9], v)


def test_bench_forward_cost_times_appends_in_place(tok, monkeypatch):
    """bench.forward_cost times what a decode step or a verification costs: appends into the cache's
    existing buffers. A rollback that compacts (or otherwise replaces the layer's tensors) makes every
    timed forward copy the whole cache into a new buffer, and c and v read low."""
    from osd_serve import bench

    model = llama(len(tok), layers=2, seed=9)
    buffers: dict[int, set[int]] = {}  # id(layer) -> data_ptr of every buffer it appended into
    update = GrowingLayer.update

    def spy(self, key_states, value_states, *args, **kwargs):
        out = update(self, key_states, value_states, *args, **kwargs)
        buffers.setdefault(id(self), set()).add(self._kbuf.data_ptr())
        return out

    monkeypatch.setattr(GrowingLayer, "update", spy)
    for tokens in (1, 4):
        buffers.clear()
        bench.forward_cost(model, 3, 20, len(tok), torch.device("cpu"), repeats=6, tokens=tokens)
        assert len(buffers) == 2
        assert all(len(ptrs) == 1 for ptrs in buffers.values()), "a timed forward reallocated the cache"


def _windowed_pair(tok, kind: str, attn: str = "sdpa"):
    """A tiny random-weight model with a 12-token window: Mistral (every layer sliding, no
    layer_types) or Qwen2 with one full and two sliding layers (the mapping of masks)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import _finish

    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.3, sliding_window=12, max_position_embeddings=256,
                  attn_implementation=attn, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "mistral":
        return _finish(MistralForCausalLM(MistralConfig(num_hidden_layers=2, **common)), None)
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1, **common))
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return _finish(model, None)


def _plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy decoding: a full forward over the whole sequence for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kind, attn", [("mistral", "sdpa"), ("qwen2-mixed", "sdpa"), ("mistral", "eager")])
def test_sliding_window_models_decode_past_their_window(tok, kind, attn):
    """Sliding-window models (Mistral-7B: 4096, Phi-3-mini: 2047, Gemma3: 512/1024) get their window as
    a mask over logical positions. Transformers' own window counts physical cache columns, which the holes
    of rejected drafts break; before this the engine refused any sequence longer than the window. Prompts
    and generations run far past a 12-token window; the output is the model's own greedy. SDPA takes a
    bool mask, eager an additive one."""
    from osd_serve.config import SamplingParams
    from osd_serve.engine import SpecEngine
    from tests.conftest import perturbed

    target = _windowed_pair(tok, kind, attn)
    assert target.config._attn_implementation == attn
    draft = perturbed(target, 0.02)
    prompts = [[(7 * i + j) % (len(tok) - 1) + 1 for j in range(3 + 4 * i)] for i in range(6)]
    want = [_plain_greedy(target, p, 30) for p in prompts]
    # The window matters: attending to every key gives another output.
    w, target.config.sliding_window = target.config.sliding_window, 1 << 30
    unwindowed = [_plain_greedy(target, p, 30) for p in prompts]
    target.config.sliding_window = w
    assert unwindowed != want
    for k in (0, 1, 3, 5):
        eng = SpecEngine(target, draft, tok)
        assert eng.max_model_len == 256  # not capped at the window
        stats = []
        outs = eng.generate(prompts, SamplingParams(max_tokens=30, num_speculative_tokens=k, ignore_eos=True), stats)
        assert [o.token_ids for o in outs] == want, k
        # alone, the shortest prompt starts within the window's width (transformers' own causal path)
        # and crosses it (the logical mask)
        assert eng.generate(prompts[:1], SamplingParams(max_tokens=30, num_speculative_tokens=k, ignore_eos=True))[0].token_ids == want[0]
        if k:
            assert 0 < sum(s.accepted for s in stats) < sum(s.proposed for s in stats)  # holes were made


def test_sliding_window_models_refuse_flash_attention(tok):
    """flash-attn takes no 4D mask, so it could only apply a window over physical columns."""
    target = _windowed_pair(tok, "mistral")
    target.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(ValueError, match="sliding-window layers.*flash_attention_2"):
        SpecEngine(target, target, tok)


def test_models_whose_attention_reads_cache_places_are_refused(tok):
    """MPT's ALiBi reads a key's physical index, so holes changed its greedy output at batch > 1."""
    from transformers import MptConfig, MptForCausalLM

    from osd_serve.disagg import DraftWorker

    m = MptForCausalLM(MptConfig(vocab_size=len(tok), d_model=32, n_heads=4, n_layers=1, max_seq_len=64))
    with pytest.raises(ValueError, match="'mpt' is not supported"):
        SpecEngine(m, m, tok)
    with pytest.raises(ValueError, match="'mpt' is not supported"):
        DraftWorker(m, len(tok))


@pytest.mark.parametrize("chunk, tuning", [(4, False), (4096, True)])
def test_llama4_is_refused(tok, chunk, tuning):
    """Llama-4's chunked layers chunk physical columns, and its NoPE layers' temperature scales with the
    cache's column count: with holes, batch 3 gave 4-6 of 6 outputs that were not the target's (chunk 4),
    and a row behind 8 hole columns logits 0.013 off (temperature tuning, floor_scale 2)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=1, attention_chunk_size=chunk, attn_temperature_tuning=tuning, floor_scale=2)
    m = Llama4ForCausalLM(cfg)
    with pytest.raises(ValueError, match="'llama4_text' is not supported"):
        SpecEngine(m, m, tok)


def test_a_forward_that_raises_part_way_leaves_the_cache_as_it_was(tok):
    """Out of memory in a late layer: the layers before it had appended the forward's columns, col_pos
    had not, and every later forward of those rows failed on the mismatch (a disaggregated worker's
    failed draft-ahead broke every following step)."""
    model = llama(len(tok), layers=3, seed=5)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kv = BatchKV(model, 2, torch.device("cpu"))
    kv.forward(ids, torch.ones_like(ids, dtype=torch.bool))
    last, forward = model.model.layers[-1], model.model.layers[-1].forward
    last.forward = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("simulated"))
    with pytest.raises(torch.OutOfMemoryError):
        kv.forward(ids[:, :2], torch.ones(2, 2, dtype=torch.bool))
    last.forward = forward
    assert all(layer.keys.shape[2] == kv.width == 4 for layer in kv.cache.layers)
    got = kv.forward(ids[:, :1], torch.ones(2, 1, dtype=torch.bool))[:, -1]  # [B, V]
    with torch.inference_mode():
        want = model(torch.cat([ids, ids[:, :1]], 1)).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-5)


@torch.inference_mode()
def test_select_keeps_the_chosen_rows_and_compacts_when_the_long_ones_leave(tok):
    """select() keeps the given rows' columns and lengths, and when the rows that left were the long
    ones, squeezes the holes out at once (width = the longest kept row). The engine compacts again at
    the end of a step, so its tests passed with select's own compaction gone; a row aborted between
    steps then ran a whole step in the wide cache."""
    model = llama(len(tok), layers=2, seed=8)
    kv = BatchKV(model, 3, torch.device("cpu"))
    ids = torch.randint(3, len(tok), (3, 20), generator=torch.Generator().manual_seed(2))
    lens = torch.tensor([20, 3, 8])
    kv.forward(ids, torch.arange(20)[None, :] < lens[:, None])
    want = [_row_cache(kv, i, 1).clone() for i in (2, 1)]
    kv.select(torch.tensor([2, 1]), compact_above=0.5)
    assert kv.length.tolist() == [8, 3] and kv.width == 8  # holes were 60% of the columns
    assert all(torch.equal(_row_cache(kv, i, 1), w) for i, w in enumerate(want))
    kv.select(torch.tensor([1]), compact_above=1.0)  # 1.0: never compact, but the leading holes (the row that left) go
    assert kv.length.tolist() == [3] and kv.width == 3 and torch.equal(_row_cache(kv, 0, 1), want[1])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hole_mask_on_sdpa_gives_the_logits_of_transformers_own_mask(tok, arch):
    """On SDPA a cache with holes gets a 4D mask built here (BatchKV._hole_mask) instead of the 2D one
    transformers turns into 4D at every forward: the logits must be those of the 2D mask, for one input
    per row (a draft step) and for several with padding (a verification where rows' k differ)."""
    from tests.conftest import gpt2

    model = (llama if arch == "llama" else gpt2)(len(tok), layers=2, seed=11)
    ours, theirs = BatchKV(model, 3, torch.device("cpu")), BatchKV(model, 3, torch.device("cpu"))
    theirs._hole_mask = lambda mask, t: mask.long()  # the 2D mask, as transformers takes it
    built = []
    own = ours._hole_mask
    ours._hole_mask = lambda mask, t: built.append(own(mask, t)) or built[-1]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 9), generator=g)  # [3, 9]
    valid = torch.ones(3, 9, dtype=torch.bool)
    valid[0, 4:], valid[2, 7:] = False, False  # right-padded prompts: holes from the start
    # a draft step; a verification with k = 2, 0, 1, rolled back to fewer tokens; a step on the rolled-back rows
    steps = [(torch.ones(3, 1, dtype=torch.bool), None),
             (torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]).bool(), torch.tensor([6, 11, 9])),
             (torch.ones(3, 1, dtype=torch.bool), None)]
    with torch.inference_mode():
        for kv in (ours, theirs):
            kv.forward(ids, valid, keep=1)
        for step_valid, keep in steps:
            x = torch.randint(3, len(tok), step_valid.shape, generator=g)  # [3, T]
            a, b = ours.forward(x, step_valid), theirs.forward(x, step_valid)  # [3, T, V]
            assert torch.allclose(a[step_valid], b[step_valid], atol=1e-6), (arch, step_valid.shape)
            if keep is not None:
                for kv in (ours, theirs):
                    kv.truncate(keep)
    assert [m.dim() for m in built] == [4, 4, 4, 4] and built[2].shape == (3, 1, 3, 13)
