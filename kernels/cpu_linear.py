"""Linear layers of the frozen target on CPU, with weights prepacked for oneDNN for the row counts
where that is faster than ``F.linear`` (the torch reference, which every other call still takes).

Why: a verification forward multiplies every weight matrix by batch x (k+1) rows, 2 to 72 here.
PyTorch's float32 ``F.linear`` on CPU calls MKL sgemm, whose kernel for such skinny inputs is slow:
on the 2-core CI host, a [16, 512] x [512, 1408] product takes 242 us with it and 142 us with oneDNN
on a prepacked weight (1.05-2.2x at 16-48 rows, 1.06-1.27x at 72); for a 25 MB weight MKL streams
the matrix once per 3 rows (m = 1..3: 0.47-0.49 ms, 4..6: 0.97-0.98 ms, 8: 1.46 ms) where oneDNN
reads it once (0.56-0.63 ms up to m = 6; benchmarks/results/cpu_linear.jsonl). For 1 to ~12 rows of
a small matrix MKL wins instead (oneDNN costs ~15 us more per call), so the choice is by row count
(``benchmarks/cpu_linear.py`` prints the table this rule comes from). On an AVX-512 CPU, float32
calls of up to 48 rows take ``kernels/cpu_skinny.cpp`` instead (decode steps, verifications up to 48
tokens in all): it reads each weight from memory once for all rows with the loads prefetched, which
neither library does at these counts (a 4-token target forward costs 1.14x a 1-token one with it,
1.37x without), and its per-row results do not depend on the row count, so a verification of up to
48 rows sees bit-for-bit the linear outputs a one-token step sees. The two oneDNN ops are the ones
PyTorch's own Inductor emits for a frozen CPU linear (``mkldnn._reorder_linear_weight`` +
``mkldnn._linear_pointwise``); we call them directly because compiling a model whose KV cache grows
every step recompiles on each new length.

Only for models that do not train (the target): a packed copy goes stale when the weight changes, so
each call checks the weight's version counter and storage and repacks if either moved. That sees
writes through the parameter (``copy_``, ``load_state_dict``, in-place ops, assignment, ``.to()``) but
not writes through ``weight.data`` (its own version counter, same storage), which peft's LoRA merge
uses: never merge adapters into a packed model. Nor a fused optimizer step (``AdamW(fused=True)``:
torch 2.13's ``_fused_adamw_`` moves no version counter), which a frozen target never takes. Costs
one extra copy of the linear weights in memory.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# float32 (MKL behind F.linear): packed from 4 rows for a weight past 4 MiB, where MKL's re-streaming
# of the weight every 3 rows dominates, and from 16 rows for any weight
LARGE_WEIGHT_BYTES = 4 << 20
MIN_ROWS_LARGE = 4
MIN_ROWS = 16
# bfloat16 F.linear already runs on oneDNN but reorders the weight on every call: packed always wins
MIN_ROWS_BF16 = 1


# float32 on an AVX-512 CPU: up to this many rows go to kernels/cpu_skinny.cpp (decode steps, batch-1
# verifications, batch-8 ones up to k=5), whatever the weight's size. On the CI host a batch-8 forward of
# the default target on it beat oneDNN's packed path by 1.27x at 16 rows, 1.14x at 32 and 1.08x at 48
# (per matrix at 48 rows it took 0.99-1.18x oneDNN's time, the forward gained anyway; results/cpu_linear.jsonl)
SKINNY_MAX_ROWS = 48
BUILD_WAIT_S = 600  # a build takes ~30 s


def packable() -> bool:
    return torch.backends.mkldnn.is_available()


def kernel_build_dir() -> Path:
    """One build per torch and Python (the module links both), shared by every process of the machine."""
    root = Path(os.environ.get("OSD_SERVE_KERNEL_CACHE") or Path.home() / ".cache" / "osd-serve" / "kernels")
    return root / f"cpu_skinny-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"


@functools.cache
def skinny_kernel():
    """``skinny_linear(x, w)`` from kernels/cpu_skinny.cpp, or None where it cannot run: no AVX-512,
    ``OSD_SERVE_NO_CPU_KERNEL`` set, no C++ compiler, an unusable cache directory. Compiled by torch's
    extension loader on first use (about 30 s once per machine; cached under ``OSD_SERVE_KERNEL_CACHE``,
    default ``~/.cache/osd-serve/kernels``, rebuilt when the source changes). Any failure is logged and
    leaves ``F.linear`` and oneDNN in place."""
    if os.environ.get("OSD_SERVE_NO_CPU_KERNEL", "0") not in ("", "0") or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    log.info("loading kernels/cpu_skinny.cpp (compiled on first use, ~30 s once per machine)")
    try:
        return _load_skinny(kernel_build_dir())
    except Exception as err:  # no compiler or ninja, unwritable cache, a build that never ends
        log.warning("CPU skinny-linear kernel unavailable, using F.linear/oneDNN: %s", err)
        return None


def _load_skinny(build: Path):
    import fcntl

    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    # torch's loader guards a build with a lock *file* and waits for it without a timeout, so one left
    # by a process killed mid-build would hang every later start. Our own flock is released by the OS
    # when its holder dies: whoever holds it is the only one of us in torch's loader for this
    # directory, so a torch lock file found then is stale and goes.
    with open(build / "osd.lock", "w") as held:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has held {build / 'osd.lock'} for over {BUILD_WAIT_S} s") from None
                time.sleep(0.2)
        (build / "lock").unlink(missing_ok=True)
        # Build from a copy kept in the build directory: torch's loader rebuilds when a source's *path*
        # changes, so every clone, and every Ray working_dir (a new path per deploy), recompiled the same
        # source (~25 s). Rewritten only when its content differs, since ninja goes by modification time.
        src, local = Path(__file__).with_name("cpu_skinny.cpp"), build / "cpu_skinny.cpp"
        text = src.read_bytes()
        if not local.is_file() or local.read_bytes() != text:
            tmp = local.with_suffix(".tmp")
            tmp.write_bytes(text)
            tmp.replace(local)
        # -fopenmp: ATen's parallel_for is inline OpenMP; its symbols bind to torch's own libgomp
        mod = cpp_extension.load(name="osd_serve_cpu_skinny", sources=[str(local)],
                                 extra_cflags=["-O3", "-mavx512f", "-fopenmp"], build_directory=str(build), verbose=False)
    return mod.skinny_linear


def _skinny_fits(w: torch.Tensor) -> bool:
    """Weights kernels/cpu_skinny.cpp multiplies: float32, rows contiguous."""
    return w.dtype == torch.float32 and w.is_contiguous()


def _min_rows(w: torch.Tensor) -> int:
    """Fewest rows for which oneDNN's packed path beats F.linear for this weight."""
    if w.dtype == torch.bfloat16:
        return MIN_ROWS_BF16
    if w.dtype != torch.float32:  # converted after packing (.half(), .double()): F.linear only
        return sys.maxsize
    return MIN_ROWS_LARGE if w.numel() * w.element_size() >= LARGE_WEIGHT_BYTES else MIN_ROWS


