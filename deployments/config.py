"""The application's arguments (the `args:` of serve_config.yaml), validated by pydantic.

Errors name the field and what is allowed, e.g. `distill.trigger_records: Input should be greater
than or equal to 1`, and unknown keys are refused so a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Strict(BaseModel):
    # strict: YAML gives real types, so "4", true or 4.0 for a count is a mistake, not a 4 (true was k = 1)
    model_config = ConfigDict(extra="forbid", strict=True)


def _yaml_float(v):
    """PyYAML (YAML 1.1) reads 1e-3 and 5e-4, an exponent with no dot, as strings: a float field takes
    those as the number they spell; anything else goes to strict validation as it came."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


YamlFloat = Annotated[float, BeforeValidator(_yaml_float)]


def _local_path(v: str | None) -> bool:
    """Written as a path (no hub id starts with /, ., or ~), so it must exist where serve run reads
    the config: README asks for paths every node can read. Hub ids are checked where they load."""
    return v is not None and v.startswith(("/", ".", "~"))


# Files and folders of versions_dir/<app>/ that are not an expert's store (deployments/distiller.py)
RESERVED_NAMES = ("controller.json", "ray_train", "replicas")

# How long a replica that a redeploy or a scale-down stops keeps serving the requests it holds before Serve
# kills it (every deployment's graceful_shutdown_timeout_s; a config's `deployments:` entry may set its
# own). Serve's 20 s cut a stream mid-way (benchmarks/redeploy_drain.py); a hung replica's requests end
# that much later.
GRACEFUL_SHUTDOWN_S = 120.0


class ExpertConfig(_Strict):
    # A directory name under versions_dir (and replicas/slot-N): 100 characters keeps it well inside a
    # file system's 255-byte name limit (Errno 36 failed the replica's start, not `serve run`)
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    # The router's classifier: an expert whose keyword occurs in the prompt (case-insensitive) wins;
    # the first configured expert with a hit is taken, else `default_expert`.
    keywords: list[Annotated[str, Field(min_length=1)]] = []  # "" would match every prompt
    adapter: str | None = None  # a peft LoRA directory (adapter_model.safetensors) on the base draft

    @field_validator("adapter")
    @classmethod
    def _safetensors_dir(cls, v: str | None) -> str | None:
        # Checked here, at `serve run`: in the replica a bad adapter failed three starts and left the
        # app up with /health answering and every completion a 503.
        from osd_serve.loading import adapter_dir_problem

        if v is not None and (why := adapter_dir_problem(v)):
            raise ValueError(f"{v!r} {why}")
        return v

    @field_validator("name")
    @classmethod
    def _not_a_relative_dir(cls, v: str) -> str:  # the name is a directory under versions_dir
        if v.startswith("."):  # ".", "..", and the stores' own files: a slot's .owner, a store's .lock, .tmp-*
            raise ValueError("must not start with a dot (it names a directory under versions_dir, beside files "
                             "such as .owner and .lock)")
        if v in RESERVED_NAMES:  # its store would collide with the controller's files
            raise ValueError(f"must not be one of {', '.join(RESERVED_NAMES)} (it names a directory under versions_dir, "
                             f"beside those)")
        return v


class DistillConfig(_Strict):
    enabled: bool = True
    # local: each SpecServer replica distils its own traffic in a thread beside its engine.
    # ray_train: replicas send records to a replay buffer actor (Ray object store); a controller
    # runs Ray Train jobs on GPUs (or CPUs) serving leaves idle and publishes to versions_dir,
    # which every replica watches. versions_dir must then be storage all nodes share.
    backend: Literal["local", "ray_train"] = "local"
    max_train_workers: int = Field(4, ge=1)
    mode: Literal["full", "lora"] = "lora"
    trigger_records: int = Field(8, ge=1)
    trigger_age_s: YamlFloat = Field(60.0, gt=0, allow_inf_nan=False)
    steps_per_update: int = Field(16, ge=1)
    lr: YamlFloat = Field(1e-3, gt=0, lt=1)
    # An update stops taking steps this long after it began; what it learnt so far is guarded as any
    # update's. A Ray Train job's gradient all-reduce that waits this long (a hung worker) fails it.
    train_time_limit_s: YamlFloat = Field(600.0, gt=0, allow_inf_nan=False)
    # Record the target's distribution where the draft was rejected (the paper's choice), or everywhere.
    # mismatch measured as good for α at under a third of the bytes (benchmarks/OSD.md).
    keep: Literal["mismatch", "all"] = "mismatch"
    # 0 keeps each recorded distribution in full (float16, 2 bytes x vocab per position: 0.3 MB at a
    # 152k vocabulary); k keeps its top-k + the rest mass (a record over buffer_mb is dropped).
    record_topk: int = Field(0, ge=0)
    buffer_mb: int = Field(256, ge=1)
    versions_dir: str = Field("~/.cache/osd-serve/versions", min_length=1)  # "": each process's working directory
    keep_versions: int = Field(5, ge=1)


