"""benchmarks/fa_trim.py: the flash-attn source trim for a one-head-dim, forward-only build on a lent GPU.
It edits another project's files, so each edit is checked on text shaped like flash-attn 2.8's, and on
the real sdist where benchmarks/gpu_flash_attn.sh fetch has put it (.fa/, git-ignored)."""
from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from benchmarks import fa_trim

ROOT = Path(__file__).resolve().parents[1]

KERNELS = [f'                "csrc/flash_attn/src/flash_{kind}_hdim{d}_{t}{c}_sm80.cu",\n'
           for kind in ("fwd", "bwd", "fwd_split") for d in fa_trim.SIZES for t in ("fp16", "bf16") for c in ("", "_causal")]
SETUP = ('    nvcc_flags = [\n        "-O3",\n    # "-DFLASHATTENTION_DISABLE_BACKWARD",\n    ]\n'
         '            sources=[\n                "csrc/flash_attn/flash_api.cpp",\n' + "".join(KERNELS) + "            ],\n"
         '                    # "-DFLASHATTENTION_DISABLE_BACKWARD",\n')  # the second: ROCm's flags
SWITCH = ("#define FP16_SWITCH(COND, ...) \\\n  [&] { return __VA_ARGS__(); }()\n\n"
          "#define HEADDIM_SWITCH(HEADDIM, ...)   \\\n  [&] {                                    \\\n"
          + "".join(f"    if (HEADDIM <= {d}) {{ constexpr static int kHeadDim = {d}; return __VA_ARGS__(); }} \\\n"
                    for d in fa_trim.SIZES) + "  }()\n")


def test_setup_keeps_one_head_dims_kernels_and_disables_backward():
    out = fa_trim.trim_setup(SETUP, 64)
    kept = re.findall(r"flash_(\w+?)_hdim(\d+)_", out)
    assert len(kept) == 12 and {d for _, d in kept} == {"64"} and {k for k, _ in kept} == {"fwd", "bwd", "fwd_split"}
    assert '    "-DFLASHATTENTION_DISABLE_BACKWARD",' in out  # the CUDA flags' copy, uncommented
    assert '# "-DFLASHATTENTION_DISABLE_BACKWARD",' in out  # ROCm's left as it was
    assert '"csrc/flash_attn/flash_api.cpp"' in out


def test_switch_dispatches_one_size_and_refuses_others_by_name():
    out = fa_trim.trim_switch(SWITCH, 128)
    assert "kHeadDim = 128;" in out and "kHeadDim = 64" not in out and "kHeadDim = 256" not in out
    assert "HEADDIM > 96 && HEADDIM <= 128" in out  # 97-128 run the 128 kernel, as the full switch sends them
    assert out.startswith("#define FP16_SWITCH")  # the other macros are untouched
    assert "this flash-attn build has head dim 128 only" in out


@pytest.mark.parametrize("edit,text", [("trim_setup", "nothing here"), ("trim_switch", "#define OTHER 1\n")])
def test_another_release_fails_before_the_build(edit, text):
    with pytest.raises(SystemExit, match="another flash-attn release"):
        getattr(fa_trim, edit)(text, 64)


def test_a_head_dim_flash_attn_has_no_kernel_for_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="head dim 80"):
        fa_trim.main(str(tmp_path), "80")


def test_the_real_sdist_trims(tmp_path):
    sdists = sorted((ROOT / ".fa").glob("flash_attn-*.tar.gz"))
    if not sdists:
        pytest.skip("no flash-attn sdist in .fa/ (bash benchmarks/gpu_flash_attn.sh fetch)")
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(tmp_path, filter="data")
    src = next(tmp_path.iterdir())
    fa_trim.main(str(src), "64")
    assert len(re.findall(r'"csrc/flash_attn/src/flash_\w+\.cu"', (src / "setup.py").read_text())) == 12
    assert "kHeadDim = 128" not in (src / "csrc/flash_attn/src/static_switch.h").read_text()
