"""A batch of sequences sharing one Hugging Face ``DynamicCache``, each row with its own length.

Why holes: speculative decoding appends k+1 columns to every row per step, but each row keeps a
different number of them. Instead of cutting the batch to its shortest acceptance, or copying the
cache every step, rejected columns stay in place as *holes*: they are masked out of attention by the 2D
attention mask, and every row carries explicit ``position_ids`` so its logical positions stay
contiguous. Transformers builds the causal mask from the physical cache length, so holes are
invisible to the model (checked to float precision in tests/test_kv.py); sliding-window models are the
exception, their window counts columns, so they get 4D masks over logical positions (``window_masks``).
Once holes take more than a set fraction of the columns, :meth:`BatchKV.compact` squeezes them out
with one gather per layer.

Rows are right-aligned after compaction and merges (holes on the left), and prompts are right-padded,
so no query row is ever fully masked.

Appending is in place (:class:`GrowingLayer`): Hugging Face's ``DynamicLayer`` concatenates, which
copies a layer's whole cache on every forward.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare capacity in place, growing by half when full.

    Why: ``DynamicLayer.update`` concatenates, so every forward copies the layer's whole cache: O(P) per
    forward and quadratic over a generation. At batch 8 with 1,500 cached tokens a 1-token forward of the
    default target took 62 ms with it and 30 ms with this layer on a 2-core CPU
    (benchmarks/kv_append.py). ``StaticLayer`` preallocates, but to a fixed maximum length that
    attention then reads in full at every step.

    ``keys``/``values`` stay plain views [B, H, n, D] of the buffers, so everything that reads, crops or
    replaces them (holes, compaction, row selection, merges) works unchanged. The layer writes in place
    only while ``keys`` is still the head of its own buffer; after any replacement, and after
    :meth:`disown` (the buffer may be shared, see ``_copy_cache``), the next update first copies into a
    fresh buffer. So a write never lands in memory another tensor still reads.
    """

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.disown()

    def disown(self) -> None:
        self._kbuf = self._vbuf = None  # [B, H, capacity, D] each

    def _writable(self, n: int, t: int) -> bool:
        k, buf = self.keys, self._kbuf
        return (
            buf is not None
            and k.dim() == 4
            and k.data_ptr() == buf.data_ptr()
            and k.shape[:2] == buf.shape[:2]
            and k.stride() == buf.stride()
            and n + t <= buf.shape[2]
            and (torch.is_inference_mode_enabled() or not buf.is_inference())
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states [B, H, t, D] -> keys, values [B, H, n+t, D] (views of the buffers)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        t = key_states.shape[-2]
        if not self._writable(n, t):
            capacity = n + t + max(64, (n + t) // 2)
            # Each from its own shape: keys and values may differ in width (DeepSeek-V2/V3's MLA caches a
            # latent as keys and the rotary part as values)
            kbuf = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[3])
            vbuf = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[3])
            if n:
                kbuf[:, :, :n], vbuf[:, :, :n] = self.keys, self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[:, :, n : n + t] = key_states
        self._vbuf[:, :, n : n + t] = value_states
        self.keys, self.values = self._kbuf[:, :, : n + t], self._vbuf[:, :, : n + t]
        return self.keys, self.values


