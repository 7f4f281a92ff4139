"""The app config (deployments/config.py): every bad value is refused when the config is read, by
field name, never in a replica after the models loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.config import parse_config


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="distill.trigger_records"):
        parse_config({"distill": {"trigger_records": 0}})
    with pytest.raises(ValueError, match="topolgy"):
        parse_config({"topolgy": "colocated"})
    with pytest.raises(ValueError, match="default_expert"):
        parse_config({"default_expert": "x"})
    with pytest.raises(ValueError, match="distill.backend: the disaggregated topology distils with backend ray_train"):
        parse_config({"topology": "disaggregated"})  # distillation is on by default, with backend local
    assert parse_config({"topology": "disaggregated", "distill": {"backend": "ray_train"}}).distill.enabled
    with pytest.raises(ValueError, match="draft_ahead"):
        parse_config({"draft_ahead": "sometimes"})
    with pytest.raises(ValueError, match="experts.1.name.*start with a dot"):  # it names a directory under versions_dir
        parse_config({"experts": [{"name": "default"}, {"name": ".."}]})
    assert parse_config({"draft_ahead": False}).draft_ahead is False and parse_config({}).draft_ahead == "auto"
    # coerced before: "4" and 4.0 were k = 4, true was k = 1, "yes" was true, [""] matched every prompt
    for args, field in (({"num_speculative_tokens": "4"}, "num_speculative_tokens"), ({"num_speculative_tokens": True},
                        "num_speculative_tokens"), ({"distill": {"enabled": "yes"}}, "distill.enabled"),
                        ({"experts": [{"name": "default", "keywords": [""]}]}, "experts.0.keywords.0"),
                        ({"served_model_name": ""}, "served_model_name")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            parse_config(args)
    assert parse_config({"distill": {"trigger_age_s": 60}}).distill.trigger_age_s == 60.0  # an int is a float
    yaml = pytest.importorskip("yaml")
    exp = yaml.safe_load("distill: {lr: 1e-3, trigger_age_s: 2e1}\nbatch_wait_timeout_s: 5e-3")  # YAML 1.1: strings
    assert isinstance(exp["distill"]["lr"], str)
    cfg = parse_config(exp)
    assert (cfg.distill.lr, cfg.distill.trigger_age_s, cfg.batch_wait_timeout_s) == (1e-3, 20.0, 5e-3)
    with pytest.raises(ValueError, match=r"distill\.lr"):
        parse_config({"distill": {"lr": "fast"}})
    for args, field in (({"distill": {"trigger_age_s": "nan"}}, r"distill\.trigger_age_s"), ({"wandb": {"log_every_s": float("inf")}},
                        r"wandb\.log_every_s")):  # NaN passed `<= 0`: the age trigger never fired
        with pytest.raises(ValueError, match=field):
            parse_config(args)
    for path in ("serve_config.yaml", "serve_config.disaggregated.yaml"):  # the shipped configs validate
        parse_config(yaml.safe_load((Path(__file__).resolve().parents[1] / path).read_text())["applications"][0]["args"])


def test_adapters_and_model_directories_are_checked_at_serve_run(tmp_path):
    """A missing or pickled adapter, or a target path that does not exist, failed only in the replica:
    three failed starts, then an app whose /health answered and whose every completion was a 503."""
    (tmp_path / "adapter_model.bin").write_bytes(b"")
    for adapter, why in ((str(tmp_path), "no adapter_model.safetensors"), (str(tmp_path / "nope"), "not a directory"),
                         (str(tmp_path / "adapter_model.bin"), "not a directory")):
        with pytest.raises(ValueError, match=f"experts.1.adapter: .*{why}"):
            parse_config({"experts": [{"name": "default"}, {"name": "sql", "adapter": adapter}]})
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="experts.0.adapter: .*no adapter_config.json"):  # peft needs both files
        parse_config({"experts": [{"name": "default", "adapter": str(tmp_path)}]})
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="experts.0.adapter: .*has peft_type None"):
        parse_config({"experts": [{"name": "default", "adapter": str(tmp_path)}]})
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    assert parse_config({"experts": [{"name": "default", "adapter": str(tmp_path)}]}).experts[0].adapter == str(tmp_path)
    with pytest.raises(ValueError, match="draft: '/no/such/draft' is not a directory"):
        parse_config({"target": str(tmp_path), "draft": "/no/such/draft"})
    assert parse_config({"target": "org/target", "draft": "org/draft"}).target == "org/target"  # hub ids load later


@pytest.mark.parametrize("key, why", [("", "empty"), ("sk-123\n", "printable ASCII"), ("clé-secrète", "printable ASCII")])
def test_a_key_no_client_could_send_is_refused_at_config_time(key, why, monkeypatch):
    """A key with a newline (a YAML `|` block) or a non-ASCII letter validated, then matched no header
    (Starlette reads headers as latin-1): every client was locked out. An empty one opened /v1."""
    monkeypatch.delenv("OSD_API_KEY", raising=False)
    with pytest.raises(ValueError, match=why):
        parse_config({"api_key": key})
    monkeypatch.setenv("OSD_API_KEY", key)
    if key:  # from the environment too
        with pytest.raises(ValueError, match="OSD_API_KEY"):
            parse_config({})
