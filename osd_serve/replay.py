"""`osd-serve replay`: replay a prompt stream through the engine with online distillation on.

The same stream runs three times, greedy, so the three runs must emit identical tokens (speculation
is lossless whatever the draft) and differ only in acceptance:
  static   the draft as given, never updated;
  offline  an upper bound: a copy of the draft distilled beforehand on the whole stream's target
           outputs (recorded during the static run), then frozen;
  online   the draft distilled from the traffic as it is served, published through the guard.

The offline bound trains on at most --buffer-mb of the static run's records, a uniform sample of the
stream (reservoir) when they do not all fit: every verified position's distribution of a whole stream
would not fit in memory (152k-id vocabularies: ~300 KB a position), and keeping the newest would bias
the bound toward the stream's last domain.

OUT/result.json is rewritten (atomically) as each run finishes and when replay stops, however it
stops: "complete" is false until all runs are done, so an interrupted replay keeps what finished.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import statistics
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import EngineConfig, SamplingParams
from .corpus import checked_text, numbered_records, record_where
from .distill.guard import GuardConfig
from .distill.online import OnlineDistiller
from .distill.recorder import RecordConfig, Recorder
from .distill.replay import BufferConfig, ReplayBuffer
from .distill.trainer import DistillTrainer, TrainConfig
from .distill.versions import VersionStore
from .engine import SpecEngine
from .output import check_prompt, check_room


def _records(path: str) -> list[tuple[str, object]]:
    """[(where, record)]: where names the line of a .jsonl (the record of a .json array), for errors
    found later, such as a prompt too long for the pair."""
    # lower(): as corpus.numbered_records reads it (bootstrap took X.JSONL, replay refused it)
    if not path.lower().endswith((".jsonl", ".jsonl.gz", ".json")):
        raise ValueError(f"--data {path!r}: want .jsonl, .jsonl.gz or .json")
    return [(record_where(path, n), rec) for n, rec in numbered_records(path)]


def _prompt(rec, fields: list[str] | None, template: str | None, where: str) -> str | None:
    if isinstance(rec, str):
        return checked_text(rec, where, "the record")
    if not isinstance(rec, dict):
        return None
    if template is not None:
        try:
            text = template.format(**rec)
        except KeyError as e:
            # where, not the file: one record without the field is enough, and must be findable
            raise ValueError(f"--template names field {e} that {where} lacks (fields: {sorted(rec)})") from None
        except (IndexError, AttributeError, TypeError, ValueError) as e:  # '{n[0]}' on an int, a lone '{'
            raise ValueError(f"--template {template!r} does not fit {where}: {e!r}") from None
        return checked_text(text, where, "the --template text")
    for name in fields or [k for k, v in rec.items() if isinstance(v, str)]:
        if isinstance(rec.get(name), str) and rec[name].strip():
            # rstrip + "\n": the training text put the answer on the next line
            return checked_text(rec[name], where, repr(name)).rstrip() + "\n"
    return None


def load_stream(files: list[str], fields: list[str] | None = None, template: str | None = None,
                order: str = "sequential", seed: int = 0, max_requests: int | None = None) -> list[dict]:
    """[{"prompt", "source", "where"}] in arrival order (where: file and line). Sequential order with
    several files is a shift: each file contributes an equal share of max_requests, one after the other."""
    if order not in ("sequential", "shuffle"):
        raise ValueError(f"order must be sequential or shuffle, got {order!r}")
    if not files:  # each file's share divides by their number
        raise ValueError("load_stream needs at least one data file")
    if max_requests is not None and max_requests < 1:  # 0 is falsy: it read as no limit at all
        raise ValueError(f"max_requests must be >= 1 (or None: every record), got {max_requests}")
    if template is not None:
        checked_text(template, "--template", repr(template))
    per_file = []
    names = [Path(path).name for path in files]
    for path, name in zip(files, names):
        records = _records(path)
        # The label plot_alpha draws (the path where names clash: code/train.jsonl then math/train.jsonl
        # was one source, and its shift drew no line). A name's byte that is not UTF-8 (a lone surrogate
        # once decoded) made matplotlib raise after every run had finished: a "?" for it.
        source = (name if names.count(name) == 1 else path).encode("utf-8", "replace").decode("utf-8")
        items = [{"prompt": p, "source": source, "where": where} for where, rec in records
                 if (p := _prompt(rec, fields, template, where))]
        if not records:  # said "no record has the field(s) None" before
            raise ValueError(f"--data {path}: holds no records")
        if not items:
            want = "a non-empty --template text" if template is not None else \
                f"the field(s) {fields}" if fields else "a non-empty string field"
            raise ValueError(f"--data {path}: no record has {want}")
        random.Random(seed).shuffle(items)  # a random sample of each file, not its first rows
        per_file.append(items)
    if order == "shuffle":
        stream = [x for items in per_file for x in items]
        random.Random(seed + 1).shuffle(stream)
        return stream[:max_requests] if max_requests else stream
    if not max_requests:
        return [x for items in per_file for x in items]
    # Equal shares, the first max_requests % n files one more: a ceil share cut at max_requests gave
    # 3 files of --max-requests 4 shares of 2, 2 and 0, and the third domain never came.
    n = len(per_file)
    return [x for i, items in enumerate(per_file) for x in items[:max_requests // n + (i < max_requests % n)]]


def run_stream(engine: SpecEngine, prompts: list[str], params: SamplingParams, desc: str) -> tuple[list, list, float]:
    """Serve ``prompts`` in order; returns (per-request trace summaries, token ids, wall seconds)."""
    traces: dict[str, dict] = {}
    rec = engine.recorder
    prev = rec.on_finish if rec is not None else None

    def on_finish(record, trace):
        traces[trace.request_id] = trace.summary()
        if prev is not None:
            prev(record, trace)

    if rec is None:
        engine.recorder = rec = Recorder(RecordConfig(keep="all"))
    rec.on_finish = on_finish
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    reqs = {r.request_id: r for r in engine.waiting}
    t0 = time.perf_counter()
    done = 0
    with tqdm(total=len(ids), desc=desc, unit="req", file=sys.stderr) as bar:
        while engine.has_unfinished():
            engine.step()
            # Counted, not scanned: a scan of every request after every step grew as requests x steps.
            n = len(ids) - len(engine.waiting) - len(engine.running)
            bar.update(n - done)
            done = n
    wall = time.perf_counter() - t0
    return [traces[i] for i in ids], [list(reqs[i].output_ids) for i in ids], wall


def rolling_mean(xs: list[float | None], window: int) -> list[float]:
    """Mean of the non-None values in each trailing window (0 where a window has none)."""
    out = []
    for i in range(len(xs)):
        win = [v for v in xs[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(sum(win) / len(win) if win else 0.0)
    return out


def running_mean(xs: list[float | None]) -> list[float]:
    out, s, n = [], 0.0, 0
    for x in xs:
        if x is not None:
            s, n = s + x, n + 1
        out.append(s / n if n else 0.0)
    return out


def _tail_mean(xs: list, frac: float = 0.2) -> float | None:
    vals = [x for x in xs[-max(1, int(len(xs) * frac)) :] if x is not None]
    return sum(vals) / len(vals) if vals else None


def throughput_ratio(engine: SpecEngine, trainer: DistillTrainer, records: list, prompts: list[str],
                     params: SamplingParams, rounds: int = 3) -> dict:
    """tokens/s while a trainer runs beside generation over tokens/s without, on one engine and draft.

    ``rounds`` idle and busy runs alternate and the medians are kept (bench's --repeats): one sample
    of each gave 12.8-17.8x on a shared host, where a slow spell hit whichever run it fell on."""
    idle, busy, steps = [], [], [0]
    try:
        for _ in range(rounds):
            idle.append(_tok_s(engine, prompts, params))
            busy.append(_while_training(lambda: _tok_s(engine, prompts, params), trainer, records, steps))
    finally:
        trainer.revert()  # measurement only: these steps are never published
    mid_idle, mid_busy = statistics.median(idle), statistics.median(busy)
    return {"tokens_per_s_idle": mid_idle, "tokens_per_s_training": mid_busy, "ratio": mid_busy / mid_idle,
            "train_steps_during": steps[0], "rounds": rounds, "idle_rounds": idle, "training_rounds": busy}


def _tok_s(engine: SpecEngine, prompts: list[str], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(c.token_ids) for c in outs) / (time.perf_counter() - t0)


def _while_training(fn, trainer: DistillTrainer, records: list, steps: list[int]):
    """fn() with a thread training on ``records`` beside it; steps[0] counts the optimizer steps taken.
    A training thread that failed fails the measurement: fn() alone would have been timed with no
    training beside it, and reported as if it had."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def train():
        try:
            while not stop.is_set():
                steps[0] += len(trainer.train(records, steps=1))  # a step skipped for a non-finite gradient returns no loss
        except Exception as e:  # noqa: BLE001  (re-raised in the caller's thread below)
            failed.append(e)

    th = threading.Thread(target=train, daemon=True)
    th.start()
    try:
        out = fn()
    finally:
        stop.set()
        th.join()
    if failed:
        raise RuntimeError(f"the training thread failed ({type(failed[0]).__name__}: {failed[0]})") from failed[0]
    return out


def save_result(result: dict, path: Path) -> None:
    """Written beside and renamed over: a replay stopped mid-write leaves the previous version whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def check_stream(engine: SpecEngine, stream: list[dict], params: SamplingParams) -> None:
    """Every prompt fits the pair with max_tokens, before the first run, naming its file and line."""
    check_room(params.max_tokens, engine.max_model_len, "--max-tokens", "the pair's ")  # no prompt's fault
    for s in stream:
        try:
            check_prompt(engine.tokenizer, engine.vocab, engine.max_model_len, s["prompt"], params)
        except ValueError as e:
            raise ValueError(f"{s.get('where', s['source'])}: {e}") from None


def _static_engine(target, draft, tokenizer, engine_cfg, buffer_cfg: BufferConfig, topk: int):
    """(engine, buffer): the engine records every verified position it serves, the offline bound's
    training data, into a buffer of --buffer-mb that keeps a uniform sample of the stream."""
    buf = ReplayBuffer(replace(buffer_cfg, eviction="reservoir"))
    rec = Recorder(RecordConfig("all", topk), on_finish=lambda r, t: r is not None and buf.add(r))
    return SpecEngine(target, draft, tokenizer, engine_cfg, rec), buf


def _train_offline(draft, buf: ReplayBuffer, train_cfg: TrainConfig, vocab: int, epochs: int) -> tuple:
    """(a distilled copy of draft, training stats): uniform minibatches over the kept records."""
    records = [r for shard in buf.shards.values() for r in shard.records]
    offline = DistillTrainer(draft, replace(train_cfg, recent_fraction=0.0), vocab=vocab)
    steps = epochs * math.ceil(len(records) / train_cfg.batch_size)
    t0 = time.perf_counter()
    losses = offline.train(records, steps=steps, progress=True)
    off_draft = copy.deepcopy(draft)
    off_draft.load_state_dict(offline.serving_state(), strict=False)
    return off_draft, {
        "train_steps": steps, "train_s": time.perf_counter() - t0,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        # fewer than offered: --buffer-mb evicted some (a weaker bound than the whole stream's)
        "train_records": len(records), "records_offered": sum(sh.seen for sh in buf.shards.values()),
        "train_bytes": buf.nbytes,
    }


def check_out_dir(out_dir: str) -> None:
    """replay replaces DIR/versions (and its figures): only a replay's own, with its result.json beside
    it. A server's versions_dir (--out ~/.cache/osd-serve) or a user's folder given by mistake was
    deleted whole; --out "" was the current directory."""
    if not str(out_dir).strip():
        raise ValueError("--out is empty: give the directory replay writes into")
    versions = Path(out_dir) / "versions"
    if os.path.islink(versions) or (os.path.lexists(versions) and not versions.is_dir()):  # rmtree refuses a link,
        # and the online run resumed from (and pruned) the store it points to; a file failed after two runs
        raise ValueError(f"--out {out_dir}: its versions is a link or not a directory, and replay replaces it: "
                         "remove it or give another directory")
    if os.path.lexists(versions) and not _replay_result(Path(out_dir) / "result.json"):
        raise ValueError(f"--out {out_dir}: its versions/ is not a replay's (no replay result.json beside it), and "
                         "replay replaces it: give another directory")


def _replay_result(path: Path) -> bool:
    try:
        res = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(res, dict) and "runs" in res and "sources" in res


def replay(target, draft, tokenizer, stream: list[dict], out_dir: str, params: SamplingParams,
           train_cfg: TrainConfig, buffer_cfg: BufferConfig, record_cfg: RecordConfig, guard_cfg: GuardConfig,
           engine_cfg: EngineConfig | None = None, offline_epochs: int = 4, skip_baselines: bool = False) -> dict:
    check_out_dir(out_dir)
    check_stream(SpecEngine(target, draft, tokenizer, engine_cfg), stream, params)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [s["prompt"] for s in stream]
    result: dict = {"complete": False, "requests": len(prompts), "params": asdict(params), "train": asdict(train_cfg),
                    "buffer": asdict(buffer_cfg), "record": asdict(record_cfg), "guard": asdict(guard_cfg),
                    "sources": [s["source"] for s in stream], "runs": {}}
    base_state = {n: t.clone() for n, t in draft.state_dict().items()}
    outputs = {}
    save = lambda: save_result(result, out / "result.json")  # noqa: E731

    def finish_run(name, traces, toks, wall, extra=None):
        alpha = [t["acceptance"] for t in traces]
        outputs[name] = toks
        result["runs"][name] = {
            "per_request": traces, "running_mean_alpha": running_mean(alpha), "final_alpha": _tail_mean(alpha),
            "final_expected_alpha": _tail_mean([t["expected_acceptance"] for t in traces]),
            "tokens": sum(len(t) for t in toks), "wall_s": wall, **(extra or {}),
        }
        save()  # a run that finished is kept whatever happens to the next one

    # An earlier run's result, figures and versions go now: a result.json left beside this run's files
    # would describe another run, and the online run must start from the draft given, not resume from
    # a store an earlier run (perhaps of another draft) left (a stop before the online run kept it).
    for stale in ("alpha.png", "loss.png"):
        (out / stale).unlink(missing_ok=True)
    if (out / "versions").exists():  # a directory (check_out_dir): a failure to remove it is said, not ignored
        shutil.rmtree(out / "versions")
    save()
    try:
        if not skip_baselines:
            eng, static_buf = _static_engine(target, draft, tokenizer, engine_cfg, buffer_cfg, record_cfg.topk)
            finish_run("static", *run_stream(eng, prompts, params, "static"))
            off_draft, result["offline_training"] = _train_offline(draft, static_buf, train_cfg, eng.vocab, offline_epochs)
            del static_buf
            save()
            eng = SpecEngine(target, off_draft, tokenizer, engine_cfg)
            finish_run("offline", *run_stream(eng, prompts, params, "offline"), result["offline_training"])
            del eng, off_draft  # both: the engine held the draft, a second draft resident through the online run
        _online(target, draft, tokenizer, prompts, params, train_cfg, buffer_cfg, record_cfg, guard_cfg, engine_cfg,
                out, result, finish_run)
        # With one run (--online-only) there is nothing to compare: null, not true.
        result["outputs_identical"] = all(o == outputs["online"] for o in outputs.values()) if len(outputs) > 1 else None
        result["draft_unchanged"] = all(torch.equal(t, draft.state_dict()[n]) for n, t in base_state.items())
        result["complete"] = True
    finally:
        save()
    plot_alpha(result, out / "alpha.png")
    plot_loss(result["runs"]["online"]["loss_curve"], out / "loss.png")
    return result


def _online(target, draft, tokenizer, prompts, params, train_cfg, buffer_cfg, record_cfg, guard_cfg, engine_cfg,
            out: Path, result: dict, finish_run) -> None:
    """The online run (into result["runs"]["online"]), then the throughput it keeps while training."""
    online_draft = copy.deepcopy(draft)
    eng = SpecEngine(target, online_draft, tokenizer, engine_cfg)
    trainer = DistillTrainer(online_draft, train_cfg, vocab=eng.vocab)
    store = VersionStore(out / "versions", keep_last=5)
    dist = OnlineDistiller(eng, trainer, ReplayBuffer(buffer_cfg), store, guard_cfg, record_cfg)
    ups: list = []  # every update (dist.updates keeps only the newest)
    dist.on_update = ups.append
    dist.start()
    try:
        traces, toks, wall = run_stream(eng, prompts, params, "online")
    finally:
        dist.stop()
    finish_run("online", traces, toks, wall, {
        "updates": len(ups), "published": sum(u.published for u in ups), "refused": [u.reason for u in ups if not u.published],
        "update_log": [{k: v for k, v in asdict(u).items() if k != "losses"} | {"loss_first": u.losses[0] if u.losses else None,
                        "loss_last": u.losses[-1] if u.losses else None} for u in ups],
        "loss_curve": [x for u in ups for x in u.losses], "versions_kept": store.versions,
    })
    records = list(dist.buffer.shard("default").records)
    if records:
        result["record_bytes"] = {"mean": sum(r.nbytes for r in records) / len(records),
                                  "positions_mean": sum(len(r.positions) for r in records) / len(records),
                                  "keep": record_cfg.keep, "topk": record_cfg.topk}
        try:
            result["throughput_while_training"] = throughput_ratio(eng, trainer, records, prompts[:16], params)
        except RuntimeError as e:  # the training thread failed (out of memory beside generation): said, not timed
            result["throughput_while_training"] = {"ratio": None, "error": str(e)}


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def plot_loss(losses: list[float], path) -> None:
    """The online trainer's loss at every optimizer step."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(losses, lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("distillation loss")
    ax.set_title("online distillation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_alpha(result: dict, path) -> None:
    plt = _plt()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in result["runs"].items():
        w = 20  # a trailing window shows adaptation; the running mean alone hides it
        ax.plot(rolling_mean([t["acceptance"] for t in run["per_request"]], w), label=f"{name} (window {w})")
    srcs = result["sources"]
    for i in range(1, len(srcs)):
        if srcs[i] != srcs[i - 1]:
            ax.axvline(i, color="grey", ls=":", lw=1)
            ax.text(i, 0.02, srcs[i], rotation=90, fontsize=7, color="grey")
    ax.set_xlabel("request")
    ax.set_ylabel("greedy acceptance α")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    ax.set_title("acceptance over the stream: static vs offline-distilled vs online")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
