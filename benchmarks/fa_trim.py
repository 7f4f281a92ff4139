"""Trim an unpacked flash-attn 2 source tree to the forward kernels of one head dim, for the GPU bench's
build on a lent device (benchmarks/gpu_flash_attn.sh): the whole release is 72 kernel files, each
a long nvcc compile, and a loan is 30 minutes. Inference needs the forward and split-KV forward only.

Three edits, each checked so that a release that changed them fails here rather than mid-build:
- setup.py: flash-attn's own FLASHATTENTION_DISABLE_BACKWARD (a flag its setup.py lists, commented out),
  and only this head dim's kernel files among the CUDA sources;
- static_switch.h: HEADDIM_SWITCH dispatches to this head dim alone and refuses any other by name (the
  other sizes' kernels are not compiled, so their symbols would be missing at import).

usage: python3 benchmarks/fa_trim.py SRC_DIR HDIM"""
from __future__ import annotations

import re
import sys
from pathlib import Path

SIZES = (32, 64, 96, 128, 192, 256)  # HEADDIM_SWITCH's buckets: a head dim d runs the first size >= d


def trim_setup(text: str, hdim: int) -> str:
    flag = '# "-DFLASHATTENTION_DISABLE_BACKWARD",'
    if flag not in text:
        raise SystemExit("setup.py: no commented FLASHATTENTION_DISABLE_BACKWARD flag (another flash-attn release?)")
    text = text.replace(flag, flag[2:], 1)  # the first is the CUDA build's nvcc flags (the second, ROCm's)
    kept, dropped = [], 0
    for line in text.splitlines(keepends=True):
        m = re.search(r'"csrc/flash_attn/src/flash_\w+?_hdim(\d+)_\w+\.cu"', line)
        if m and int(m.group(1)) != hdim:
            dropped += 1
            continue
        kept.append(line)
    if not dropped:
        raise SystemExit("setup.py: no kernel files by head dim found (another flash-attn release?)")
    return "".join(kept)


def trim_switch(text: str, hdim: int) -> str:
    lower = SIZES[SIZES.index(hdim) - 1] if hdim != SIZES[0] else 0
    one = (f"#define HEADDIM_SWITCH(HEADDIM, ...) \\\n  [&] {{ \\\n"
           f'    TORCH_CHECK(HEADDIM > {lower} && HEADDIM <= {hdim}, "this flash-attn build has head dim {hdim} only '
           f'(benchmarks/gpu_flash_attn.sh; FA_HDIM=all builds every size), not ", HEADDIM); \\\n'
           f"    constexpr static int kHeadDim = {hdim}; \\\n    return __VA_ARGS__(); \\\n  }}()\n")
    new, n = re.subn(r"#define HEADDIM_SWITCH\(HEADDIM, \.\.\.\).*?\}\(\)\n", lambda _: one, text, count=1, flags=re.S)
    if n != 1:
        raise SystemExit("static_switch.h: no HEADDIM_SWITCH macro (another flash-attn release?)")
    return new


def main(src: str, hdim: str) -> None:
    h = int(hdim)
    if h not in SIZES:
        raise SystemExit(f"head dim {h}: flash-attn 2 builds {SIZES}")
    root = Path(src)
    for path, trim in ((root / "setup.py", trim_setup), (root / "csrc/flash_attn/src/static_switch.h", trim_switch)):
        path.write_text(trim(path.read_text(), h))
    n = len(re.findall(r'"csrc/flash_attn/src/flash_\w+\.cu"', (root / "setup.py").read_text()))
    print(f"flash-attn trimmed to head dim {h}, forward only: {n} kernel files to compile")


if __name__ == "__main__":
    main(*sys.argv[1:3]) if len(sys.argv) == 3 else sys.exit(__doc__)
