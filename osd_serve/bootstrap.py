"""Build the embedded default (target, draft) pair of causal LMs, trained here on CPU.

Nothing can be downloaded, so the pair is trained from scratch on text every Python machine has,
the standard library's own source (or the user's `data_files`), and saved in plain Hugging Face
format with one shared byte-level BPE vocabulary, so the rest of osd-serve loads it like any
downloaded checkpoint. Sizes are set by the two numbers that decide whether speculation pays,
S = (1 - a^(k+1)) / ((1 - a)(k c + 1)), measured on a 2-core CPU:
  c = draft/target step time (batch 1, KV cache). A 1-layer draft costs ~2 ms, nearly all
      framework overhead, so the target must do ~20 ms of real work: ~30M fp32 parameters
      (120 MB; c ~ 0.09-0.15). Where that exceeds the L3 cache every step streams its weights
      from memory and verifying k+1 tokens costs about what one does (v ~ 1); on a host whose
      L3 holds it (260 MiB on one), verification turns compute-bound and v grows with k.
  a = greedy acceptance on the target's own greedy path. The draft is trained briefly, then
      distilled on the target's soft labels over the target's own greedy continuations of
      training prompts (a ~0.7-0.8 on held-out stdlib snippets); the rest is left for online
      distillation to win.
The ~10-minute build budget is what limits quality: the target sees ~0.5M tokens, far fewer than a
30M model wants, so the pair is a realistic *cost* model more than a useful text generator: its
greedy continuations soon repeat short lines (`#`, empty docstrings), which a draft distilled on them learns.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .cache_dir import build_lock, owner_tag, remove_tree, share_tree, sweep_dead_tmp, sync_tree

# Bumped whenever the recipe changes so stale caches are rebuilt rather than trusted.
BUILD_VERSION = 3
# Bumped when only how --data files become documents changes (2: chat records' turns, repeated held-out
# records kept out of training): builds from data are rebuilt, the default pair's cache stays good.
DATA_RECIPE = 2
COMPLETE_MARKER = "COMPLETE"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def _require(ok: bool, field_name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field_name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "intermediate", "heads", "kv_heads"):
            _require(getattr(self, name) >= 1, f"ModelDims.{name}", ">= 1", getattr(self, name))
        _require(self.hidden % self.heads == 0, "ModelDims.heads", f"a divisor of hidden={self.hidden}", self.heads)
        _require(self.heads % self.kv_heads == 0, "ModelDims.kv_heads", f"a divisor of heads={self.heads}",
                 self.kv_heads)


@dataclass(frozen=True)
class TrainSchedule:
    steps: int
    batch: int
    lr: float
    warmup: int

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "TrainSchedule.steps", ">= 1", self.steps)
        _require(self.batch >= 1, "TrainSchedule.batch", ">= 1", self.batch)
        _require(0.0 < self.lr < 1.0, "TrainSchedule.lr", "in (0, 1)", self.lr)
        _require(0 <= self.warmup < self.steps, "TrainSchedule.warmup", f"in [0, steps={self.steps})", self.warmup)


@dataclass(frozen=True)
class PairConfig:
    """Everything that determines the built pair; it is hashed into the cache key."""

    vocab_size: int
    seq_len: int
    target: ModelDims
    draft: ModelDims
    target_train: TrainSchedule
    draft_train: TrainSchedule
    # Then distil the draft on the target's soft labels over the target's own greedy continuations
    # of `distill_prompts` training prompts (sequence-level KD, Kim & Rush 2016): acceptance is
    # agreement with the target on the target's path, so that path is the data to learn from.
    # Default pair: greedy acceptance 0.50 (corpus windows, same 100 steps) -> 0.80 (build.json).
    # An fp32-trained target (v3 builds where bf16 is slower) gave 0.57 after the v2 recipe (256
    # prompts, 100 steps of 4) and 0.69 after this one (512, 300 of 8); 600 steps stayed at 0.69,
    # the 1-layer draft's limit. Soft labels are computed once, so the 300 steps cost ~1 minute.
    draft_distill: TrainSchedule | None
    corpus_max_bytes: int  # caps both tokenizer training and the token stream
    n_prompts: int = 64
    alpha_prompts: int = 16  # quick acceptance estimate recorded in build.json; 0 skips it
    alpha_new_tokens: int = 32
    distill_prompts: int = 512
    distill_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        # 256 byte symbols + 3 special tokens is the smallest byte-level BPE vocabulary.
        _require(259 <= self.vocab_size <= 65536, "PairConfig.vocab_size", "in [259, 65536]", self.vocab_size)
        _require(self.seq_len >= 8, "PairConfig.seq_len", ">= 8", self.seq_len)
        _require(self.corpus_max_bytes >= 1000, "PairConfig.corpus_max_bytes", ">= 1000", self.corpus_max_bytes)
        _require(self.n_prompts >= 1, "PairConfig.n_prompts", ">= 1", self.n_prompts)
        _require(self.distill_prompts >= 1, "PairConfig.distill_prompts", ">= 1", self.distill_prompts)
        _require(self.distill_new_tokens >= 1, "PairConfig.distill_new_tokens", ">= 1", self.distill_new_tokens)


PRESETS: dict[str, PairConfig] = {
    "default": PairConfig(
        vocab_size=4096, seq_len=256, corpus_max_bytes=6_000_000,
        target=ModelDims(hidden=512, layers=8, intermediate=1408, heads=8, kv_heads=8),  # 29.9M
        draft=ModelDims(hidden=192, layers=1, intermediate=512, heads=4, kv_heads=4, tie_embeddings=True),  # 1.2M
        target_train=TrainSchedule(steps=500, batch=4, lr=2e-3, warmup=30),
        draft_train=TrainSchedule(steps=300, batch=8, lr=3e-3, warmup=20),
        draft_distill=TrainSchedule(steps=300, batch=8, lr=1e-3, warmup=0),
    ),
    "tiny": PairConfig(  # for tests: seconds, not quality
        vocab_size=300, seq_len=32, corpus_max_bytes=60_000, n_prompts=4, alpha_prompts=2, alpha_new_tokens=4,
        distill_prompts=4, distill_new_tokens=4,
        target=ModelDims(hidden=64, layers=2, intermediate=192, heads=2, kv_heads=2),
        draft=ModelDims(hidden=8, layers=1, intermediate=16, heads=1, kv_heads=1, tie_embeddings=True),
        target_train=TrainSchedule(steps=4, batch=2, lr=1e-3, warmup=1),
        draft_train=TrainSchedule(steps=4, batch=2, lr=1e-3, warmup=1),
        draft_distill=TrainSchedule(steps=2, batch=2, lr=1e-3, warmup=0),
    ),
}


# For the online-distillation experiments (issue 3): the default target, but a draft that is only
# briefly pre-trained and never distilled, like a generic small model put in front of a specialised
# target. Its static acceptance leaves the room that online distillation should win.
PRESETS["osd"] = replace(PRESETS["default"], draft_train=TrainSchedule(steps=60, batch=8, lr=3e-3, warmup=10),
                         draft_distill=None)

from .corpus import check_data_type, load_corpus, make_prompts, split_heldout  # noqa: E402  (corpus reading lives in corpus.py)
from .lm_train import eval_loss, greedy_acceptance, greedy_continuations, train_lm, use_bf16_autocast  # noqa: E402


def train_tokenizer(docs: list[str], vocab_size: int):
    """Byte-level BPE (no unknown tokens, any UTF-8 round-trips) with bos/eos/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # show_progress off: its bar hides when stderr is not a terminal; the tqdm one does not.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tqdm(docs, desc="tokenizer: train BPE", unit="doc"), trainer, length=len(docs))
    # Training documents start with bos, so prompts must too; the post-processor makes every
    # `tokenizer(prompt)` call add it without the caller having to know.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=4096)