class WandbConfig(_Strict):
    # auto: online when WANDB_API_KEY is set, else offline (files under dir/wandb, no account needed)
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "osd-serve"
    dir: str = "~/.cache/osd-serve/wandb"
    log_every_s: YamlFloat = Field(10.0, gt=0, allow_inf_nan=False)


class AppConfig(_Strict):
    # local dir or hub id; both None: the embedded default pair (built if missing). "" is refused: it read as
    # the replica's working directory, and failed there ("no tokenizer files"), not at serve run.
    target: str | None = Field(None, min_length=1)
    draft: str | None = Field(None, min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # auto: the target's dtype, except float32 under a bfloat16/float16 target on CPU (faster there,
    # loading.ModelConfig.resolved_draft_dtype)
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    # CPU only: the target's linear layers use oneDNN on prepacked weights where that is faster, and
    # kernels/cpu_skinny.cpp for float32 calls of <= 48 rows on AVX-512 (kernels/cpu_linear.py; one
    # extra copy of the target's linear weights in memory)
    cpu_packed_linear: bool = True
    # colocated: draft and target in one replica (lowest latency per request). disaggregated: a draft
    # pool and a target verifier as separate deployments, one call each per speculation step.
    topology: Literal["colocated", "disaggregated"] = "colocated"
    # disaggregated: draft the next step while the target verifies this one. auto: only where the draft
    # runs on a GPU; on shared CPU cores it competes with the verifier (a step measured 1.10x slower,
    # benchmarks/results/disagg_overhead.json).
    draft_ahead: bool | Literal["auto"] = "auto"
    batch_wait_timeout_s: YamlFloat = Field(0.002, ge=0, le=1)  # disaggregated: @serve.batch's wait for a fuller batch
    # A replica whose torch thread has run one call (an engine step, a propose or verify batch) this
    # long fails its health checks, so /health reads 503 and Serve replaces it: a hung device call
    # raises nothing. Generous: a long prompt's prefill on CPU takes seconds. None: never.
    stall_timeout_s: YamlFloat | None = Field(300.0, gt=0, allow_inf_nan=False)
    experts: list[ExpertConfig] = [ExpertConfig(name="default")]
    default_expert: str = "default"
    max_batch_size: int = Field(8, ge=1, le=256)
    # "auto": the engine picks k each step for the batch it runs (osd_serve/auto_k.py); colocated only
    num_speculative_tokens: Annotated[int, Field(ge=0, le=16)] | Literal["auto"] = 4
    max_model_len: int = Field(2048, ge=16)
    # Prompt positions one engine step prefills (osd_serve/prefill.py): longer prompts are fed in chunks
    # over steps, the running streams decoding between them. None: all admitted prompts in one forward.
    prefill_chunk_tokens: int | None = Field(2048, ge=16)
    # Longer prompts are refused before they are tokenized (a 12 MB prompt took 30 s to encode).
    # None: 32 characters per token of max_model_len, far more than any tokenizer's text needs.
    max_prompt_chars: int | None = Field(None, ge=1)
    # Keys: from here or the environment (OSD_API_KEY, OSD_ADMIN_KEY). No api_key: /v1 is open.
    # No admin_key: admin routes are disabled (404), never open.
    # repr=False: a logged or printed config never shows them.
    api_key: str | None = Field(None, repr=False)
    admin_key: str | None = Field(None, repr=False)
    served_model_name: str = Field("osd-serve", min_length=1)
    distill: DistillConfig = DistillConfig()
    wandb: WandbConfig = WandbConfig()

    @field_validator("api_key", "admin_key")
    @classmethod
    def _not_empty(cls, v: str | None) -> str | None:
        if v == "":  # read as "no key" it opened /v1 (or disabled admin) without a word
            raise ValueError("empty: leave it unset for no key")
        return v

    @property
    def prompt_char_limit(self) -> int:
        return self.max_prompt_chars or 32 * self.max_model_len

    def without_keys(self) -> dict:
        """The config as a dict for what needs no key (the model deployments, W&B): only the Router
        checks keys, and a deployment's init args are kept by Serve's controller."""
        return self.model_dump(exclude={"api_key", "admin_key"})

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        from osd_serve.loading import check_device  # CUDA itself is checked where the models load

        return check_device(v)

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        from osd_serve.loading import not_a_hub_id

        if (self.target is None) != (self.draft is None):
            raise ValueError("give both target and draft, or neither for the embedded default pair")
        for key in ("target", "draft"):
            v = getattr(self, key)
            if _local_path(v) and not Path(os.path.expanduser(v)).is_dir():
                raise ValueError(f"{key}: {v!r} is not a directory (give a model directory or a hub id)")
            if v is not None and not _local_path(v) and not Path(v).is_dir() and (why := not_a_hub_id(v)):
                # "models/llama/target" (a relative path without ./, not there): the replica blamed the Hub
                raise ValueError(f"{key}: {v!r} is neither a directory nor a hub id ({why})")
        names = [e.name for e in self.experts]
        if len(set(names)) != len(names):
            raise ValueError(f"experts: names must be unique, got {names}")
        if self.default_expert not in names:
            raise ValueError(f"default_expert: {self.default_expert!r} is not one of the experts {names}")
        if self.topology == "disaggregated" and self.num_speculative_tokens == "auto":
            raise ValueError("num_speculative_tokens: 'auto' needs the colocated topology (its engine times the "
                             "draft and the target of each step together); give an integer")
        # Not fields_set: each deployment validates the dumped config again, default included
        if self.topology == "disaggregated" and self.prefill_chunk_tokens != type(self).model_fields["prefill_chunk_tokens"].default:
            raise ValueError("prefill_chunk_tokens: only the colocated engine prefills in chunks (a disaggregated "
                             "Verifier feeds a sequence's whole prompt with its first verification); leave it at its default")
        if self.topology == "disaggregated" and self.distill.enabled and self.distill.backend != "ray_train":
            raise ValueError("distill.backend: the disaggregated topology distils with backend ray_train (no "
                             "replica holds both models to train beside); set it, or distill.enabled: false")
        self.api_key = self.api_key or os.environ.get("OSD_API_KEY") or None
        self.admin_key = self.admin_key or os.environ.get("OSD_ADMIN_KEY") or None
        for name, env in (("api_key", "OSD_API_KEY"), ("admin_key", "OSD_ADMIN_KEY")):
            key = getattr(self, name)
            # A bearer token travels in an HTTP header, which Starlette reads as latin-1 and which
            # cannot hold a newline: a key outside printable ASCII (a YAML `|` block's trailing
            # newline, an accented letter) validated and then locked every client out.
            if key is not None and not re.fullmatch(r"[\x21-\x7e]+", key):
                raise ValueError(f"{name} (or {env}): printable ASCII without spaces only, as an HTTP bearer token")
        return self


def parse_config(args: dict | None) -> AppConfig:
    """AppConfig from serve_config.yaml's args, or ValueError with one line per bad field."""
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as e:
        lines = [f"{'.'.join(str(p) for p in err['loc']) or 'args'}: {err['msg']}" for err in e.errors()]
        raise ValueError("invalid serve_config.yaml args:\n  " + "\n  ".join(lines)) from None


def replica_app() -> str | None:
    """The Serve application of the calling replica; None outside one (a script, a test)."""
    try:
        from ray.serve import get_replica_context

        return get_replica_context().app_name
    except Exception:  # noqa: BLE001  RayServeException outside a replica, ImportError without Ray
        return None


def check_gpu_reservation(cfg: AppConfig, deployment: str) -> None:
    """Warns where a replica will run on CUDA without having reserved a GPU (ray_actor_options.num_gpus).

    Ray (2.60) then leaves CUDA_VISIBLE_DEVICES alone, so the replica can use any GPU, but counts that
    GPU as free: it places more replicas, and the distiller's Ray Train workers (which take the GPUs
    serving leaves idle), on it, and they run out of memory or slow each other unsaid. A warning, not an
    error, since one replica alone on a GPU still serves. (A cuda:N past the GPUs a replica reserved is
    already a ValueError naming the device, in ModelConfig.)"""
    try:
        import ray
        import torch
        from ray.serve import get_replica_context

        get_replica_context()  # raises outside a replica (scripts, tests): no reservation to check
        if not ray.is_initialized():  # a test's stand-in context: get_gpu_ids would start a local cluster
            return
        reserved = ray.get_gpu_ids()
    except Exception:  # noqa: BLE001  RayServeException outside a replica, ImportError without Ray
        return
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda and not reserved:
        logging.getLogger(__name__).warning(
            "%s runs on CUDA (device %r) but reserved no GPU, so Ray counts the GPU as free and places other "
            "replicas and distillation workers on it. Add num_gpus (1, or a fraction such as 0.5) to %s's "
            "ray_actor_options in serve_config.yaml", deployment, cfg.device, deployment)


def versions_root(cfg: AppConfig, app: str | None) -> Path:
    """Where an application's draft versions live: versions_dir/<app>. Stores are per expert below it,
    so two applications on one versions_dir published over each other's "default" expert (each
    application's controller trains its own pair), and a local-backend replica took another
    application's slot and resumed its versions. None (no application): versions_dir itself. A name
    that is not a safe directory name as it is gets "-" and 8 hex digits of its hash after its sanitised
    form, so two names that sanitise alike ("team/a", "team_a") never share one."""
    root = Path(os.path.expanduser(cfg.distill.versions_dir))
    if not app:
        return root
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", app)  # one directory, whatever the application's name
    # else "chat v2" shared "chat_v2"'s; "." or ".." is no directory of its own; over 255 bytes, none at all
    if name != app or set(name) == {"."} or len(name) > 255:
        name = f"{re.sub(r'^[.]+$', lambda m: '_' * len(m[0]), name[:100])}-{hashlib.sha256(app.encode()).hexdigest()[:8]}"
    return root / name
