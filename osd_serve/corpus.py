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
import zlib
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
        return "\n".join(t for v in record.values() if (t := _field_text(v)))
    return ""  # numbers, lists and nulls carry no text worth learning


def _field_text(value: object) -> str:
    """A string field, or a chat field's turns (OpenAI {"messages": [{"content"}]}, ShareGPT
    {"conversations": [{"value"}]}), one per line; other values carry no text worth learning."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        turns = (_field_text(m.get("content", m.get("value"))) or m.get("text") for m in value)  # parts: {"text"}
        return "\n".join(t for t in turns if isinstance(t, str) and t)
    return ""


# A document longer than this is cut into pieces (at whitespace): a .txt without line breaks or one huge
# record was one document, and a corpus of one document has none to hold out for prompts.
MAX_DOC_CHARS = 16_000


def _pieces(text: str, limit: int = MAX_DOC_CHARS) -> Iterator[str]:
    # By index: `text = text[cut:]` copied the rest at every piece, so a 200 MB line took 46 s to give
    # the 6 MB a corpus budget reads.
    start = 0
    while len(text) - start > limit:
        end = start + limit
        cut = max(text.rfind(" ", start + limit // 2, end), text.rfind("\n", start + limit // 2, end))
        cut = cut + 1 if cut > start else end
        yield text[start:cut]
        start = cut
    yield text[start:]


def _txt_documents(lines: Iterator[str]) -> Iterator[str]:
    """Blank lines are the only document boundary plain text offers; without them, fixed line chunks
    still let us hold some documents out for prompts. Streams: a large file is read only as far as the
    corpus budget goes."""
    chunk: list[str] = []
    for line in lines:
        if not line.strip():
            if chunk:
                yield "".join(chunk)
            chunk = []
            continue
        chunk.append(line)
        if len(chunk) == 40:
            yield "".join(chunk)
            chunk = []
    if chunk:
        yield "".join(chunk)


def read_records(path: str) -> Iterator[object]:
    """The JSON records of a .jsonl, .jsonl.gz or .json (an array, or one object) file, one at a time.
    A bad line is named by file and line number; a UTF-8 BOM is allowed."""
    return (rec for _, rec in numbered_records(path))


def record_where(path: str, n: int) -> str:
    """Where numbered_records' record n is, for an error: a .jsonl's line, a .json array's index."""
    return f"{path}:{n}" if path.lower().endswith((".jsonl", ".jsonl.gz")) else f"{path} record {n}"


_BAD_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape decodes an undecodable byte to


def numbered_lines(path: str, opener=open) -> Iterator[tuple[int, str]]:
    """(n, line) of a UTF-8 text file opened with ``opener`` (gzip.open for .gz), n from 1; a leading BOM is
    dropped. Text mode, so \\r and \\r\\n end lines as \\n does. surrogateescape: a bad byte becomes a lone
    surrogate of its line, so the ValueError names the line (a strict text stream decodes 8 KB blocks and
    named none)."""
    with opener(path, "rt", encoding="utf-8-sig", errors="surrogateescape") as f:
        for n, line in enumerate(f, 1):
            if _BAD_BYTE.search(line):
                try:
                    line.encode("utf-8", "surrogateescape").decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: not UTF-8 text (line {n}: {e.reason})") from None
            yield n, line


def numbered_records(path: str) -> Iterator[tuple[int, object]]:
    """(n, record) as read_records: n is the line of a .jsonl, the 1-based index in a .json array."""
    name = path.lower()
    try:
        if name.endswith((".jsonl", ".jsonl.gz")):
            for n, line in numbered_lines(path, gzip.open if name.endswith(".gz") else open):
                if line.strip():
                    try:
                        yield n, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") from None
                    except ValueError as e:  # an integer of over 4300 digits: no JSONDecodeError, no line
                        raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
                    except RecursionError:  # json's decoder recurses per level: a traceback, naming no line
                        raise ValueError(f"{path}:{n}: JSON nested too deeply") from None
        elif name.endswith(".json"):
            with open(path, encoding="utf-8-sig") as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
                except UnicodeDecodeError:
                    raise
                except ValueError as e:  # as above: a huge integer
                    raise ValueError(f"{path}: not valid JSON ({e})") from None
                except RecursionError:
                    raise ValueError(f"{path}: JSON nested too deeply") from None
            yield from enumerate(data if isinstance(data, list) else [data], 1)
        else:
            raise ValueError(f"data file {path!r}: unsupported type (want .jsonl, .jsonl.gz or .json)")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start} of a read block: {e.reason})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # cut short (EOFError) or damaged: neither is a ValueError
        raise ValueError(f"{path}: not a readable gzip file ({e})") from None


