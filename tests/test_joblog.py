"""The distill controller's job history survives a restart of its actor (osd_serve/distill/joblog.py):
it started empty, so /admin/experts showed no job, not even those before the death, and nothing said
a restart had happened."""

from __future__ import annotations

import json
import math

import pytest

import deployments.distiller as dist
from osd_serve.distill.joblog import JobLog
from tests.test_distiller_mutants import _controller, _fill, _polls, draft_dir, plain_ray  # noqa: F401  fixtures


def test_events_are_read_back_bounded_and_a_cut_line_is_skipped(tmp_path):
    path = tmp_path / "jobs.jsonl"
    log = JobLog(path, keep=3)
    for i in range(10):
        log.append({"i": i, "score": float("nan") if i == 9 else 0.5, "dir": tmp_path})
        assert len(path.read_text().splitlines()) <= 6  # rewritten with the newest 3 past twice that
    assert [e["i"] for e in log] == [7, 8, 9] and len(log) == 3
    again = JobLog(path, keep=3)
    assert [e["i"] for e in again] == [7, 8, 9] and math.isnan(list(again)[-1]["score"])
    assert list(again)[0]["dir"] == str(tmp_path)  # not JSON: kept as its text
    with path.open("a") as f:
        f.write('{"i": 10, "cut sho')  # a crash mid-line
    third = JobLog(path, keep=3)
    assert [e["i"] for e in third] == [7, 8, 9]
    third.append({"i": 11})
    assert [json.loads(line)["i"] for line in path.read_text().splitlines()] == [7, 8, 9, 11]  # the cut line is gone


def test_a_history_that_cannot_be_written_warns_once_and_never_raises(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = JobLog(blocker / "jobs.jsonl", keep=2)  # its folder is a file
    for i in range(5):
        log.append({"i": i})
    assert [e["i"] for e in log] == [3, 4]  # kept in memory
    assert caplog.text.count("not saved") == 1


def test_a_restarted_controller_shows_the_jobs_before_and_says_it_restarted(plain_ray, monkeypatch, tmp_path, draft_dir):
    ctrl, trains, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    _fill(plain_ray, 12, heldout=4)
    ctrl._stop = _polls(1)
    ctrl._loop(0)
    assert len(trains) == 1 and ctrl.history()[-1]["published"]
    before = ctrl.history()
    monkeypatch.setattr(dist, "_restarted", lambda: True)  # Ray runs __init__ again in the new process
    again, _, _ = _controller(plain_ray, monkeypatch, tmp_path, draft_dir)
    assert again.history()[:-1] == json.loads(json.dumps(before, default=str))
    assert "restarted" in again.history()[-1] and again.report()["jobs"][-1] == again.history()[-1]
    monkeypatch.setattr(dist, "_restarted", lambda: False)
    assert len(_controller(plain_ray, monkeypatch, tmp_path, draft_dir)[0].history()) == len(before) + 1  # a new actor adds none


def test_replace_json_leaves_the_old_file_or_the_new_one_and_no_temporary(tmp_path):
    from osd_serve.distill.joblog import replace_json

    path = tmp_path / "state.json"
    replace_json(path, {"finished": 3})
    replace_json(path, {"finished": 4})
    assert json.loads(path.read_text()) == {"finished": 4}
    (tmp_path / "a dir").mkdir()
    with pytest.raises(OSError):
        replace_json(tmp_path / "a dir", {"x": 1})  # the rename fails: its temporary file must not stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a dir", "state.json"]
