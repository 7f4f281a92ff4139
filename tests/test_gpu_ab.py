"""benchmarks/gpu_ab.py: two source trees timed against each other, interleaved, each importing its own
osd_serve. Run here on the CPU with a tiny pair (the device runs it on CUDA)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_ab
from tests.conftest import save_pair_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair_dir(tmp_path_factory.mktemp("abpair"), ("def f(x):", "select a from"), seed=3)


def test_two_trees_each_import_their_own_code_and_are_timed_per_round(pair, tmp_path, capsys):
    copy = tmp_path / "copy"  # a second tree: this one's osd_serve and kernels, as prepare unpacks a commit's
    for sub in ("osd_serve", "kernels"):
        shutil.copytree(ROOT / sub, copy / sub, ignore=shutil.ignore_patterns("__pycache__"))
    gpu_ab.main(["run", "--pair", str(pair), "--tree", f"head={ROOT}", "--tree", f"copy={copy}", "--k", "0,2",
                 "--rounds", "1", "--prompts", "1", "--max-tokens", "4", "--device", "cpu", "--dtype", "float32"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["rounds_ms_per_step"]) == {"head", "copy"}
    assert all(len(v) == 1 and min(v) > 0 for per in out["rounds_ms_per_step"].values() for v in per.values())
    assert out["over_head"]["head"] == {"0": 1.0, "2": 1.0} and out["args"]["prompts"] == 1


def test_a_tree_that_imports_another_osd_serve_is_refused(tmp_path, monkeypatch):
    """The worker names the file its engine came from (the two-tree test runs it for real); one from
    outside the tree, an installed osd_serve standing in for a tree that lacks a module, is refused."""
    other = json.dumps({"from": str(ROOT / "osd_serve" / "engine.py"), "ms": {"0": 1.0}})
    done = subprocess.CompletedProcess([], 0, stdout=f"AB {other}\n", stderr="")
    monkeypatch.setattr(gpu_ab.subprocess, "run", lambda *a, **kw: done)
    with pytest.raises(SystemExit, match="imported osd_serve from"):
        gpu_ab.time_tree(tmp_path, {})
    monkeypatch.setattr(gpu_ab.subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess([], 1, "", "ImportError: x"))
    with pytest.raises(SystemExit, match="failed .exit 1.:\nImportError: x"):
        gpu_ab.time_tree(tmp_path, {})


@pytest.mark.parametrize("trees,msg", [(["a=/nonexistent"], "no osd_serve"), ([f"a={ROOT}"], "two or more")])
def test_bad_trees_are_named(trees, msg):
    args = ["run", "--pair", "x"] + [a for t in trees for a in ("--tree", t)]
    with pytest.raises(SystemExit, match=msg):
        gpu_ab.main(args)
