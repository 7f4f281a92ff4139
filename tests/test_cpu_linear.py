"""kernels/cpu_linear.py against its torch reference F.linear, its dispatch by row count, its repacking
when weights change, and a packed target still decoding exactly like the unpacked one."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear
from kernels.cpu_linear import PackedLinear, pack_linears
from osd_serve.config import SamplingParams
from osd_serve.engine import SpecEngine
from tests.conftest import llama, perturbed

pytestmark = pytest.mark.skipif(not cpu_linear.packable(), reason="this torch has no oneDNN")


def _packed(out_f: int, in_f: int, dtype, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    assert pack_linears(lin) == 1 and type(lin) is PackedLinear
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f,in_f,bias", [(7, 13, True), (64, 32, False), (1408, 512, False), (2100, 1100, True)])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 6), (13,), (1, 16), (8, 6), (2, 3, 5), (72,)])
def test_matches_reference(dtype, out_f, in_f, bias, lead):
    lin = _packed(out_f, in_f, dtype, bias)
    x = torch.randn(*lead, in_f).to(dtype)
    with torch.inference_mode():
        got = lin(x)
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    assert got.shape == (*lead, out_f) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol * in_f ** 0.5, rtol=tol)


@pytest.mark.parametrize("dtype,out_f,small,large", [
    (torch.float32, 64, cpu_linear.MIN_ROWS - 1, cpu_linear.MIN_ROWS),
    (torch.float32, 2100, cpu_linear.MIN_ROWS_LARGE - 1, cpu_linear.MIN_ROWS_LARGE),  # 2100 x 1100 x 4 B > 4 MiB
    (torch.bfloat16, 64, None, cpu_linear.MIN_ROWS_BF16),
])
def test_dispatch_by_rows(dtype, out_f, small, large):
    """Swap the packed copy for one of another weight: calls that take the packed path show it
    (without the AVX-512 kernel, which takes float32 calls of <= 48 rows first: tested below)."""
    lin = _packed(out_f, 1100, dtype, bias=False)
    lin._skinny = None
    other = torch.randn_like(lin.weight)
    lin._packed = torch.ops.mkldnn._reorder_linear_weight(other, 16)
    with torch.inference_mode():
        x = torch.randn(large, 1100).to(dtype)
        torch.testing.assert_close(lin(x).float(), F.linear(x, other).float(), atol=0.5, rtol=0.05)
        if small:
            x = torch.randn(small, 1100).to(dtype)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    with torch.no_grad():  # no_grad, not inference mode: what HF generate runs under
        x = torch.randn(large, 1100).to(dtype)
        torch.testing.assert_close(lin(x).float(), F.linear(x, other).float(), atol=0.5, rtol=0.05)


needs_skinny = pytest.mark.skipif(cpu_linear.skinny_kernel() is None, reason="no AVX-512 or no C++ compiler")


@needs_skinny
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 9, 10, 12, 13, 25, 49])  # last tile of every height 1-6
@pytest.mark.parametrize("out_f,in_f", [(1, 1), (5, 16), (7, 17), (3, 1408), (1411, 513), (4096, 512)])
def test_skinny_kernel_matches_reference_and_ignores_other_rows(rows, out_f, in_f):
    """Odd shapes (K not a multiple of 16, N not of the 4-row weight blocks), more rows than one tile;
    and each row's result is bit-identical to a call with that row alone, which F.linear does not
    promise and a verification relies on to see what a one-token step sees."""
    torch.manual_seed(rows * 1000 + out_f)
    x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
    kernel = cpu_linear.skinny_kernel()
    got = kernel(x, w)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5 * in_f ** 0.5, rtol=1e-5)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(got[i], kernel(x[i:i + 1], w)[0])


@needs_skinny
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_dispatch(bias):
    """float32 inference calls of <= 48 rows take the kernel (with the bias added), more rows do not;
    grad-enabled calls never do."""
    lin = _packed(2100, 1100, torch.float32, bias=bias)
    calls = []
    lin._skinny = lambda x, w: calls.append(x.shape[0]) or cpu_linear.skinny_kernel()(x, w)
    want = lambda x: F.linear(x, lin.weight, lin.bias)  # noqa: E731
    with torch.inference_mode():
        for lead in [(1,), (3, 4), (6, 8), (49,), (8, 7)]:
            x = torch.randn(*lead, 1100)
            torch.testing.assert_close(lin(x), want(x), atol=1e-4, rtol=1e-4)
    assert calls == [1, 12, 48]
    x = torch.randn(3, 1100, requires_grad=True)
    lin(x).sum().backward()
    assert calls == [1, 12, 48] and x.grad is not None
    with torch.inference_mode():
        assert lin(torch.randn(2, 0, 1100)).shape == (2, 0, 2100)  # an empty batch keeps its shape
    torch.manual_seed(0)
    off = nn.Linear(1100, 2100)
    pack_linears(off, skinny=False)
    assert off._skinny is None and copy.deepcopy(off)._use_skinny is False


@needs_skinny
def test_kernel_build_is_shared_by_every_copy_of_the_source(tmp_path):
    """A second checkout of the same source (another clone, a Ray working_dir) loads the cached build
    instead of recompiling it."""
    import shutil
    import subprocess

    assert cpu_linear.skinny_kernel() is not None

    def builds() -> dict:  # every built library in the cache and when it was written
        return {so.name: so.stat().st_mtime_ns for so in cpu_linear.kernel_build_dir().glob("*.so")}

    built = builds()
    assert built
    shutil.copytree(Path(cpu_linear.__file__).parent, tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys; from kernels import cpu_linear; assert cpu_linear.__file__.startswith(sys.argv[1]); "
            "assert cpu_linear.skinny_kernel() is not None")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, check=True, timeout=300)
    assert builds() == built, "the copy recompiled the kernel"


@needs_skinny
def test_leftover_build_lock_does_not_hang():
    """torch's loader waits without a timeout for its build lock file; one left by a process killed
    mid-build (however recently) is removed by whoever holds our flock, and the cached build loads."""
    import threading

    lock = cpu_linear.kernel_build_dir() / "lock"
    lock.touch()
    cpu_linear.skinny_kernel.cache_clear()
    got = []
    t = threading.Thread(target=lambda: got.append(cpu_linear.skinny_kernel()), daemon=True)
    t.start()
    t.join(timeout=120)
    assert got and got[0] is not None and not lock.exists()


@needs_skinny
def test_unusable_kernel_cache_falls_back(monkeypatch):
    with monkeypatch.context() as env:
        env.setenv("OSD_SERVE_KERNEL_CACHE", "/proc/no-such-dir")
        cpu_linear.skinny_kernel.cache_clear()
        assert cpu_linear.skinny_kernel() is None
        lin = _packed(64, 32, torch.float32, bias=True)
        x = torch.randn(3, 32)
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    cpu_linear.skinny_kernel.cache_clear()
    assert cpu_linear.skinny_kernel() is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_converted_after_packing_still_runs(dtype):
    """A packed float32 module moved to a dtype neither fast path takes falls back to F.linear, and lets
    go of its float32 copies: they stayed in memory for good (twice the weight, per layer)."""
    lin = _packed(64, 32, torch.float32, bias=True)
    assert lin._packed_src is not None
    lin = lin.to(dtype)
    with torch.inference_mode():
        for rows in (1, 3, 12, 20, 72):
            x = torch.randn(rows, 32).to(dtype)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert lin._packed is None and lin._packed_src is None


def test_repacks_when_weights_change():
    lin = _packed(64, 32, torch.float32, bias=True)
    x = torch.randn(20, 32)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # in place: the version counter moves
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.load_state_dict({"weight": torch.randn(64, 32), "bias": torch.randn(64)})
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.weight = nn.Parameter(torch.randn(64, 32))  # replaced: the storage moves
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_a_weight_replaced_at_the_packed_ones_address_is_repacked():
    """The key (version, address) names a weight only while its memory is held: replaced more than once
    between calls (load_state_dict(assign=True), .to() and back), a new version-0 weight could get the
    packed one's freed address, and oneDNN multiplied by the old weights (errors of 43 on outputs of ~40).
    A weight of another size is multiplied as F.linear would."""
    torch.manual_seed(0)
    lin = _packed(96, 64, torch.float32, bias=True)
    x = torch.randn(72, 64)  # oneDNN's packed path
    with torch.inference_mode():
        lin(x)
    for i in range(8):
        lin.weight = nn.Parameter(torch.randn(96, 64))
        if i % 2:
            with torch.inference_mode():
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.weight, lin.bias = nn.Parameter(torch.randn(100, 64)), None
    with torch.inference_mode():
        for rows in (3, 72):  # the skinny kernel's size, and oneDNN's
            torch.testing.assert_close(lin(x[:rows]), F.linear(x[:rows], lin.weight))


def test_deepcopy_and_pickle_repack():
    import pickle

    lin = _packed(64, 32, torch.float32, bias=True)
    x = torch.randn(20, 32)
    copies = [copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))]
    with torch.inference_mode():
        want = lin(x)
        copies.append(copy.deepcopy(lin))  # inference-tensor weights: served by F.linear
        for other in copies:
            assert type(other) is PackedLinear
            torch.testing.assert_close(other(x), want)
        torch.testing.assert_close(lin(x), want)  # the original keeps its packed copy
        copies[-1].weight.mul_(2)  # no version counter to see this by: must not use a stale pack
        torch.testing.assert_close(copies[-1](x), F.linear(x, copies[-1].weight, lin.bias))


def test_autocast_casts_like_the_reference():
    lin = _packed(64, 32, torch.float32, bias=True)
    x = torch.randn(20, 32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = lin(x), F.linear(x, lin.weight, lin.bias)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_training_takes_the_reference_path():
    lin = _packed(64, 32, torch.float32, bias=True)
    x = torch.randn(20, 32, requires_grad=True)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(x.grad, lin.weight.sum(0).expand(20, 32))


def test_inference_tensors_are_left_alone():
    with torch.inference_mode():
        lin = nn.Linear(8, 8)
    assert pack_linears(lin) == 0 and type(lin) is nn.Linear


@pytest.mark.parametrize("skinny", [False, True])
def test_packed_target_decodes_like_the_unpacked_one(tok, skinny):
    """Batch 8 with k=3 verifies 32 rows per forward: every linear takes the packed path (skinny=False)
    or, where it builds, the AVX-512 kernel."""
    target = llama(len(tok), hidden=64, layers=2, seed=0)
    draft = perturbed(target, 0.05)
    packed = copy.deepcopy(target)
    assert pack_linears(packed, skinny=skinny) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    prompts = [[3 + (7 * i + j) % 60 for j in range(3 + i % 5)] for i in range(8)]
    params = SamplingParams(max_tokens=24, num_speculative_tokens=3, ignore_eos=True)
    with torch.inference_mode():
        want = [o.token_ids for o in SpecEngine(target, draft, tok).generate(prompts, params)]
        got = [o.token_ids for o in SpecEngine(packed, draft, tok).generate(prompts, params)]
    assert got == want


def test_an_empty_linear_is_left_unpacked():
    """oneDNN refuses a zero-size weight: packing a model with one failed its whole load."""
    model = nn.Sequential(nn.Linear(8, 0), nn.Linear(0, 4), nn.Linear(8, 4))
    assert pack_linears(model) == 1 and type(model[0]) is nn.Linear and type(model[2]) is PackedLinear
    with torch.no_grad():
        assert model[0](torch.randn(2, 8)).shape == (2, 0)
