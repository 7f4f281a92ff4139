"""The serving core a replica runs: the pair, one draft per expert, the async engine loop, online
distillation per expert and telemetry. Ray-free: deployments/ wraps it, tests drive it directly.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from .config import EngineConfig, SamplingParams
from .distill.guard import GuardConfig
from .distill.online import OnlineDistiller
from .distill.recorder import RecordConfig, Recorder
from .distill.replay import BufferConfig, ReplayBuffer
from .distill.siblings import newest_sibling
from .distill.spill import ReplicaSpill, pair_of
from .distill.trainer import DistillTrainer, TrainConfig
from .distill.versions import VersionStore, VersionWatcher, claim_slot, draft_fingerprint
from .logprobs import delta_body
from .output import finish_counts
from .serving import AsyncSpecServer
from .telemetry import Telemetry


def model_paths(cfg) -> tuple[str, str]:
    """cfg.target/draft, or the embedded default pair, built first (progress on stderr) if missing."""
    if cfg.target is not None:  # expanded: the Ray controller's from_pretrained took ~/d for a bad hub id
        from .loading import expand

        return expand(cfg.target), expand(cfg.draft)
    from .bootstrap import build_pair

    pair = build_pair()
    return pair["target"], pair["draft"]


def model_config(cfg):
    """The ``ModelConfig`` of an app config (colocated and disaggregated replicas load from it)."""
    from .loading import ModelConfig

    target, draft = model_paths(cfg)
    return ModelConfig(target=target, draft=draft, dtype=cfg.dtype, draft_dtype=cfg.draft_dtype, device=cfg.device,
                       cpu_packed_linear=cfg.cpu_packed_linear)


def load_models(cfg):
    """(target, base draft, tokenizer)."""
    from .loading import load_pair

    return load_pair(model_config(cfg))


def expert_draft(base, adapter: str | None, name: str = "expert"):
    """The base draft with expert ``name``'s LoRA adapter merged in (safetensors only, via peft)."""
    d = copy.deepcopy(base)
    if adapter is None:
        return d
    from .loading import attach_adapter

    try:
        return attach_adapter(d, name, adapter).merge_and_unload()
    except (NotImplementedError, AttributeError) as e:  # an adapter type peft cannot merge: named, not a traceback
        raise ValueError(f"adapter {name!r} at {adapter!r} cannot be merged into the draft: {e}") from e


def _inherited_from(dist: OnlineDistiller, version: int | None) -> str | None:
    """Where the serving version came from if a sibling slot learned it ("slot-N version V", siblings.py)."""
    try:
        meta = dist.store.meta(version) if version is not None else {}
    except (OSError, ValueError):  # pruned meanwhile, or a half-copied store: nothing to say
        return None
    return meta.get("from") if meta.get("reason") == "inherited" else None


