"""The edges of every configured range: the first value outside each bound is refused by field name,
and the last value inside it is accepted (an off-by-one in either direction fails here)."""

from __future__ import annotations

import pytest

from deployments.config import parse_config
from osd_serve.config import EngineConfig, SamplingParams


@pytest.mark.parametrize("field, bad, good", [
    ("max_tokens", 0, 1),  # 0 tokens: a request that never produces anything
    ("top_k", 2**31, 2**31 - 1),  # past int32 the sampler's tensors overflow
    ("top_k", -2, -1),  # -1 disables (vLLM's spelling); below it is a mistake
    ("top_p", 0.0, 1e-9),  # top_p 0 keeps no token at all
    ("top_p", 1.0 + 1e-9, 1.0),
    ("num_speculative_tokens", 17, 16),
    ("num_speculative_tokens", -1, 0),
    ("temperature", -1e-9, 0.0),
    ("stop", [""], ["x"]),  # an empty stop string matches at every position
    ("stop", ["x"] * 17, ["x"] * 16),
])
def test_sampling_params_bounds(field, bad, good):
    """Each SamplingParams field refuses the first value past its range, naming the field."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: bad})
    assert getattr(SamplingParams(**{field: good}), field) == good


@pytest.mark.parametrize("field, bad, good", [
    ("max_batch_size", 0, 1),
    ("max_model_len", 1, 2),  # a prompt token and one generated token at the least
    ("compact_hole_fraction", 0.0, 1.0),  # 0 would compact after every step (a full cache copy each)
    ("compact_hole_fraction", 1.5, 0.01),
    ("auto_k_max", 0, 16),
    ("auto_seeded_k", 17, 16),
    ("auto_seeded_k", -1, 0),
])
def test_engine_config_bounds(field, bad, good):
    """Each EngineConfig field refuses the first value past its range, naming the field."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        EngineConfig(**{field: bad})
    assert getattr(EngineConfig(**{field: good}), field) == good


@pytest.mark.parametrize("args, field", [
    ({"max_batch_size": 257}, "max_batch_size"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_model_len": 15}, "max_model_len"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"distill": {"lr": 1.0}}, r"distill\.lr"),  # lr 1 wrecks the draft in one update
    ({"distill": {"lr": 0.0}}, r"distill\.lr"),
    ({"experts": [{"name": "."}]}, r"experts\.0\.name"),  # "." and "..." name directories too
    ({"experts": [{"name": "..."}]}, r"experts\.0\.name"),
    ({"experts": [{"name": "default"}, {"name": "default"}]}, "experts: names must be unique"),
    ({"num_speculative_tokens": "auto", "topology": "disaggregated", "distill": {"backend": "ray_train"}},
     "num_speculative_tokens: 'auto' needs the colocated topology"),
    ({"batch_wait_timeout_s": 1.5}, "batch_wait_timeout_s"),
    ({"stall_timeout_s": 0}, "stall_timeout_s"),
    ({"distill": {"record_topk": -1}}, r"distill\.record_topk"),
    ({"distill": {"train_time_limit_s": 0}}, r"distill\.train_time_limit_s"),
    ({"distill": {"train_time_limit_s": ".inf"}}, r"distill\.train_time_limit_s"),
])
def test_app_config_bounds_name_the_field(args, field):
    """The serve config's ranges and cross-field rules: each refused value names its field."""
    with pytest.raises(ValueError, match=field):
        parse_config(args)


def test_app_config_edges_that_are_accepted():
    """The last values inside each range validate (and 'auto' is fine colocated)."""
    cfg = parse_config({"max_batch_size": 256, "max_model_len": 16, "num_speculative_tokens": 16,
                        "experts": [{"name": "default"}, {"name": "a.b"}], "distill": {"lr": 0.999}})
    assert (cfg.max_batch_size, cfg.max_model_len, cfg.num_speculative_tokens) == (256, 16, 16)
    assert parse_config({"num_speculative_tokens": "auto"}).num_speculative_tokens == "auto"
    assert parse_config({"stall_timeout_s": None}).stall_timeout_s is None  # never stalled


def test_prompt_char_limit_defaults_to_32_characters_per_token():
    """No max_prompt_chars: 32 characters per token of max_model_len; an explicit one wins."""
    assert parse_config({"max_model_len": 100}).prompt_char_limit == 3200
    assert parse_config({"max_model_len": 100, "max_prompt_chars": 10}).prompt_char_limit == 10


def test_vocabularies_of_one_size_that_map_tokens_differently_are_refused():
    """Speculative decoding compares token ids: two tokenizers of the same size whose ids name other
    tokens must be refused, not only tokenizers of different sizes."""
    from types import SimpleNamespace

    from osd_serve.loading import check_same_vocab

    tok = lambda v: SimpleNamespace(get_vocab=lambda: dict(v))  # noqa: E731
    check_same_vocab(tok({"a": 0, "b": 1}), tok({"b": 1, "a": 0}))
    with pytest.raises(ValueError, match=r"do not share a vocabulary \(2 vs 2 tokens; 2 target entries and 2 draft"):
        check_same_vocab(tok({"a": 0, "b": 1}), tok({"a": 1, "b": 0}))


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_that_cannot_be_fetched_says_why(offline, monkeypatch):
    """With HF_HUB_OFFLINE set the error says so (not "could not be reached"), and names the hub id."""
    from huggingface_hub import constants

    from osd_serve.loading import _load_error

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    msg = str(_load_error("org/no-such-model", "draft", OSError("We couldn't connect\nmore")))
    assert "draft model 'org/no-such-model' is not a local directory" in msg and "more" not in msg
    assert ("HF_HUB_OFFLINE is set" in msg) == offline and ("could not be reached" in msg) == (not offline)


def test_an_api_key_with_a_space_is_refused(no_env_keys):
    """A space is printable but an HTTP client strips or splits a bearer token at it: the key is refused
    at config time, naming the key, from the config or from the environment."""
    with pytest.raises(ValueError, match=r"api_key \(or OSD_API_KEY\): printable ASCII without spaces"):
        parse_config({"api_key": "sk 123"})
    with pytest.raises(ValueError, match=r"admin_key \(or OSD_ADMIN_KEY\)"):
        parse_config({"admin_key": " sk"})
    assert parse_config({"api_key": "sk-123~!"}).api_key == "sk-123~!"
