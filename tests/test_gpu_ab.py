"""benchmarks/gpu_ab.py: two source trees timed against each other, interleaved, each importing its own
osd_serve. Run here on the CPU with a tiny pair (the device runs it on CUDA)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import char_tokenizer, llama, perturbed

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_ab", ROOT / "benchmarks" / "gpu_ab.py")
gpu_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_ab)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("abpair")
    tok = char_tokenizer()
    target = llama(len(tok), seed=3)
    for name, m in (("target", target), ("draft", perturbed(target, 0.05))):
        m.save_pretrained(out / name)
        tok.save_pretrained(out / name)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):", "select a from")))
    return out


def test_two_trees_each_import_their_own_code_and_are_timed_per_round(pair, tmp_path, capsys):
    copy = tmp_path / "copy"  # a second tree: this one's osd_serve and kernels, as prepare unpacks a commit's
    for sub in ("osd_serve", "kernels"):
        shutil.copytree(ROOT / sub, copy / sub, ignore=shutil.ignore_patterns("__pycache__"))
    gpu_ab.main(["run", "--pair", str(pair), "--tree", f"head={ROOT}", "--tree", f"copy={copy}", "--k", "0,2",
                 "--rounds", "1", "--prompts", "2", "--max-tokens", "6", "--device", "cpu", "--dtype", "float32"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["rounds_ms_per_step"]) == {"head", "copy"}
    assert all(len(v) == 1 and min(v) > 0 for per in out["rounds_ms_per_step"].values() for v in per.values())
    assert out["over_head"]["head"] == {"0": 1.0, "2": 1.0}


def test_a_tree_that_imports_another_osd_serve_is_refused(pair, tmp_path):
    empty = tmp_path / "empty"
    (empty / "osd_serve").mkdir(parents=True)  # no code: the worker imports the installed (editable) osd_serve
    with pytest.raises(SystemExit, match="failed|imported osd_serve from"):
        gpu_ab.time_tree(empty, dict(pair=str(pair), dtype="float32", device="cpu", prompts=1, max_tokens=4, batch=1, ks=[0]))


@pytest.mark.parametrize("trees,msg", [(["a=/nonexistent"], "no osd_serve"), ([f"a={ROOT}"], "two or more")])
def test_bad_trees_are_named(trees, msg):
    args = ["run", "--pair", "x"] + [a for t in trees for a in ("--tree", t)]
    with pytest.raises(SystemExit, match=msg):
        gpu_ab.main(args)