class SpecService:
    def __init__(self, cfg, models=None, replica_tag: str = "local", record_sink=None, private_versions: bool = False,
                 versions_dir: Path | None = None):
        """cfg: deployments.config.AppConfig (or anything with its fields).

        record_sink(record): distillation runs elsewhere (deployments/distiller.py): finished
        requests' records go to the sink, and new versions are picked up from versions_dir.
        private_versions: a Ray Serve replica, whose id no later replica has: the local backend keeps
        its versions in a slot directory (versions_dir/replicas/slot-N, distill.versions.claim_slot)
        held while it lives, so the replica that replaces it resumes them; otherwise under
        versions_dir/<replica_tag>. versions_dir: instead of cfg's (a Serve application's own, deployments.config.versions_root)."""
        self.cfg, self.replica_tag = cfg, replica_tag
        self._slot = None  # the open lock file holding this replica's slot
        self.spill: ReplicaSpill | None = None  # the local backend's record files, in that slot
        self.versions_dir = versions_dir or Path(os.path.expanduser(cfg.distill.versions_dir))
        self.target, base, self.tokenizer = models or load_models(cfg)
        drafts = {e.name: expert_draft(base, e.adapter, e.name) for e in cfg.experts}
        econf = EngineConfig(max_batch_size=cfg.max_batch_size, max_model_len=cfg.max_model_len,
                             prefill_chunk_tokens=cfg.prefill_chunk_tokens)
        w = cfg.wandb
        self.telemetry = Telemetry(w.mode, w.project, w.dir, w.log_every_s, config=cfg.without_keys(),
                                   name=f"osd-serve-{replica_tag}")
        self.server: AsyncSpecServer | None = None
        self.distillers: dict[str, OnlineDistiller] = {}
        self.watcher: VersionWatcher | None = None
        try:
            self._start(drafts, econf, record_sink, private_versions)
        except BaseException:  # a full disk in a distiller, a store of another draft's shapes: the replica fails,
            self.close()  # and what started is stopped (the W&B run and its timer, engine and distiller threads, the slot)
            raise

    def _start(self, drafts: dict, econf: EngineConfig, record_sink, private_versions: bool) -> None:
        cfg, replica_tag = self.cfg, self.replica_tag
        self.server = AsyncSpecServer(self.target, self.tokenizer, drafts, econf, on_step=self.telemetry.on_step,
                                      stall_timeout_s=cfg.stall_timeout_s)
        d = cfg.distill
        if d.enabled and record_sink is not None:
            self._watch_versions(self.versions_dir, record_sink, RecordConfig(keep=d.keep, topk=d.record_topk))
        elif d.enabled:
            root, files = self.versions_dir / replica_tag, None
            if private_versions:  # the slot's lock makes its files this replica's alone, records as versions
                root, self._slot = claim_slot(root.parent / "replicas")
                # The target's weights too: records are its distributions, and new weights at the same path (a
                # retrained target) would have the draft fitted to the old ones'
                pair = [*pair_of(cfg), draft_fingerprint(self.target.state_dict())]
                self.spill = files = ReplicaSpill(root / ".replay", pair)
                files.keep_only(list(self.server.engines))
            for name, eng in self.server.engines.items():
                train = TrainConfig(mode=d.mode, lr=d.lr, steps_per_update=d.steps_per_update,
                                    time_limit_s=d.train_time_limit_s)
                trainer = DistillTrainer(eng.draft, train, vocab=eng.vocab)
                buf = ReplayBuffer(BufferConfig(max_bytes=d.buffer_mb << 20, trigger_records=d.trigger_records,
                                                trigger_age_s=d.trigger_age_s), on_drop=files and files.dropped)
                if files is not None:
                    files.restore(name, buf)
                dist = OnlineDistiller(eng, trainer, buf, VersionStore(root / name, d.keep_versions), GuardConfig(),
                                       RecordConfig(keep=d.keep, topk=d.record_topk), files=files,
                                       # a fresh slot (a scale-up, a surge redeploy) starts from what its siblings learned
                                       inherit=files and functools.partial(newest_sibling, root, name, pair=files.pair))
                dist.on_update = self._update_hook(name)
                dist.start()
                self.distillers[name] = dist
        for name, eng in self.server.engines.items():  # each expert's version series starts now, not at its first update
            self.telemetry.on_event(name, version=eng.draft_version)

    def _watch_versions(self, root: Path, sink, record_cfg: RecordConfig) -> None:
        """Records go to the sink; a watcher swaps in any version another process publishes."""
        self.watcher = VersionWatcher(root, lambda name, state, v: self.server.engines[name].swap_draft(state, v),
                                      on_swap=lambda name, v: self.telemetry.on_event(name, version=v))
        for name, eng in self.server.engines.items():
            eng.recorder = Recorder(record_cfg, on_finish=lambda rec, tr: rec is not None and sink(rec))
            version, state = self.watcher.watch(name, eng.draft.state_dict)
            if state is not None:
                eng.swap_draft(state, version)
            eng.draft_version = version

    def load(self) -> tuple[int, int]:
        """(ongoing sequences, capacity): what the distill controller weighs against training."""
        engines = self.server.engines.values()
        return sum(len(e.running) + len(e.waiting) for e in engines), self.cfg.max_batch_size * len(engines)

    def _update_hook(self, expert: str):
        def hook(res) -> None:
            loss = res.losses[-1] if res.losses else None
            self.telemetry.on_event(expert, version=res.version if res.published else None, published=int(res.published),
                                    loss=loss, buffer_bytes=self.distillers[expert].buffer.nbytes,
                                    heldout_alpha_hat=res.candidate.get("expected_acceptance"))
        return hook

    def experts(self) -> list[str]:
        return list(self.server.engines)

    async def ready(self) -> None:
        """Raises unless the engine loop runs (what /health reports); no warnings to give."""
        why = self.server.health()
        if why is not None:
            raise RuntimeError(why)

    async def stream(self, expert: str, prompt, params: SamplingParams) -> AsyncIterator[dict]:
        """prompt: text, token ids, or chat messages [{"role", "content"}] (rendered here)."""
        t0 = time.perf_counter()
        prompt = await self.server.prepare(prompt, params, expert)  # once: generate takes the Prompt as is
        n_prompt = len(prompt.ids)
        finish = None
        try:
            async for d in self.server.generate(prompt, params, expert):
                finish = d.finish_reason
                yield delta_body(d, self.tokenizer, n_prompt)
        finally:  # also when the client went away (aclose), which telemetry leaves out of latency
            self.telemetry.on_request(expert, time.perf_counter() - t0, finish)

    async def admin_experts(self) -> dict:
        out = {}
        for name, eng in self.server.engines.items():
            dist = self.distillers.get(name)
            shard = dist.buffer.shards.get(name) if dist else None
            out[name] = {"serving_version": eng.next_draft_version, "running": len(eng.running), "waiting": len(eng.waiting),
                         "finished": finish_counts(eng.finished),
                         "versions": dist.store.versions if dist else self._watched_versions(name),
                         "updates": dist.n_updates if dist else 0, "buffer_bytes": dist.buffer.nbytes if dist else 0,
                         # the records held, and those toward the next update's trigger (also after a restart)
                         "buffer_records": len(shard.records) if shard else 0,
                         "buffer_new": shard.new_since_update if shard else 0, "last_error": dist.error if dist else None,
                         "inherited_from": _inherited_from(dist, eng.next_draft_version) if dist else None}
        return {"experts": out, "replica": self.replica_tag}

    def _watched_versions(self, expert: str) -> list[int]:
        store = self.watcher.stores.get(expert) if self.watcher is not None else None
        return store.versions if store is not None else []

    async def admin_metrics(self) -> dict:
        self.telemetry.maybe_log(force=True)  # closes the window: a call after a burst of traffic reports that burst
        return {"history": self.telemetry.recent()}

    async def admin_rollback(self, expert: str, to: int | None) -> dict:
        if self.watcher is not None and expert in self.watcher.stores:  # backend ray_train: the shared store
            version = await asyncio.to_thread(self.watcher.rollback, expert, to)
        else:
            version = await asyncio.to_thread(self._dist(expert).rollback, to)
        self.telemetry.on_event(expert, version=version, rollback=1)
        return {"expert": expert, "serving_version": version, "replica": self.replica_tag}

    async def admin_update(self, expert: str) -> dict:
        # With the local backend every replica has its own store: the answer names the one that acted.
        res = await asyncio.to_thread(self._dist(expert).update, expert, "admin")
        if res is None:
            return {"expert": expert, "updated": False, "reason": "too few records", "replica": self.replica_tag}
        return {"expert": expert, "updated": True, "published": res.published, "reason": res.reason, "version": res.version,
                "replica": self.replica_tag}

    def _dist(self, expert: str) -> OnlineDistiller:
        if expert not in self.distillers:
            why = "distill.enabled is false" if not self.cfg.distill.enabled else (
                "with distill.backend ray_train the cluster controller trains when the buffer's trigger fires")
            raise ValueError(f"expert {expert!r} has no distiller in this replica ({why})")
        return self.distillers[expert]

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        for d in self.distillers.values():
            d.stop()
        if self.server is not None:
            self.server.close()
        self.telemetry.close()
        slot, self._slot = self._slot, None  # the versions and records stay for the replica that takes it next
        if self.spill is not None:  # let go once the queued writes land (up to 10 s), or a hung one ends
            self.spill.close(then=slot.close if slot is not None else None)
            self.spill = None
        elif slot is not None:
            slot.close()
