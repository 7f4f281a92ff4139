"""The `osd-serve` command line: bootstrap, generate, bench, replay."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from .config import AUTO, MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS, SEED_RANGE
from .corpus import lone_surrogate, numbered_lines

MAX_THREADS = 4096  # torch.set_num_threads takes a C int: 2**31 failed with "Overflow when unpacking long"


def _at_least(lo: int, at_most: int | None = None):
    """argparse type: an integer >= lo (and <= at_most), or a usage error naming the option."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if at_most is not None and v > at_most:
            raise argparse.ArgumentTypeError(f"must be <= {at_most}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}" if at_most is None else f"integer in [{lo}, {at_most}]"
    return parse


def _k_or_auto(text: str) -> int | str:
    """generate's --num-speculative-tokens: the engine takes "auto" too (auto_k.py); int alone refused it,
    while the error for 17 offered it."""
    return AUTO if text == AUTO else _at_least(0, MAX_SPECULATIVE_TOKENS)(text)


_k_or_auto.__name__ = f"integer in [0, {MAX_SPECULATIVE_TOKENS}] or {AUTO!r}"


def _batch_sizes(text: str) -> list[int]:
    sizes = [_at_least(1)(t.strip()) for t in text.split(",") if t.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("expected comma-separated batch sizes, e.g. 1,8")
    if len(set(sizes)) < len(sizes):  # a second run of a size: results held both, its summary the last
        raise argparse.ArgumentTypeError(f"batch size {next(s for s in sizes if sizes.count(s) > 1)} is given twice")
    return sizes


def _writable(path: str | None) -> None:
    """Fail before the work, not after it: a run's output must have somewhere to go."""
    if not path:
        return
    if Path(path).is_dir():  # passed the parent check, then the write failed after the whole run
        raise SystemExit(f"error: --out {path} is a directory: give a file path")
    if not Path(path).resolve().parent.is_dir():
        raise SystemExit(f"error: --out {path}: directory {Path(path).resolve().parent} does not exist")
    # An existing parent is not a writable one (a read-only mount, /proc, a file without write
    # permission): only opening the file tells, and the run used to learn it after all its work.
    existed = os.path.lexists(path)
    if existed and not os.path.isfile(path):  # a FIFO's reader would take the probe's close for the end
        return
    try:
        with open(path, "a", encoding="utf-8"):  # "a": an existing file keeps its contents until the run writes
            pass
    except OSError as e:
        raise SystemExit(f"error: --out {path}: cannot write there ({e.strerror or e})") from None
    if not existed:  # a run that fails before it writes leaves no empty file behind
        with contextlib.suppress(OSError):
            os.unlink(path)


def _not_the_prompts(out: str | None, prompts: str, output: str, label: str = "the --prompts file") -> None:
    """--out (or a link to it) must not be the prompts file: the run's output would replace its input."""
    if out and os.path.exists(out) and os.path.isfile(prompts) and os.path.samefile(out, prompts):
        raise SystemExit(f"error: --out {out} is {label}: the {output} would replace the prompts")


def _read_numbered(path: str, field: str = "prompt") -> list[tuple[int, str]]:
    """[(line number, prompt)]: errors found later (a prompt too long for the pair) name the line."""
    prompts = []
    try:
        # As replay and bootstrap read files: an editor's BOM dropped, \r and \r\n line ends (read as bytes
        # split on \n, a file of \r line ends was one line: "not valid JSON (Extra data)")
        for n, line in numbered_lines(path):
            if line.strip():
                prompts.append((n, _prompt_field(line, path, n, field)))
    except OSError as e:  # missing, a directory, unreadable: said as the file's problem, not errno's
        raise SystemExit(f"error: prompts file {path}: {e.strerror or e}") from None
    except ValueError as e:  # not UTF-8, naming the line
        raise SystemExit(f"error: {e}") from None
    if not prompts:
        raise SystemExit(f"error: {path} holds no prompts")
    return prompts


def _prompt_field(line: str, path: str, n: int, field: str) -> str:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {path}:{n}: not valid JSON ({e.msg})")
    except ValueError as e:  # an integer of over 4300 digits is no JSONDecodeError: main() printed it without a line
        raise SystemExit(f"error: {path}:{n}: not valid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses per level
        raise SystemExit(f"error: {path}:{n}: JSON nested too deeply") from None
    if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
        raise SystemExit(f"error: {path}:{n}: expected an object with a string field {field!r}")
    if (bad := lone_surrogate(rec[field])) is not None:  # the tokenizer refused it after the load, naming no cause
        raise SystemExit(f"error: {path}:{n}: {field!r} is not text (a lone surrogate {bad!r} escape)")
    return rec[field]


def _read_prompts(path: str, field: str = "prompt") -> list[str]:
    return [p for _, p in _read_numbered(path, field)]


def _check_seed_range(seed: int | None, n: int) -> None:
    """Prompt i runs with seed + i: the last one must fit too, or it fails with a seed never given."""
    if seed is not None and seed + n - 1 >= SEED_RANGE[1]:  # SamplingParams checks the seed itself
        raise SystemExit(f"error: --seed {seed}: prompt i uses seed + i, and seed + {n - 1} "
                         f"({n} prompts) is not below 2**63")


def _model_name(text: str) -> str:
    # "" (an unset shell variable) read as "not given" and ran, or on a fresh machine built, the default pair
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave --target and --draft out for the embedded default pair)")
    return text


def _pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=_model_name, help="target model: local directory or hub id (default: the embedded default pair)")
    p.add_argument("--draft", type=_model_name, help="draft model: local directory or hub id (default: the embedded default pair)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--draft-dtype", default="auto",
                   help="auto (the target's, except float32 under a half-precision target on CPU) | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--no-packed-linear", dest="packed_linear", action="store_false",
                   help="on CPU, keep the target's linear layers on F.linear (default: oneDNN prepacked weights, and kernels/cpu_skinny.cpp for float32 calls of <= 48 rows, where faster)")


def _load(args):
    from .loading import ModelConfig, load_pair

    if bool(args.target) != bool(args.draft):
        raise SystemExit("error: give both --target and --draft, or neither for the embedded default pair")
    try:
        # Built (and so checked) first: a --dtype or --device typo failed only after a fresh machine's
        # build of the default pair, minutes of training
        cfg = ModelConfig(target=args.target or "", draft=args.draft or "", dtype=args.dtype, draft_dtype=args.draft_dtype,
                          device=args.device, cpu_packed_linear=args.packed_linear)
        if not args.target:
            from .bootstrap import build_pair

            pair = build_pair()
            args.target, args.draft = cfg.target, cfg.draft = pair["target"], pair["draft"]
        return load_pair(cfg)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def cmd_bootstrap(args) -> None:
    from .bootstrap import build_pair

    if args.out == "":  # an unset shell variable: it built into the default cache without a word
        raise SystemExit("error: --out is empty: give a directory, or leave --out out for the default cache")
    out = os.path.expanduser(args.out) if args.out else None  # as build_pair expands it
    if out and os.path.exists(out) and not os.path.isdir(out):  # mkdir's "File exists" named no option
        raise SystemExit(f"error: --out {args.out} is not a directory")
    pair = build_pair(data_files=args.data, out_root=args.out, force=args.force, preset=args.preset)
    print(json.dumps({"target": pair["target"], "draft": pair["draft"]}))


def cmd_generate(args) -> None:
    from tqdm import tqdm

    from .config import EngineConfig, SamplingParams
    from .engine import SpecEngine
    from .output import check_room

    _writable(args.out)
    _not_the_prompts(args.out, args.prompts, "completions")
    numbered = _read_numbered(args.prompts)
    _check_seed_range(args.seed, len(numbered))
    try:  # before the load: a bad --temperature waited for the pair to load (a minute for a 7B one)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, num_speculative_tokens=args.num_speculative_tokens, logprobs=args.logprobs,
        )
        engine_cfg = EngineConfig(max_batch_size=args.batch_size)
        check_room(args.max_tokens, engine_cfg.max_model_len, "--max-tokens", "the engine's ")
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    target, draft, tok = _load(args)
    try:
        engine = SpecEngine(target, draft, tok, engine_cfg)
        check_room(args.max_tokens, engine.max_model_len, "--max-tokens", "the pair's ")
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    reqs = []
    for i, (n, prompt) in enumerate(numbered):
        seed = None if args.seed is None else args.seed + i
        try:
            reqs += engine.submit([prompt], replace(params, seed=seed))
        except ValueError as e:  # e.g. too long for the pair: which of the file's prompts
            raise SystemExit(f"error: {args.prompts}:{n}: {e}")
    sink = _Lines(args.out)
    bar = tqdm(total=len(reqs), desc="generate", unit="prompt", file=sys.stderr)
    try:
        while engine.has_unfinished():
            engine.step()
            # Written in prompt order as soon as they are done: a run stopped halfway (Ctrl-C, a crash)
            # used to lose every completion, since all were written after the last one finished.
            while sink.count < len(reqs) and reqs[sink.count].finished:
                sink.write(_completion_line(reqs[sink.count], tok))
                bar.update(1)
        for r in reqs[sink.count :]:  # any the engine finished outside a step: one line per prompt, always
            sink.write(_completion_line(r, tok))
    except KeyboardInterrupt:
        bar.close()
        print(f"interrupted: {sink.count} of {len(reqs)} completions written"
              f"{f' to {args.out}' if args.out and not sink.failed else ''}", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        sink.close()
    bar.close()
    if sink.failed:
        raise SystemExit(f"error: --out {args.out}: {sink.failed} (the completions went to stdout)")
    if args.out:
        total_p, total_a = sum(r.proposed for r in reqs), sum(r.accepted for r in reqs)
        print(json.dumps({"out": args.out, "prompts": len(reqs), "acceptance": total_a / total_p if total_p else None}))


def _completion_line(r, tok) -> str:
    from .logprobs import render

    c = r.completion()  # with --logprobs, each token's as the chat API gives them ({token, logprob, bytes, top_logprobs})
    lps = {} if c.logprobs is None else {"logprobs": render(tok, c.token_ids, c.logprobs)}
    return json.dumps({"prompt": c.prompt, "text": c.text, "token_ids": c.token_ids, "proposed": c.proposed,
                       "accepted": c.accepted, "finish_reason": c.finish_reason} | lps)


class _Lines:
    """generate's output: --out (or stdout), a line at a time and flushed, so what finished is kept.
    A failed write to --out (a full disk) sends every line, earlier ones too, to stdout instead: the
    completions must reach somewhere, and the file may hold a half line."""

    def __init__(self, out: str | None):
        self.lines: list[str] = []
        self.failed: str | None = None
        self.file = open(out, "w", encoding="utf-8") if out else None  # noqa: SIM115  (closed by close())

    @property
    def count(self) -> int:
        return len(self.lines)

    def write(self, line: str) -> None:
        self.lines.append(line)
        if self.file is None:
            from tqdm import tqdm

            # The bar (stderr) is cleared around the line and redrawn after it: on a terminal the line
            # was glued to the bar's, and the bar's next redraw wrote over it.
            with tqdm.external_write_mode(file=sys.stdout):
                print(line, flush=True)
            return
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except OSError as e:
            self.failed = e.strerror or str(e)
            self.close()
            print("\n".join(self.lines), flush=True)

    def close(self) -> None:
        if self.file is not None:
            f, self.file = self.file, None
            with contextlib.suppress(OSError):  # a full disk fails the close's flush too: already reported
                f.close()


def cmd_bench(args) -> None:
    import torch

    from .bench import run_bench

    _writable(args.out)
    # The prompts are read before the pair loads (a 7B pair: a minute), as generate's are; only the
    # default pair's prompts.jsonl waits for _load to build it.
    prompts = _bench_prompts(args) if args.prompts or (args.target and args.draft) else None
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tok = _load(args)
    if prompts is None:
        prompts = _bench_prompts(args)
    ks = range(1, args.max_k + 1)
    sizes = args.batch_sizes
    report = run_bench(target, draft, tok, prompts, args.max_tokens, sizes, ks, log=lambda s: print(s, file=sys.stderr),
                       repeats=args.repeats)
    report["target"], report["draft"] = args.target, args.draft
    report["prompts_file"] = args.prompts_file  # which text was measured: draft_confidence.py replays it
    text = json.dumps(report, indent=1)
    print(text)  # first: a failed write must not lose the run's only copy
    if args.out:
        Path(args.out).write_text(text)


def _bench_prompts(args) -> list[str]:
    """The first --num-prompts of --prompts, else of the prompts.jsonl beside a bootstrapped pair."""
    # expanded as the loaders expand it: bash leaves the ~ of --target=~/pair/target as it is
    beside = str(Path(args.target).expanduser().parent / "prompts.jsonl") if args.target else None
    if not args.prompts and not (beside and Path(beside).is_file()):
        raise SystemExit("error: --prompts FILE.jsonl is needed: only a bootstrap pair has prompts.jsonl beside it")
    # Checked here, before the run: the report was written over the prompts file at its end.
    _not_the_prompts(args.out, args.prompts or beside, "report",
                     "the --prompts file" if args.prompts else f"{beside}, the pair's prompts")
    args.prompts_file = str(Path(args.prompts or beside).resolve())
    return _read_prompts(args.prompts or beside)[: args.num_prompts]


def cmd_replay(args) -> None:
    import torch

    from .config import EngineConfig, SamplingParams
    from .distill.guard import GuardConfig
    from .distill.recorder import RecordConfig
    from .distill.replay import BufferConfig
    from .distill.trainer import TrainConfig
    from .output import check_room
    from .replay import check_out_dir, load_stream, replay

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        fields = args.field.split(",") if args.field else None
        # Backslash escapes (\n) are interpreted; other non-ASCII text passes through unchanged.
        try:
            template = args.template.encode("latin-1", "backslashreplace").decode("unicode_escape") if args.template else None
        except UnicodeDecodeError as e:  # a trailing or malformed escape: the codec's message names neither
            raise SystemExit(f"error: --template {args.template!r}: {e.reason}") from None
        stream = load_stream(args.data, fields, template, args.order, args.seed, args.max_requests)
        params = SamplingParams(max_tokens=args.max_tokens, num_speculative_tokens=args.num_speculative_tokens)
        params.validate()
        train = TrainConfig(mode=args.mode, lr=args.lr, steps_per_update=args.steps_per_update, batch_size=args.train_batch,
                            loss=args.loss, beta=args.beta, student_fraction=0.0, chunk_size=args.chunk_size, seed=args.seed)
        buffer = BufferConfig(max_bytes=args.buffer_mb << 20, trigger_records=args.trigger_records,
                              trigger_age_s=args.trigger_age_s, eviction=args.eviction, seed=args.seed)
        record = RecordConfig(keep=args.keep, topk=args.topk)
        guard = GuardConfig(tolerance=args.guard_tolerance)
        check_out_dir(args.out)
        check_room(args.max_tokens, EngineConfig().max_model_len, "--max-tokens", "the engine's ")
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
    _out_dir(args.out)
    target, draft, tok = _load(args)
    res = replay(target, draft, tok, stream, args.out, params, train, buffer, record, guard,
                 EngineConfig(max_batch_size=args.batch_size), offline_epochs=args.offline_epochs,
                 skip_baselines=args.online_only)
    summary = {name: {"final_alpha": r["final_alpha"], "wall_s": round(r["wall_s"], 1)} for name, r in res["runs"].items()}
    summary["online"] |= {"updates": res["runs"]["online"]["updates"], "published": res["runs"]["online"]["published"]}
    print(json.dumps({"out": args.out, "requests": res["requests"], "outputs_identical": res["outputs_identical"],
                      "throughput_while_training": res.get("throughput_while_training"), "runs": summary}))


def _out_dir(path: str) -> None:
    """replay's --out, checked before the pair loads (a file in its place failed only after the load),
    and not made yet: a replay refused for its data leaves no empty directory."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SystemExit(f"error: --out {path} is not a directory")
    made_in = Path(path).resolve()
    while not made_in.exists():  # the nearest existing ancestor: where mkdir will create the rest
        made_in = made_in.parent
    if not made_in.is_dir():
        raise SystemExit(f"error: --out {path}: {made_in} is not a directory")
    if not os.access(made_in, os.W_OK | os.X_OK):
        raise SystemExit(f"error: --out {path}: cannot write in {made_in}")


def _replay_args(r: argparse.ArgumentParser) -> None:
    _pair_args(r)
    r.add_argument("--data", nargs="+", required=True, metavar="FILE", help=".jsonl/.jsonl.gz/.json prompt sources, in order")
    r.add_argument("--field", help="prompt field; comma-separated names try each in turn (default: first string field)")
    r.add_argument("--template", help="join fields, e.g. '{instruction}\\n{input}\\n' (overrides --field)")
    r.add_argument("--order", choices=["sequential", "shuffle"], default="sequential",
                   help="sequential: files one after another (a distribution shift; each file's share is a random sample of it, "
                        "in random order); shuffle: all files mixed")
    # torch.manual_seed's range: a seed past it failed at the trainer's build, after the static run
    r.add_argument("--seed", type=_at_least(SEED_RANGE[0], SEED_RANGE[1] - 1), default=0)
    r.add_argument("--max-requests", type=_at_least(1), default=None, help="total; sequential order gives each file an equal share")
    # >= 2: each request's last step drafts nothing (k is capped at the tokens left), so at 1 no draft
    # was ever proposed and every α was None
    r.add_argument("--max-tokens", type=_at_least(2), default=64)
    # At least 1: replay measures acceptance, and at k = 0 nothing is drafted (every α was None)
    r.add_argument("--num-speculative-tokens", type=_at_least(1, MAX_SPECULATIVE_TOKENS), default=4)
    r.add_argument("--batch-size", type=_at_least(1), default=8)
    r.add_argument("--trigger-records", type=int, default=8, help="update after this many new records (the paper's I)...")
    r.add_argument("--trigger-age-s", type=float, default=30.0, help="...or when the oldest new record is this old")
    r.add_argument("--buffer-mb", type=int, default=256,
                   help="bound of the online replay buffer, and of the static run's records the offline bound trains on")
    r.add_argument("--eviction", choices=["fifo", "reservoir"], default="fifo")
    r.add_argument("--keep", choices=["mismatch", "all"], default="mismatch", help="positions recorded: where the draft was rejected (default; as good for α at a third of the bytes, benchmarks/OSD.md), or all verified")
    r.add_argument("--topk", type=int, default=0, help="store top-k target probs + rest mass (0: full distribution)")
    r.add_argument("--loss", choices=["forward_kl", "reverse_kl", "jsd", "tvd"], default="forward_kl")
    r.add_argument("--beta", type=float, default=0.5, help="JSD beta")
    r.add_argument("--mode", choices=["full", "lora"], default="full")
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--steps-per-update", type=int, default=16)
    r.add_argument("--train-batch", type=int, default=8)
    r.add_argument("--chunk-size", type=int, default=0, help="> 0: forward KL through the chunked/fused kernel path")
    r.add_argument("--guard-tolerance", type=float, default=0.0)
    r.add_argument("--offline-epochs", type=_at_least(1), default=4)
    r.add_argument("--online-only", action="store_true", help="skip the static and offline baselines")
    r.add_argument("--threads", type=_at_least(0, MAX_THREADS), default=0)
    r.add_argument("--out", required=True, metavar="DIR",
                   help="DIR/result.json is rewritten as each run finishes and when replay stops; its \"complete\" "
                        "is false until all runs are done (an interrupted replay keeps the runs that finished)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="osd-serve", description="Online speculative decoding server and tools")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bootstrap", help="build (or reuse) the embedded default target/draft pair")
    b.add_argument("--data", nargs="+", metavar="FILE", help="train on these .jsonl/.jsonl.gz/.json/.txt files instead of the built-in corpus")
    b.add_argument("--out", help="output root (default $OSD_SERVE_HOME or ~/.cache/osd-serve)")
    b.add_argument("--force", action="store_true", help="rebuild even if a finished build exists")
    b.add_argument("--preset", default="default", choices=["default", "osd", "tiny"], help="tiny: seconds-long build for tests; osd: weak undistilled draft for online-distillation experiments")
    b.set_defaults(fn=cmd_bootstrap)

    g = sub.add_parser("generate", help="generate completions for a jsonl file of {\"prompt\": ...}")
    _pair_args(g)
    g.add_argument("--prompts", required=True, metavar="FILE.jsonl")
    g.add_argument("--max-tokens", type=_at_least(1), default=64)
    g.add_argument("--num-speculative-tokens", type=_k_or_auto, default=4,
                   help=f"draft tokens per step, 0-{MAX_SPECULATIVE_TOKENS}, or auto: the engine picks k each step")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: disabled")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="seed of the first prompt; prompt i uses seed+i")
    g.add_argument("--batch-size", type=_at_least(1), default=8)
    g.add_argument("--logprobs", type=_at_least(0, MAX_LOGPROBS), default=None, metavar="N",
                   help=f"each token's logprob under the target and its N likeliest alternatives (0-{MAX_LOGPROBS})")
    g.add_argument("--out", metavar="FILE.jsonl")
    g.set_defaults(fn=cmd_generate)

    n = sub.add_parser("bench", help="tokens/s against the target alone and HF assisted generation")
    _pair_args(n)
    n.add_argument("--prompts", metavar="FILE.jsonl", help="default: prompts.jsonl beside the pair")
    n.add_argument("--num-prompts", type=_at_least(1), default=16)
    # >= 2: with one token per prompt nothing is drafted, so there is no acceptance to measure
    n.add_argument("--max-tokens", type=_at_least(2), default=64)
    n.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8], help="comma-separated, e.g. 1,8")
    # the engine's bound: it refused k=17 only when the engine runs came, after the HF baselines
    n.add_argument("--max-k", type=_at_least(1, MAX_SPECULATIVE_TOKENS), default=8)
    n.add_argument("--threads", type=_at_least(0, MAX_THREADS), default=0, help="torch threads (default: torch's choice)")
    n.add_argument("--repeats", type=_at_least(1), default=3,
                   help="time each decoder this many times, interleaved; keep the median (one round: the first run of each shape is slow)")
    n.add_argument("--out", metavar="FILE.json")
    n.set_defaults(fn=cmd_bench)

    r = sub.add_parser("replay", help="replay a prompt stream with online distillation; static/offline/online α")
    _replay_args(r)
    r.set_defaults(fn=cmd_replay)

    args = ap.parse_args(argv)
    from safetensors import SafetensorError  # a full disk while saving weights: an OSError in all but name

    try:
        args.fn(args)
    except (ValueError, OSError, SafetensorError) as e:  # bad input files and values, a full disk: one line, not a traceback
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # each command has cleaned up on its way out (a build's temp dir, replay's result.json)
        print(f"osd-serve {args.cmd}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
