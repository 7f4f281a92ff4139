"""Typed configuration for the engine.

Plain dataclasses inside the core; pydantic models at the YAML/HTTP boundary (deployments/) wrap these.
Every check raises ``ValueError`` naming the field and the allowed range, so the HTTP layer can turn it
into a 400 that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SPECULATIVE_TOKENS = 16
AUTO = "auto"  # num_speculative_tokens: chosen by the engine each step (auto_k.py)
# Bounds that fit the int64 tensors and the generator seed these become (the API's limits too).
TOP_K_LIMIT = 2**31  # exclusive
# [low, high): int64, hashed to the generator's 32-bit seed (sampling.seeded_generator). A wider
# range would accept seeds that are one int64 (-1 and 2**64 - 1).
SEED_RANGE = (-(2**63), 2**63)
FLOAT32_MAX = 3.4028234663852886e38  # a temperature above it is inf in float32: every row NaN
# A temperature at or below it is 0.0 in float32 (half the smallest subnormal, a tie rounded to even),
# as the rows hold it (spec.RowState): greedy there, so greedy everywhere, or a row read as sampled here
# asks the draft for the probabilities an all-greedy batch never computes.
FLOAT32_ZERO = 2.0**-150
MAX_LOGPROBS = 20  # alternatives per generated token: OpenAI's top_logprobs limit (and vLLM's default max_logprobs)


def is_greedy(temperature: float) -> bool:
    return temperature <= FLOAT32_ZERO


def _check(cond, field_name: str, allowed: str, value: object) -> None:
    """cond: a bool, or a function of the value, called only once the value is a number of the field's
    kind (so a string or None is refused with the field's name, not a TypeError from comparing it)."""
    if callable(cond):
        cond = _is_number(value) and cond(value)
    if not cond:
        raise ValueError(f"{field_name} must be {allowed}, got {short_repr(value)}")


def short_repr(value: object, limit: int = 200) -> str:
    """repr for an error message, cut: a client's 500 KB stop list or model name is not sent back whole."""
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(shown)} characters)"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python, not a count to a user


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Per-request generation settings. ``temperature == 0`` is greedy decoding (and any temperature
    that is 0 in float32, ``is_greedy``)."""

    # None: the rest of the context, max_model_len minus the prompt's tokens (resolved per prompt,
    # output.fit_max_tokens); the chat API's default, as OpenAI's and vLLM's.
    max_tokens: int | None = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 disables, and so does -1 (vLLM's spelling, which its clients send)
    top_p: float = 1.0  # 1.0 disables
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # Draft tokens proposed per step for this request; 0 is plain decoding through the same path.
    # "auto": the engine picks k each step for the batch it runs (auto_k.py).
    num_speculative_tokens: int | str = 4
    # None: no logprobs. n: each generated token's logprob under the target, and its n likeliest
    # alternatives (logprobs.py)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               "an integer >= 1 (or None: the rest of the context)", self.max_tokens)
        _check(lambda t: 0.0 <= t <= FLOAT32_MAX, "temperature", ">= 0 and finite in float32", self.temperature)
        _check(_is_int(self.top_k) and -1 <= self.top_k < TOP_K_LIMIT, "top_k", "an integer in [-1, 2**31) (0 or -1 disables)", self.top_k)
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]), "seed",
               "a 64-bit integer, in [-2**63, 2**63)", self.seed)
        _check(lambda p: 0.0 < p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16,
            "stop",
            "a list of at most 16 non-empty strings",
            self.stop,
        )
        k = self.num_speculative_tokens
        _check(
            k == AUTO or (_is_int(k) and 0 <= k <= MAX_SPECULATIVE_TOKENS),
            "num_speculative_tokens",
            f"an integer in [0, {MAX_SPECULATIVE_TOKENS}] or {AUTO!r}",
            k,
        )
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
               f"an integer in [0, {MAX_LOGPROBS}] (or None)", self.logprobs)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def auto_k(self) -> bool:
        return self.num_speculative_tokens == AUTO


@dataclass
class EngineConfig:
    """Engine-wide settings."""

    max_batch_size: int = 8
    # The cache is compacted (holes left by rejected drafts squeezed out) once holes take more than this
    # fraction of its columns; compaction is a full copy, so doing it every step would cost more than the
    # attention over holes it saves.
    compact_hole_fraction: float = 0.5
    max_model_len: int = 2048
    # "auto" rows: k is chosen in 1..auto_k_max each step. A seeded sampled request asking for "auto"
    # drafts auto_seeded_k instead: its output is reproducible only while its k does not depend on
    # which requests share its batch (engine._uniforms draws 2·k + 1 uniforms per step).
    auto_k_max: int = 8
    auto_seeded_k: int = 4
    # Prompt positions one step may prefill, padding included (prefill.py): a longer prompt is fed in
    # chunks over several steps, and the running rows go on decoding between them. None: no limit.
    prefill_chunk_tokens: int | None = 2048
    # An admission prefills up to max_batch_size queued prompts (within that budget) in one forward, and
    # holds those beyond the free slots for the next ones (engine._prefill). False: only the free slots'.
    prefill_ahead: bool = True

    def __post_init__(self) -> None:
        _check(_is_int(self.max_batch_size) and self.max_batch_size >= 1, "max_batch_size", "an integer >= 1", self.max_batch_size)
        _check(lambda f: 0.0 < f <= 1.0, "compact_hole_fraction", "in (0, 1]", self.compact_hole_fraction)
        _check(_is_int(self.max_model_len) and self.max_model_len >= 2, "max_model_len", "an integer >= 2", self.max_model_len)
        _check(_is_int(self.auto_k_max) and 1 <= self.auto_k_max <= MAX_SPECULATIVE_TOKENS, "auto_k_max",
               f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]", self.auto_k_max)
        _check(_is_int(self.auto_seeded_k) and 0 <= self.auto_seeded_k <= MAX_SPECULATIVE_TOKENS, "auto_seeded_k",
               f"an integer in [0, {MAX_SPECULATIVE_TOKENS}]", self.auto_seeded_k)
        _check(self.prefill_chunk_tokens is None or (_is_int(self.prefill_chunk_tokens) and self.prefill_chunk_tokens >= 1),
               "prefill_chunk_tokens", "an integer >= 1 (or None: no limit)", self.prefill_chunk_tokens)
        _check(isinstance(self.prefill_ahead, bool), "prefill_ahead", "true or false", self.prefill_ahead)
