"""Training text for the embedded pair: the standard library's own source, or the user's data files
(.txt, .jsonl, .json arrays, .jsonl.gz), plus the held-out prompts benchmarks use."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tqdm.auto import tqdm

if TYPE_CHECKING:
    from .bootstrap import PairConfig


def record_text(record: object) -> str:
    """A JSON record as training text: its string fields in order, one per line."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        return "\n".join(v for v in record.values() if isinstance(v, str) and v)
    return ""  # numbers, lists and nulls carry no text worth learning


def _txt_documents(text: str) -> list[str]:
    # Blank lines are the only document boundary plain text offers; without them, fixed line
    # chunks still let us hold some documents out for prompts.
    paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    docs = []
    for p in paras:
        lines = p.splitlines(keepends=True)
        docs.extend("".join(lines[i : i + 40]) for i in range(0, len(lines), 40))
    return docs


def read_documents(path: str) -> Iterator[str]:
    """Documents of one data file: .txt, .jsonl, .jsonl.gz or .json (array of objects)."""
    name = path.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        with (gzip.open if name.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
            texts = [record_text(json.loads(line)) for line in f if line.strip()]
    elif name.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        texts = [record_text(rec) for rec in (data if isinstance(data, list) else [data])]
    elif name.endswith(".txt"):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts = _txt_documents(f.read())
    else:
        raise ValueError(f"data file {path!r}: unsupported type (want .txt, .jsonl, .jsonl.gz or .json)")
    return (t for t in texts if t.strip())


def stdlib_files() -> list[Path]:
    """The standard library's .py files (no tests, no site-packages) in a fixed, module-spread order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1]))
    # Order by a hash of the relative path so any prefix samples the whole library instead of
    # the alphabetically first packages; sorted first so the result never depends on rglob order.
    files.sort(key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())
    return files


def load_corpus(data_files: list[str] | None, cfg: PairConfig) -> list[str]:
    """Documents up to cfg.corpus_max_bytes, split evenly between the data sources."""
    docs: list[str] = []
    if not data_files:
        budget = cfg.corpus_max_bytes
        for p in tqdm(stdlib_files(), desc="corpus: stdlib", unit="file"):
            text = p.read_text(encoding="utf-8", errors="replace")
            if text.strip() and len(text) < budget:
                docs.append(text)
                budget -= len(text)
        return docs
    per_file = cfg.corpus_max_bytes // len(data_files)
    for path in data_files:
        budget, taken = per_file, 0
        for text in tqdm(read_documents(path), desc=f"corpus: {os.path.basename(path)}", unit="doc"):
            if len(text) > budget:
                if not taken:  # a first record longer than the file's share: its start, not an empty source
                    docs.append(text[:budget])
                break
            docs.append(text)
            budget, taken = budget - len(text), taken + 1
    if not docs:
        raise ValueError(f"data files {data_files} contain no text")
    return docs


def split_heldout(docs: list[str], n: int, seed: int) -> tuple[list[str], list[str]]:
    """(train, heldout): prompts come only from documents the models never saw."""
    if len(docs) < 2:
        raise ValueError("need at least 2 documents to hold some out for prompts")
    n = min(n, max(1, len(docs) // 10))  # a small corpus keeps 90% for training
    held = set(random.Random(seed).sample(range(len(docs)), n))
    return [d for i, d in enumerate(docs) if i not in held], [docs[i] for i in sorted(held)]


def make_prompts(held: list[str], n: int, seed: int) -> list[str]:
    """n distinct prompts; long held-out files give several (different random spots)."""
    rng, seen = random.Random(seed), {}  # a dict keeps first-seen order, unlike a set
    for i in range(4 * n):
        seen.setdefault(make_prompt(held[i % len(held)], rng))
        if len(seen) == n:
            break
    return list(seen)


def make_prompt(doc: str, rng: random.Random, max_chars: int = 320) -> str:
    """A short snippet of whole lines: a record's first field(s), or a random spot in a file."""
    lines = doc.splitlines(keepends=True)
    # A record (question, instruction, problem) opens with its natural prompt and the rest is
    # the answer, so take only its first field; a long file has no natural start.
    is_record = len(doc) <= 2000
    start = 0 if is_record else rng.randrange(len(lines))
    while start < len(lines) and not lines[start].strip():
        start += 1
    out, min_chars = "", 20 if is_record else 80
    for line in lines[start:]:
        out += line
        if len(out.strip()) >= min_chars:
            break
    if len(out) > max_chars:
        cut = out.rfind(" ", 0, max_chars)
        out = out[: cut if cut > max_chars // 2 else max_chars]
    return out if out.strip() else doc[:max_chars]