def new_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose layers append in place. Sliding-window layers become full
    ones too: their window is applied by the mask over logical positions (``window_masks``), since a
    layer that keeps only the last W columns would drop tokens once holes take some of them."""
    cache = DynamicCache(config=config)  # its layer types were checked once, by make_hole_safe
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def sliding_window(config) -> int | None:
    """The attention window of a model with sliding-window layers, else None."""
    c = getattr(config, "text_config", config)
    w = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if not w or getattr(c, "use_sliding_window", True) is False or (types is not None and "sliding_attention" not in types):
        return None
    return int(w)


def window_masks(key_pos: torch.Tensor, query_pos: torch.Tensor, query_valid: torch.Tensor, window: int,
                 mixed: bool, dtype: torch.dtype | None):
    """4D attention masks over *logical* positions, for models with sliding-window layers.

    Why: transformers builds a sliding window over physical cache columns, and rejected drafts leave
    holes between them, so a physical window would hide keys that are logically inside it. A 4D mask is
    passed to attention as it is, so the window here is the model's own (a key at logical position j is
    seen from position i when i - W < j <= i, transformers' ``sliding_window_overlay``).

    key_pos     [B, K] logical position of each key column, -1 for a hole (the last T are the inputs).
    query_pos   [B, T] logical position of each input; query_valid [B, T] bool (padding is False).
    dtype       None for a bool mask (SDPA; a quarter of a float32 one, for long prefills), else the
                additive mask eager attention adds to its scores (0 or the dtype's minimum).
    returns     [B, 1, T, K] mask, or for models that mix full and sliding layers,
                {"full_attention": ..., "sliding_attention": ...}, the mapping their forward takes.
    """
    t, k = query_pos.shape[1], key_pos.shape[1]
    kp, qp = key_pos[:, None, None, :], query_pos[:, None, :, None]  # [B, 1, 1, K], [B, 1, T, 1]
    full = (kp >= 0) & (kp <= qp)  # [B, 1, T, K]
    # A padding input attends to itself only: its output is never read, and no row is fully masked.
    own = torch.zeros(t, k, dtype=torch.bool, device=key_pos.device)  # [T, K]
    own[:, k - t :] = torch.eye(t, dtype=torch.bool, device=key_pos.device)
    pad = ~query_valid[:, None, :, None]  # [B, 1, T, 1]
    full = torch.where(pad, own, full)
    slide = full & ((kp > qp - window) | pad)

    def form(m: torch.Tensor) -> torch.Tensor:
        if dtype is None:
            return m
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)

    if mixed:
        return {"full_attention": form(full), "sliding_attention": form(slide)}
    return form(slide)


def make_hole_safe(model) -> None:
    """Once per model, by whatever owns its caches (the engine, a disaggregated worker), before any
    BatchKV of it runs a forward: refuse models whose attention depends on where a key sits in the cache
    rather than on its position_ids and the mask, since holes would change their output (MPT's ALiBi over
    the physical key index; GPT-Neo's local layers, a window over physical columns; Llama-4), and sliding-window
    models on flash-attention-2, which takes no 4D mask (``window_masks``)."""
    c = getattr(model.config, "text_config", model.config)
    base = _base_model(model)
    # A model that takes no cache (OpenAI-GPT, RWKV, Mamba) ignored the engine's: each forward saw only its
    # own inputs, which gave other tokens than the target's, or failed deep inside a step.
    if "past_key_values" not in _forward_parameters(model):
        raise ValueError(f"model type {c.model_type!r} is not supported: its forward takes no past_key_values "
                         f"(speculative decoding needs a key/value cache it can roll back)")
    # Here, once, not at the first request (a server started healthy, then failed every request)
    for layer in DynamicCache(config=base.config).layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise ValueError(f"model type {c.model_type!r} is not supported: its {type(layer).__name__} cache layers are "
                             f"no plain key/value columns (a recurrent state, or layers sharing another's), and holes "
                             f"and rollback need them")
    # Llama-4: its chunked layers build their chunks over physical columns, and its NoPE layers' attention
    # temperature scales with the cache's column count (get_seq_length), holes included
    chunked = "chunked_attention" in (getattr(c, "layer_types", None) or ()) or getattr(c, "attn_temperature_tuning", False)
    if c.model_type == "mpt" or chunked or (c.model_type == "gpt_neo" and "local" in str(getattr(c, "attention_layers", ""))):
        raise ValueError(f"model type {c.model_type!r} is not supported: its attention reads a key's place in the "
                         f"cache rather than its position ids, so the cache's holes (rejected drafts) would change its output")
    if sliding_window(c) and getattr(model.config, "_attn_implementation", None) == "flash_attention_2":
        raise ValueError(f"model type {c.model_type!r} has sliding-window layers, which need a 4D attention mask "
                         f"over logical positions; flash_attention_2 takes none: use attn_implementation sdpa or eager")


def _base_model(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft draft forwards **kwargs
    return getattr(base, "_orig_mod", base)  # and so does torch.compile's OptimizedModule


def _forward_parameters(model):
    """The parameters the model's own forward takes. The class's: an instance's forward may be a wrapper
    taking **kwargs (accelerate's hooks under device_map)."""
    return _class_parameters(type(_base_model(model)))


@functools.cache
def _class_parameters(cls) -> frozenset[str]:
    # cached: BatchKV reads it per instance, and a disaggregated cache splits its slab into a BatchKV per
    # row whenever its batch changes (inspect.signature cost 57 us each, 2.4x the split of 256 rows)
    return frozenset(inspect.signature(cls.forward).parameters)


def max_input_id(model) -> int:
    """The last id ``model`` embeds. A draft's embedding can be smaller than the target's (Qwen2.5
    0.5B: 151936 rows, 7B: 152064): a target id it lacks is fed to it as this one (``ids.clamp``). That
    only makes its proposals worse, never the output: verification decides every token."""
    return model.get_input_embeddings().weight.shape[0] - 1


class BatchKV:
    def __init__(self, model, batch_size: int, device: torch.device):
        """``model`` went through ``make_hole_safe`` (its owner does that once: this runs per admission)."""
        self.model = model
        self.max_id = max_input_id(model)
        # transformers 5's causal LMs compute logits for the last N inputs only (4.4x named it num_logits_to_keep)
        self.keeps_logits = "logits_to_keep" in _forward_parameters(model)
        c = getattr(model.config, "text_config", model.config)
        self.window = sliding_window(c)  # past this many columns, forward passes window_masks
        self.mixed = self.window is not None and "full_attention" in (getattr(c, "layer_types", None) or ())
        self.cache: DynamicCache | None = None
        # Logical position of each cache column, -1 for a hole.
        self.col_pos = torch.full((batch_size, 0), -1, dtype=torch.long, device=device)  # [B, P]
        # Next logical position per row = number of valid columns (they are always 0..n-1).
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]

    @property
    def batch_size(self) -> int:
        return self.col_pos.shape[0]

    @property
    def width(self) -> int:
        return self.col_pos.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        return self.col_pos >= 0  # [B, P]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, input_valid: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` to every row and return the logits.

        input_ids   [B, T] int64; invalid entries are padding (any id) and become holes.
        input_valid [B, T] bool; the valid entries of a row must come first (right padding).
        keep        the logits of the last ``keep`` inputs only (>= 1; None: all). Why: a prefill reads
                    none of its logits, and all of them are [B, T, V]: 1.2 GB in float32 for 4 prompts
                    of 512 tokens at Qwen2's 152k vocabulary, where keep=1 made the prefill of a 4-layer
                    Qwen2-shaped model 2.9x faster and the default draft's 1.6-2.1x
                    (benchmarks/prefill_logits.py, results/prefill_logits.jsonl).
        returns     [B, T, V] logits, or [B, keep, V].
        """
        if keep is not None and not 1 <= keep <= input_ids.shape[1]:
            raise ValueError(f"keep must be in [1, {input_ids.shape[1]}] (the inputs), got {keep}")
        # transformers reads logits_to_keep=0 as "all"; a model without the argument computes all, cut below
        extra = {"logits_to_keep": keep} if keep is not None and self.keeps_logits else {}
        width, fresh = self.width, self.cache is None
        if fresh:
            self.cache = new_cache(self.model.config)
        offs = input_valid.long().cumsum(1) - 1  # [B, T]
        pos = self.length[:, None] + offs.clamp_min(0)  # [B, T]
        new_pos = torch.where(input_valid, pos, -1)  # [B, T]
        # Within the window's width of columns transformers' own (physical) window hides nothing, and
        # plain causal attention keeps SDPA's fast path; past it, the logical mask (a [B, 1, T, K] mask
        # per layer type, ~B·T² bytes at a long prefill).
        if self.window and self.width + input_ids.shape[1] > self.window:
            sdpa = getattr(self.model.config, "_attn_implementation", None) == "sdpa"
            attention_mask = window_masks(torch.cat([self.col_pos, new_pos], 1), pos, input_valid, self.window,
                                          self.mixed, None if sdpa else self.model.dtype)
        else:
            mask = torch.cat([self.valid, input_valid], dim=1)  # [B, P+T]
            # No holes anywhere: let attention take its plain causal path instead of building a 4D mask.
            attention_mask = None if bool(mask.all()) else self._hole_mask(mask, input_ids.shape[1])
        try:
            out = self.model(
                input_ids=input_ids.clamp(max=self.max_id),
                attention_mask=attention_mask,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                **extra,
            )
        except BaseException:
            # Raised part-way (out of memory in some layer): the layers before it have appended this
            # forward's columns. Cut them back, so the cache holds what col_pos says and a later forward
            # of these rows works (a disaggregated worker's failed draft-ahead went on to fail every step).
            if fresh:
                self.cache = None
            for layer in self._layers():
                keys = getattr(layer, "keys", None)
                if keys is not None and keys.dim() == 4 and keys.shape[2] > width:
                    layer.keys, layer.values = keys[:, :, :width], layer.values[:, :, :width]
            raise
        self.col_pos = torch.cat([self.col_pos, new_pos], dim=1)
        self.length = self.length + input_valid.long().sum(1)
        return out.logits if keep is None else out.logits[:, -keep:]

    def _hole_mask(self, mask: torch.Tensor, t: int) -> torch.Tensor:
        """The attention mask for key columns ``mask`` [B, P+T] (False: a hole or padding) and T inputs.

        On SDPA, the 4D bool mask transformers would build from the 2D one (a key is seen when valid and at
        or before the query's column), in at most three ops. Given the 2D mask, transformers builds it in
        every forward: a cache with holes made the default draft's forward at batch 8 cost 1.09-1.11x one
        without (benchmarks/draft_call_cost.py, "holes"), and this cut the engine's draft time there to
        0.89-0.98x (benchmarks/hole_mask.py). Other attention takes the 2D mask: eager adds a float mask,
        and flash-attention-2 unpads rows by a 2D one.
        returns [B, 1, T, P+T] bool on SDPA, else [B, P+T] int64."""
        if getattr(self.model.config, "_attn_implementation", None) != "sdpa":
            return mask.long()
        if t == 1:  # the one query sits in the last column: causality hides nothing
            return mask[:, None, None, :]
        causal = torch.ones(t, mask.shape[1], dtype=torch.bool, device=mask.device).tril(mask.shape[1] - t)  # [T, P+T]
        return mask[:, None, None, :] & causal  # [B, 1, T, P+T]

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to ``lengths[b]`` tokens: columns at positions >= it become holes. [B]"""
        self.col_pos = torch.where(self.col_pos >= lengths[:, None], -1, self.col_pos)
        self.length = torch.minimum(self.length, lengths)
        # Columns that are holes in every row at the right end need no mask: crop them (a view, no
        # copy). At batch 1 every hole is such a suffix, so single-sequence decoding never has holes.
        used = torch.nonzero(self.valid.any(0))  # [n, 1]
        keep = int(used[-1]) + 1 if len(used) else 0
        if keep < self.width:
            self.col_pos = self.col_pos[:, :keep]
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]

    def hole_fraction(self) -> float:
        if self.width == 0 or self.batch_size == 0:
            return 0.0
        return 1.0 - float(self.length.max()) / self.width

    def _layers(self):
        return self.cache.layers if self.cache is not None else []

    def compact(self) -> None:
        """Squeeze holes out: keep each row's valid columns in order, right-aligned, width = max length."""
        new_width = int(self.length.max()) if self.batch_size else 0
        # Stable sort on validity moves holes first and keeps valid columns in their order.
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, self.width - new_width :]  # [B, P']
        self.col_pos = torch.gather(self.col_pos, 1, order)
        for layer in self._layers():
            layer.keys, layer.values = (torch.gather(t, 2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                                        for t in (layer.keys, layer.values))  # each its own shape (MLA)

    def select(self, rows: torch.Tensor, compact_above: float = 0.5) -> None:
        """Keep only ``rows`` (indices into the batch), in that order. [B']
        Compacts if holes then take more than ``compact_above`` of the columns (the engine passes its
        EngineConfig.compact_hole_fraction)."""
        col_pos = self.col_pos[rows]  # [B', P]
        # Leading columns that are holes in every kept row go too (free: this copies anyway). They are
        # the rows that left; kept, the width grew a column a step for as long as the batch never emptied
        # whenever compaction did not run (compact_hole_fraction 1.0 never does).
        live = (col_pos >= 0).any(0)  # [P]
        first = int(live.to(torch.int8).argmax()) if bool(live.any()) else 0
        self.col_pos = col_pos[:, first:]
        self.length = self.length[rows]
        for layer in self._layers():
            layer.keys = layer.keys[rows, :, first:]
            layer.values = layer.values[rows, :, first:]
        if self.batch_size and self.hole_fraction() > compact_above:
            self.compact()  # the rows that left may have been the longest

    def extend(self, other: "BatchKV") -> None:
        """Append the rows of ``other`` (same model) below these, left-padding the narrower with holes."""
        width = max(self.width, other.width)
        base = self.cache if self.cache is not None else other.cache
        if base is not None:
            n = len(base.layers)
            mine = self._layers() or [None] * n
            theirs = other._layers() or [None] * n
            for layer, a, b in zip(base.layers, mine, theirs):
                ka, va = (a.keys, a.values) if a is not None else (None, None)
                kb, vb = (b.keys, b.values) if b is not None else (None, None)
                keys = _stack_rows(ka, kb, self.batch_size, other.batch_size, width)
                values = _stack_rows(va, vb, self.batch_size, other.batch_size, width)
                layer.keys, layer.values = keys, values
            self.cache = base
        self.col_pos = torch.cat([_pad_left(self.col_pos, width, -1), _pad_left(other.col_pos, width, -1)], dim=0)
        self.length = torch.cat([self.length, other.length])


    @classmethod
    def merge(cls, model, device: torch.device, parts: list["BatchKV"]) -> "BatchKV":
        """One batch from many (rows in order), left-padding each to the widest with holes. One copy
        per layer, however many parts: extend() pairwise would copy the growing batch each time.
        A part with no cache yet (a sequence that was never fed) becomes a row of holes."""
        out = cls(model, 0, device)
        width = max((p.width for p in parts), default=0)
        out.col_pos = torch.cat([_pad_left(p.col_pos, width, -1) for p in parts]) if parts else out.col_pos  # [B, P]
        out.length = torch.cat([p.length for p in parts]) if parts else out.length  # [B]
        ref = next((p.cache for p in parts if p.cache is not None and p._layers()[0].keys is not None), None)
        if ref is None:
            return out
        out.cache = _copy_cache(ref)
        for i, layer in enumerate(out.cache.layers):
            k0, v0 = ref.layers[i].keys, ref.layers[i].values  # [b, H, P, D] templates for rows without a cache
            keys, values = [], []
            for p in parts:
                if p.cache is None or p.cache.layers[i].keys is None:
                    keys.append(k0.new_zeros(p.batch_size, k0.shape[1], width, k0.shape[3]))
                    values.append(v0.new_zeros(p.batch_size, v0.shape[1], width, v0.shape[3]))
                else:
                    keys.append(_pad_left(p.cache.layers[i].keys, width))
                    values.append(_pad_left(p.cache.layers[i].values, width))
            layer.keys, layer.values = torch.cat(keys), torch.cat(values)
        return out

    def split(self) -> list["BatchKV"]:
        """One single-row BatchKV per row (views of this batch's tensors: no copy here)."""
        rows = []
        for i in range(self.batch_size):
            kv = BatchKV(self.model, 0, self.col_pos.device)
            kv.col_pos, kv.length = self.col_pos[i : i + 1], self.length[i : i + 1]
            if self.cache is not None:
                kv.cache = _copy_cache(self.cache)
                for layer in kv.cache.layers:
                    if layer.keys is not None:
                        layer.keys, layer.values = layer.keys[i : i + 1], layer.values[i : i + 1]
            rows.append(kv)
        return rows


def _copy_cache(cache: DynamicCache) -> DynamicCache:
    """A new DynamicCache object with new layer objects that still point at the same tensors. Both sides
    then share buffers, so neither may append into them in place any more: each copies on its next write."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in cache.layers + new.layers:
        if isinstance(layer, GrowingLayer):
            layer.disown()
    return new


def pad_right(seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences (lists or 1D tensors) as ids [B, W] int64 and valid [B, W] bool, right-padded."""
    lens = torch.tensor([len(s) for s in seqs])
    width = int(lens.max()) if len(seqs) else 0
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return ids, torch.arange(width)[None, :] < lens[:, None]


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as ids [B, W] int64 and attention_mask [B, W] int64, left-padded with ``pad_id``:
    the layout Hugging Face batched ``generate`` requires."""
    width = max(map(len, seqs))
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs])  # [B, W]
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])  # [B, W]
    return ids, mask


def _stack_rows(a: torch.Tensor | None, b: torch.Tensor | None, rows_a: int, rows_b: int, width: int) -> torch.Tensor:
    """Stack two [B, H, P, D] caches along the batch; a missing one (rows with no columns yet) is all holes."""
    ref = a if a is not None else b

    def part(t: torch.Tensor | None, rows: int) -> torch.Tensor:
        return ref.new_zeros(rows, ref.shape[1], width, ref.shape[3]) if t is None else _pad_left(t, width)

    return torch.cat([part(a, rows_a), part(b, rows_b)], dim=0)


def _pad_left(t: torch.Tensor, width: int, value: int = 0) -> torch.Tensor:
    """Left-pad the sequence dim (dim 2 for [B, H, P, D] caches, dim 1 for [B, P]) to ``width``."""
    dim = 2 if t.dim() == 4 else 1
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_full(shape, value), t], dim=dim)