def encode_stream(docs: list[str], tokenizer) -> torch.Tensor:
    """All documents as one [n_tokens] stream: bos doc eos bos doc eos ..."""
    ids: list[int] = []
    eos, fast = tokenizer.eos_token_id, tokenizer.backend_tokenizer  # the Rust tokenizer batches in parallel
    for i in tqdm(range(0, len(docs), 256), desc="tokenize", unit="batch"):
        for enc in fast.encode_batch(docs[i : i + 256]):
            ids.extend(enc.ids)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_model(dims: ModelDims, cfg: PairConfig, tokenizer, seed: int):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=dims.hidden, intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
        tie_word_embeddings=dims.tie_embeddings,
        # RoPE has no table to size; this is only the length users are told is supported.
        max_position_embeddings=max(2048, cfg.seq_len), **special,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Zero the residual branches' output projections (as modded-nanogpt does): the untrained
        # model is then an exact bigram model instead of one whose token signal is buried under
        # 2 x layers random updates, which cut the deep target's early loss plateau (5.8 vs 6.2
        # nats after 150 steps). Gradients still reach them: their inputs are non-zero.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.generation_config = GenerationConfig(**special)
    return model


def _default_root() -> Path:
    return Path(os.environ.get("OSD_SERVE_HOME") or Path.home() / ".cache" / "osd-serve")