DATA_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".json")


def check_data_type(path: str) -> None:
    if not path.lower().endswith(DATA_SUFFIXES):
        raise ValueError(f"data file {path!r}: unsupported type (want .txt, .jsonl, .jsonl.gz or .json)")


def read_documents(path: str) -> Iterator[str]:
    """Documents of one data file: .txt, .jsonl, .jsonl.gz or .json (array of objects), read lazily."""
    check_data_type(path)
    if path.lower().endswith(".txt"):
        # Strict, as .jsonl is: errors="replace" built a pair from a binary file's U+FFFD noise.
        with open(path, encoding="utf-8-sig") as f:
            try:
                # Line by line (a line is read whole, however long: cut into pieces after). Reading a
                # document's length at a time instead would move document boundaries at long lines.
                yield from (p for d in _txt_documents(f) if d.strip() for p in _pieces(d))
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text (byte {e.start} of a read block: {e.reason})") from None
        return
    texts = (_checked_text(path, n, r) for n, r in numbered_records(path))
    yield from (p for t in texts if t.strip() for p in _pieces(t))


def lone_surrogate(text: str) -> str | None:
    """The first lone UTF-16 surrogate in text, else None. A JSON '\\ud800' escape (or a file name's
    byte that is not UTF-8, decoded with surrogateescape) puts one in a str: no UTF-8 encodes it, and
    tokenizers refuse it, later and naming nothing. Readers of text files refuse it where it enters."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return text[e.start]
    return None


def checked_text(text: str, where: str, what: str) -> str:
    """text, or a ValueError naming where it came from and what it is if it holds a lone surrogate."""
    if (bad := lone_surrogate(text)) is not None:
        raise ValueError(f"{where}: {what} is not text (a lone surrogate {bad!r} escape)")
    return text


def _checked_text(path: str, n: int, record: object) -> str:
    """record_text, refusing a lone surrogate: the tokenizer trainer failed on it naming no file."""
    return checked_text(record_text(record), record_where(path, n), "the record")


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
    held_docs = [docs[i] for i in sorted(held)]
    # By text too, not only by index: a record repeated in the data was trained on in its other place.
    unseen = set(held_docs)
    train = [d for i, d in enumerate(docs) if i not in held and d not in unseen]
    if not train:
        raise ValueError("every document repeats one held out for prompts: give more varied data")
    return train, held_docs


def make_prompts(held: list[str], n: int, seed: int) -> list[str]:
    """n distinct prompts; long held-out files give several (different random spots)."""
    rng, seen = random.Random(seed), {}  # a dict keeps first-seen order, unlike a set
    # Records' first fields first; where those repeat (every record opening with one system prompt),
    # random spots in them make up the rest.
    for spot in (False, True):
        for i in range(4 * n):
            if len(seen) == n:
                return list(seen)
            seen.setdefault(make_prompt(held[i % len(held)], rng, spot))
    return list(seen)


def make_prompt(doc: str, rng: random.Random, spot: bool = False, max_chars: int = 320) -> str:
    """A short snippet of whole lines: a record's first field(s), or a random spot in a file (or, with
    ``spot``, in any document)."""
    lines = doc.splitlines(keepends=True)
    # A record (question, instruction, problem) opens with its natural prompt and the rest is
    # the answer, so take only its first field; a long file has no natural start.
    is_record = len(doc) <= 2000 and not spot
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
