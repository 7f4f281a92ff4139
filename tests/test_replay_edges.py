"""Bad inputs to `osd-serve replay` and bootstrap's data readers: a clear error naming the file, line or
option, never a traceback or a silently different stream."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from osd_serve.corpus import numbered_records, read_documents
from osd_serve.replay import load_stream


def _jsonl(path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return str(path)


def test_a_corrupt_or_truncated_gzip_is_named(tmp_path):
    """A .jsonl.gz cut short (an interrupted copy) raised EOFError, a damaged one zlib.error: neither is
    ValueError or OSError, so both commands ended in a traceback; a plain file named .gz said only
    'Not a gzipped file', without its name."""
    data = gzip.compress("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(2000)).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    damaged = tmp_path / "damaged.jsonl.gz"
    damaged.write_bytes(data[:20] + b"\x00" * 20 + data[40:])
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_text('{"q": "x"}\n')
    for f in (cut, damaged, plain):
        with pytest.raises(ValueError, match=f"{f}: not a readable gzip file"):
            list(numbered_records(str(f)))
        with pytest.raises(ValueError, match=str(f)):
            list(read_documents(str(f)))
        with pytest.raises(ValueError, match=str(f)):
            load_stream([str(f)])


def test_max_requests_zero_is_refused_not_unlimited(tmp_path):
    """max_requests=0 was falsy, so it returned the whole stream."""
    data = _jsonl(tmp_path / "d.jsonl", [{"q": f"q{i}"} for i in range(5)])
    assert len(load_stream([data], max_requests=2)) == 2
    with pytest.raises(ValueError, match="max_requests"):
        load_stream([data], max_requests=0)


def test_a_template_field_one_record_lacks_names_its_line(tmp_path):
    """The error said the file's records lack the field, when one record did: name that record's line."""
    data = _jsonl(tmp_path / "d.jsonl", [{"q": "a", "c": "x"}, {"q": "b", "c": "y"}, {"q": "c"}])
    with pytest.raises(ValueError, match=f"--template .*'c'.*{data}:3"):
        load_stream([data], template="{q} {c}")


def test_an_empty_file_is_named_as_empty(tmp_path):
    """An empty file (or one of blank lines) said 'no record has the field(s) None'."""
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=f"{empty}: holds no records"):
        load_stream([str(empty)])
    numbers = _jsonl(tmp_path / "n.jsonl", [1, 2])  # records, but none with text
    with pytest.raises(ValueError, match="no record has a non-empty string field"):
        load_stream([numbers])
    with pytest.raises(ValueError, match=r"no record has the field\(s\) \['x'\]"):
        load_stream([numbers], fields=["x"])


def test_a_lone_surrogate_escape_in_bootstrap_data_is_named(tmp_path):
    """'\\ud800' is valid JSON in a UTF-8 file, but no text: the tokenizer trainer then failed with
    "'utf-8' codec can't encode character", naming no file, however many --data files there were."""
    data = tmp_path / "s.jsonl"
    data.write_text('{"q": "fine"}\n{"q": "a \\ud800 b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=f"{data}:2: .*surrogate"):
        list(read_documents(str(data)))
    arr = tmp_path / "s.json"
    arr.write_text('[{"q": "fine"}, {"q": "a \\udc00 b"}]', encoding="utf-8")
    with pytest.raises(ValueError, match=f"{arr} record 2: .*surrogate"):
        list(read_documents(str(arr)))


def test_replay_reads_what_bootstrap_reads_and_refuses_no_files(tmp_path):
    """An upper-case extension: bootstrap's reader took X.JSONL and replay refused it. No files at all
    divided each file's share by zero."""
    path = _jsonl(tmp_path / "UPPER.JSONL", [{"q": "what is 2 + 2?"}, {"q": "name a colour"}])
    assert len(list(read_documents(path))) > 0
    assert sorted(r["prompt"] for r in load_stream([path], fields=["q"])) == ["name a colour\n", "what is 2 + 2?\n"]
    with pytest.raises(ValueError, match="at least one data file"):
        load_stream([], max_requests=4)


def _surrogate_error(files, **kw) -> str:
    with pytest.raises(ValueError) as e:
        load_stream([str(f) for f in files], **kw)
    return str(e.value)