def _cache_name(data_files: list[str] | None, preset: str, cfg: PairConfig) -> str:
    if not data_files:
        return "default-pair" if preset == "default" else f"{preset}-pair"
    h = hashlib.sha256(json.dumps({"version": BUILD_VERSION, "data_recipe": DATA_RECIPE, "config": asdict(cfg)},
                                  sort_keys=True).encode())
    for p in data_files:
        # Path, size and modification time (not content) keep the key cheap for multi-GB files.
        st = os.stat(p)
        # fsencode: a file name that is not UTF-8 holds surrogate escapes, which .encode() refused
        h.update(os.fsencode(os.path.abspath(p)) + f"\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return f"pair-{h.hexdigest()[:12]}"


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _same_content_build(root: Path, data_files: list[str], cfg: PairConfig) -> Path | None:
    """On a cache miss: a complete build of this recipe from files at the same paths, of the same sizes
    and content (SHA-256 in its build.json). Why: the key holds modification times, and a copy or a
    checkout that rewrites a file unchanged would otherwise retrain the pair (5-15 minutes) and hand
    benchmarks other weights than their earlier reports'. Files are hashed only when some build of the
    same paths and sizes exists."""
    want = [(os.path.abspath(p), os.path.getsize(p)) for p in data_files]
    digests = None
    for d in sorted(root.glob("pair-*")):
        info = None if d.is_symlink() else _build_info(d, cfg)
        try:
            files = info["data_files"]
            if [(f["path"], f["bytes"]) for f in files] != want:
                continue
            recorded = [f["sha256"] for f in files]  # builds before the digest was recorded have none
        except (KeyError, TypeError):  # not a complete build of this recipe, or one without digests
            continue
        digests = digests or [_digest(p) for p in data_files]
        if recorded == digests:
            return d
    return None


def _alias(final: Path, same: Path) -> None:
    """Point the new key at ``same`` (a relative symlink, made atomically), so the next lookup is a plain
    hit and hashes nothing. Best effort: without it the next call only hashes again."""
    if os.path.lexists(final):
        return
    link = final.with_name(f".link-{final.name}-{os.getpid()}-{time.time_ns()}")
    try:
        os.symlink(same.name, link)
        os.replace(link, final)
    except OSError:
        with contextlib.suppress(OSError):
            link.unlink()


def _paths(d: Path) -> dict:
    return {"target": str(d / "target"), "draft": str(d / "draft"), "prompts": str(d / "prompts.jsonl")}


def _build_info(d: Path, cfg: PairConfig) -> dict | None:
    """A complete build's build.json, or None."""
    if not (d / COMPLETE_MARKER).exists():
        return None
    try:
        info = json.loads((d / "build.json").read_text())
    except (OSError, ValueError):
        return None
    # A preset edited since the build (or an older recipe) must not be served from cache.
    ok = info.get("version") == BUILD_VERSION and info.get("config") == json.loads(json.dumps(asdict(cfg)))
    ok = ok and (not info.get("data_files") or info.get("data_recipe", 1) == DATA_RECIPE)
    return info if ok else None


def _is_complete(d: Path, cfg: PairConfig) -> bool:
    return _build_info(d, cfg) is not None


def _ours(d: Path) -> bool:
    """A temp dir build_pair made: named .tmp-<cache name>-... (its build, or a finished one moved aside)
    and carrying its PID file or build.json. --out may be a directory the user keeps other .tmp-* in."""
    names = "|".join(re.escape(f"{p}-pair") for p in PRESETS) + "|pair-[0-9a-f]{12}"
    return bool(re.match(rf"\.tmp-(?:{names})-", d.name)) and ((d / "PID").is_file() or (d / "build.json").is_file())


def _sweep_stale_tmp(root: Path, foreign_after_s: float = 86400.0, locked: bool = True) -> None:
    """Delete temp dirs left by killed builds (up to ~130 MB each): cache_dir.sweep_dead_tmp over ours."""
    sweep_dead_tmp(root, _ours, foreign_after_s, locked)


@contextlib.contextmanager
def _all_cores():
    """Train on every core this process may use, then restore the caller's setting.

    Ray starts tasks and replicas with OMP_NUM_THREADS=num_cpus (1 by default), and `serve run`
    builds the app (and so, on a fresh machine, this pair) inside such a task: one thread made the
    build take over 15 minutes on 2 cores instead of about 5.
    """
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(before, cores))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_pair(data_files: list[str] | None = None, out_root: str | None = None, force: bool = False,
               preset: str = "default") -> dict:
    """Build (or find cached) the (target, draft) pair; returns {"target", "draft", "prompts"} paths."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = PRESETS[preset]
    data_files = [str(p) for p in data_files] if data_files else None
    seen: dict[tuple[int, int], str] = {}
    for p in data_files or []:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"data file not found (or not a regular file): {p}")
        check_data_type(p)  # here, not when its turn to be read comes: after hashing every file before it
        # Twice (a.jsonl ./a.jsonl, a symlink, a hard link) read it twice: every held-out prompt document
        # was also trained on. By inode: a hard link has a path of its own.
        st = os.stat(p)
        if (inode := (st.st_dev, st.st_ino)) in seen:
            raise ValueError(f"data file {p!r} is {seen[inode]!r} again: give each file once")
        seen[inode] = p
    # Absolute: the printed paths are read from other directories (a Ray replica, another shell).
    root = (Path(out_root) if out_root else _default_root()).expanduser().resolve()
    final = root / _cache_name(data_files, preset, cfg)
    if not force and (found := _cached(root, final, data_files, cfg)):
        return found
    root.mkdir(parents=True, exist_ok=True)
    with build_lock(root) as locked:
        # Again under the lock: the build this call waited for may be this key's, or (a file touched
        # meanwhile) another key's of the same content; either is reused, not trained a second time.
        if not force and (found := _cached(root, final, data_files, cfg)):
            return found
        _build_and_publish(root, final, data_files, cfg, preset, force, locked)
    return _paths(final)


def _cached(root: Path, final: Path, data_files: list[str] | None, cfg: PairConfig) -> dict | None:
    """The paths of a complete build for this key, or of one built from the same content; else None."""
    if _is_complete(final, cfg):
        return _paths(final)
    if data_files and root.is_dir() and (same := _same_content_build(root, data_files, cfg)):
        print(f"[bootstrap] {same.name} was built from the same content (the files' modification times changed): "
              f"reusing it", file=sys.stderr)
        _alias(final, same)
        return _paths(same)
    return None


def _build_and_publish(root: Path, final: Path, data_files: list[str] | None, cfg: PairConfig, preset: str,
                       force: bool, locked: bool = True) -> None:
    _sweep_stale_tmp(root, locked=locked)
    # Built beside its final place (same filesystem) so os.replace is one atomic rename; a
    # crash leaves only a .tmp-* directory that never carries the marker.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        (tmp / "PID").write_text(owner_tag())
        with _all_cores():
            info = _build_into(tmp, data_files, cfg, preset)
        share_tree(tmp)
        (tmp / "build.json").write_text(json.dumps(info, indent=2))
        (tmp / "PID").unlink()
        (tmp / COMPLETE_MARKER).write_text("ok\n")  # last: its presence means everything else is
        sync_tree(tmp)  # on disk before the rename: after a power cut, a marked build with empty weights was served for good
        if not force and _is_complete(final, cfg):
            return  # a concurrent build of the same inputs finished first; as good as ours
        # Renames only, so a finished build is never half deleted in place: the old one moves aside
        # (it still carries its marker, but under a .tmp- name nothing looks up), this one moves in.
        old = root / f".tmp-{final.name}-old-{os.getpid()}-{time.time_ns()}"
        if os.path.lexists(final):  # not exists(): an alias whose build was deleted must go too
            os.replace(final, old)
        try:
            os.replace(tmp, final)
            sync_tree(root, recurse=False)  # the rename itself
        except OSError:
            if not _is_complete(final, cfg):  # another build won the rename in between: keep it
                raise
        if old.is_symlink():  # an alias of another build (_alias): only the link goes
            old.unlink()
        else:
            remove_tree(old)
    finally:
        remove_tree(tmp)


def _build_into(out: Path, data_files: list[str] | None, cfg: PairConfig, preset: str) -> dict:
    t0 = time.perf_counter()
    # Hashed before reading: what a later lookup by content (_same_content_build) compares with.
    files = [{"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256": _digest(p)} for p in data_files or []]
    docs = load_corpus(data_files, cfg)
    train_docs, held_docs = split_heldout(docs, cfg.n_prompts, cfg.seed)
    prompts = make_prompts(held_docs, cfg.n_prompts, cfg.seed + 1)

    tokenizer = train_tokenizer(train_docs, cfg.vocab_size)
    stream = encode_stream(train_docs, tokenizer)  # [n_tokens]
    held_stream = encode_stream(held_docs, tokenizer)

    target = make_model(cfg.target, cfg, tokenizer, cfg.seed)
    draft = make_model(cfg.draft, cfg, tokenizer, cfg.seed + 1)
    # parameters() yields a tied embedding once, so this counts what is stored and streamed.
    n_target, n_draft = (sum(p.numel() for p in m.parameters()) for m in (target, draft))
    print(f"[bootstrap] {len(train_docs)} train docs, {len(stream):,} tokens, vocab {len(tokenizer)}; "
          f"target {n_target / 1e6:.2f}M params, draft {n_draft / 1e6:.3f}M params", file=sys.stderr)

    distill_prompts = make_prompts(train_docs, cfg.distill_prompts, cfg.seed + 3) if cfg.draft_distill else []
    # Checked before minutes of training, not after: the distillation stream is each prompt, its greedy
    # continuation (exactly distill_new_tokens) and EOS (lm_train.greedy_continuations).
    n_paths = sum(len(tokenizer(p)["input_ids"]) + cfg.distill_new_tokens + 1 for p in distill_prompts)
    if cfg.draft_distill and n_paths <= cfg.seq_len:
        raise ValueError(f"the corpus gives {len(distill_prompts)} distinct distillation prompts, whose greedy paths "
                         f"({n_paths} tokens) would not fill one {cfg.seq_len}-token window: give more or more varied data")
    target_loss = train_lm(target, stream, cfg.seq_len, cfg.target_train, cfg.seed, "train target")
    draft_loss = train_lm(draft, stream, cfg.seq_len, cfg.draft_train, cfg.seed + 1, "train draft")
    distill_kl = None
    if cfg.draft_distill:
        target.requires_grad_(False)
        paths = greedy_continuations(target, tokenizer, distill_prompts, cfg.distill_new_tokens)
        distill_kl = train_lm(draft, paths, cfg.seq_len, cfg.draft_distill, cfg.seed + 2, "distil draft", target)
    losses = {
        "target_train": target_loss, "draft_train": draft_loss, "draft_distill_kl": distill_kl,
        "target_heldout": eval_loss(target, held_stream, cfg.seq_len),
        "draft_heldout": eval_loss(draft, held_stream, cfg.seq_len),
    }
    alpha = None
    if cfg.alpha_prompts:
        alpha = greedy_acceptance(target, draft, tokenizer, prompts[: cfg.alpha_prompts], cfg.alpha_new_tokens)

    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)  # the same vocabulary in both: a hard requirement
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")

    elapsed = time.perf_counter() - t0
    print(f"[bootstrap] final loss: target {target_loss:.3f} (held-out {losses['target_heldout']:.3f}), "
          f"draft {draft_loss:.3f} (held-out {losses['draft_heldout']:.3f}); "
          f"greedy acceptance ~{alpha if alpha is None else round(alpha, 3)}; elapsed {elapsed:.1f}s",
          file=sys.stderr)
    return {
        "version": BUILD_VERSION, "data_recipe": DATA_RECIPE, "preset": preset, "config": asdict(cfg),
        "data_files": files,
        "corpus": {"train_docs": len(train_docs), "heldout_docs": len(held_docs),
                   "train_tokens": len(stream), "vocab_size": len(tokenizer)},
        "params": {"target": n_target, "draft": n_draft}, "losses": losses, "alpha_estimate": alpha,
        "elapsed_s": round(elapsed, 1), "torch": torch.__version__, "bf16_autocast": use_bf16_autocast(),
    }


if __name__ == "__main__":  # its own parser here printed tracebacks and a JSON whose last line was "}"
    from .cli import main as _cli_main

    _cli_main(["bootstrap", *sys.argv[1:]])