def _weight_key(w: torch.Tensor, version: int) -> tuple:
    """What tells a packed copy's weight from any other while the copy holds it (PackedLinear._pack)."""
    return version, w.data_ptr(), w.dtype, tuple(w.shape)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) that routes float32 inference calls of up to
    ``SKINNY_MAX_ROWS`` rows to kernels/cpu_skinny.cpp where it runs, and other calls with enough rows
    to oneDNN on a prepacked copy of its weight."""

    def _pack(self) -> None:
        w = self.weight.detach()  # shares the weight's storage and version counter
        version = w._version  # before the reorder reads it: a write meanwhile leaves the copy marked stale
        # the batch-size hint only picks oneDNN's weight layout; any row count works with it
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, MIN_ROWS)
        # Held, so its memory is never handed to another tensor: a weight replaced twice between calls
        # could otherwise land at the packed one's address with the same version, and match its key.
        self._packed_src = w
        self._packed_of = _weight_key(w, version)
        self._min_rows = _min_rows(w)  # fixed by the weight's dtype and size, both part of _packed_of
        use = _skinny_fits(w) and getattr(self, "_use_skinny", True)
        self._skinny = skinny_kernel() if use else None

    def _release(self) -> None:
        self._packed = self._packed_src = self._packed_of = None

    def __getstate__(self) -> dict:
        # oneDNN's packed tensor has no storage to copy or pickle, nor has the compiled kernel's handle:
        # deepcopy and pickle (Ray) carry the module without them, and its first inference call repacks
        return self.__dict__ | {"_packed": None, "_packed_of": None, "_packed_src": None, "_skinny": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        w = self.weight
        # F.linear instead: an inference-tensor weight (a copy made in inference mode) keeps no version
        # counter, so its packed copy could go stale unnoticed; under autocast F.linear casts and
        # mkldnn's op, not on autocast's list, would not
        if (torch.is_grad_enabled() or not x.is_cpu or x.dtype != w.dtype or w.is_inference()
                or torch.is_autocast_enabled("cpu")):
            if not w.is_cpu and self._packed_src is not None:  # moved to a GPU: the CPU copies would stay for good
                self._release()
            return F.linear(x, w, self.bias)
        skinny = rows <= SKINNY_MAX_ROWS and _skinny_fits(w)
        if self._packed_of != _weight_key(w, w._version):  # weights were loaded, moved or replaced since
            if not skinny and rows < _min_rows(w):  # no faster path: nothing to (re)pack for
                # and the stale copies go: after .half() (a dtype neither path takes) every call came
                # here, and the float32 weight and its oneDNN copy stayed in memory for good
                self._release()
                return F.linear(x, w, self.bias)
            self._pack()
        if skinny and self._skinny is not None:
            y = self._skinny(x.reshape(rows, x.shape[-1]).contiguous(), w)  # [rows, out]
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], w.shape[0])  # a replaced weight's own size, as F.linear gives
        if rows < self._min_rows:  # not on the kernel, and too few rows for oneDNN to beat F.linear
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, skinny: bool = True) -> int:
    """Turn every plain ``nn.Linear`` of a CPU float32/bfloat16 model into a ``PackedLinear`` in place;
    ``skinny=False`` keeps them off kernels/cpu_skinny.cpp (the benchmarks compare the two).
    Returns how many were converted (0 where oneDNN is unavailable or the model is elsewhere)."""
    if not packable():
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is not nn.Linear:
            continue
        w = mod.weight
        # inference tensors keep no version counter, so a change to one could not be noticed
        # (and not empty: oneDNN refuses a zero-size weight, and there is nothing to speed up)
        if w.is_cpu and not w.is_inference() and w.dtype in (torch.float32, torch.bfloat16) and w.numel():
            mod.__class__ = PackedLinear
            mod._use_skinny = skinny
            mod._pack()
            n += 1
    return n