def test_a_lone_surrogate_in_replay_data_is_named_as_the_stream_is_read(tmp_path, monkeypatch, capsys):
    """'\\ud800' is valid JSON but no text: load_stream passed it, and replay failed only after the pair
    had loaded, in check_stream, with the tokenizer's "TextEncodeInput must be Union[...]" as the cause.
    Refused as generate refuses such a prompt line: by file, line and field, before the load."""
    from osd_serve import cli

    lone = repr("\ud800")
    data = tmp_path / "s.jsonl"
    data.write_text('{"q": "fine", "c": "x"}\n{"q": "a \\ud800 b", "c": "x"}\n', encoding="utf-8")
    assert _surrogate_error([data]) == f"{data}:2: 'q' is not text (a lone surrogate {lone} escape)"
    assert _surrogate_error([data], template="{c}: {q}") == f"{data}:2: the --template text is not text (a lone surrogate {lone} escape)"
    assert _surrogate_error([data], template="\ud800{c}") == f"--template: '\\ud800{{c}}' is not text (a lone surrogate {lone} escape)"
    arr = tmp_path / "s.json"
    arr.write_text('["fine", "a \\udc00 b"]', encoding="utf-8")
    assert _surrogate_error([arr]) == f"{arr} record 2: the record is not text (a lone surrogate {repr(chr(0xDC00))} escape)"
    # a field the prompt is not taken from may hold one
    other = tmp_path / "o.jsonl"
    other.write_text('{"q": "fine", "c": "a \\ud800 b"}\n', encoding="utf-8")
    assert [s["prompt"] for s in load_stream([str(other)], fields=["q"])] == ["fine\n"]

    def load(args):
        raise AssertionError("the pair loaded before the data was read")

    monkeypatch.setattr(cli, "_load", load)
    with pytest.raises(SystemExit) as e:
        cli.main(["replay", "--data", str(data), "--out", str(tmp_path / "run")])
    assert f"{data}:2: 'q' is not text" in str(e.value.code)


def test_a_data_file_name_that_is_not_utf8_labels_the_stream_as_text(tmp_path):
    """A file name with a byte that is not UTF-8 decodes (surrogateescape) to a lone surrogate: as the
    stream's source label it crashed plot_alpha (matplotlib's TypeError) after every run had finished."""
    from osd_serve.replay import plot_alpha

    odd = _jsonl(tmp_path / os.fsdecode(b"caf\xe9.jsonl"), [{"q": "b"}])
    stream = load_stream([_jsonl(tmp_path / "a.jsonl", [{"q": "a"}]), odd])
    assert [s["source"] for s in stream] == ["a.jsonl", "caf?.jsonl"] and stream[1]["where"] == f"{odd}:1"
    run = {"per_request": [{"acceptance": 0.5}] * 2}
    plot_alpha({"runs": {"online": run}, "sources": [s["source"] for s in stream]}, tmp_path / "alpha.png")


def test_a_shift_takes_max_requests_from_equal_shares_of_the_files_in_order(tmp_path):
    """Sequential order is a shift: each file in turn gives an equal share of max_requests, the first
    max_requests % files one more. A floor share gave 4 requests for --max-requests 5 over two files,
    and none at all from any file for fewer requests than files; a ceil share cut at max_requests gave
    three files of --max-requests 4 shares of 2, 2 and 0."""
    a = _jsonl(tmp_path / "a.jsonl", [{"q": f"a{i}"} for i in range(10)])
    b = _jsonl(tmp_path / "b.jsonl", [{"q": f"b{i}"} for i in range(10)])
    c = _jsonl(tmp_path / "c.jsonl", [{"q": f"c{i}"} for i in range(10)])
    assert [s["source"] for s in load_stream([a, b], max_requests=5)] == ["a.jsonl"] * 3 + ["b.jsonl"] * 2
    assert [s["source"] for s in load_stream([a, b], max_requests=1)] == ["a.jsonl"]
    assert [s["source"] for s in load_stream([a, b, c], max_requests=4)] == ["a.jsonl"] * 2 + ["b.jsonl", "c.jsonl"]
    assert [s["source"] for s in load_stream([a, b, c], max_requests=7)] == ["a.jsonl"] * 3 + ["b.jsonl"] * 2 + ["c.jsonl"] * 2
    assert len(load_stream([a, b])) == 20 and len(load_stream([a, b], order="shuffle", max_requests=5)) == 5


def test_the_offline_bound_trains_on_a_uniform_sample_of_the_stream(tok, monkeypatch):
    """The static run records every verified position into a reservoir of --buffer-mb, whatever
    eviction the online run uses, and the offline copy trains on uniform minibatches of it (no recency
    share): keeping or favouring the newest records biased the bound toward the stream's last domain."""
    import random

    from tests.conftest import llama

    from osd_serve import replay as rp
    from osd_serve.config import SamplingParams
    from osd_serve.distill.replay import BufferConfig
    from osd_serve.distill.trainer import DistillTrainer, TrainConfig

    target, draft = llama(len(tok), seed=0), llama(len(tok), seed=1)
    eng, buf = rp._static_engine(target, draft, tok, None, BufferConfig(eviction="fifo"), 0)
    assert buf.cfg.eviction == "reservoir"
    rng = random.Random(0)
    outs = eng.generate([[rng.randrange(3, len(tok)) for _ in range(4)] for _ in range(3)],
                        SamplingParams(max_tokens=4, num_speculative_tokens=2))
    records = buf.shard("default").records
    assert sorted(len(r.positions) for r in records) == sorted(len(c.token_ids) for c in outs)
    cfgs = []
    monkeypatch.setattr(rp, "DistillTrainer", lambda d, cfg, **kw: (cfgs.append(cfg), DistillTrainer(d, cfg, **kw))[1])
    _, stats = rp._train_offline(draft, buf, TrainConfig(recent_fraction=0.5, batch_size=2), len(tok), 1)
    assert cfgs[0].recent_fraction == 0.0 and stats["train_records"] == len(records) == 3
