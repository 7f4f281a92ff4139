"""Edge cases of kernels/cpu_linear.py and kernels/fused_kl.py that their main tests left open: each
test here failed against a mutant of the kernel (or the code before a fix) that the main tests let pass."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear
from kernels.cpu_linear import PackedLinear, pack_linears
from kernels.fused_kl import chunked_forward_kl, forward_kl_reference
from kernels.fused_kl_triton import HAS_TRITON

needs_onednn = pytest.mark.skipif(not cpu_linear.packable(), reason="this torch has no oneDNN")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _packed(out_f: int, in_f: int, dtype, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    assert pack_linears(lin) == 1
    return lin


def _close(got, x, lin):
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    tol = TOL[lin.weight.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol * lin.in_features ** 0.5, rtol=tol)


# ---- cpu_linear ----------------------------------------------------------------------------------

@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repacks_on_the_packed_path_after_a_swap_or_in_place_write(dtype):
    """72 float32 rows go past the AVX-512 kernel (which reads the live weight) to oneDNN's packed copy,
    the only path a stale copy shows on; tests/test_cpu_linear.py's repack test uses 20 rows, which
    the kernel serves. A fresh Parameter has version 0, as the packed one here: only its storage
    tells them apart (a load_state_dict(assign=True)); an in-place write keeps the storage and moves
    the version. Checking only one of the two served the old weights."""
    lin = nn.Linear(32, 64).to(dtype)
    lin.weight = nn.Parameter(torch.randn(64, 32).to(dtype))  # version 0
    assert pack_linears(lin) == 1 and lin.weight._version == 0
    x = torch.randn(72, 32).to(dtype)
    with torch.inference_mode():
        _close(lin(x), x, lin)
    lin.weight = nn.Parameter(torch.randn(64, 32).to(dtype))  # version 0 again, other storage
    with torch.inference_mode():
        _close(lin(x), x, lin)
    with torch.no_grad():
        lin.weight.mul_(-3.0)  # same storage, version moves
    with torch.inference_mode():
        _close(lin(x), x, lin)


@needs_onednn
def test_one_row_after_a_reload_still_takes_the_kernel():
    """The kernel gives a row the same bits whatever rows share its call, so a verification sees what
    a decode step sees. After the weights change, the first call (a 1-row decode step) must take the
    kernel too, not fall back to F.linear until some call has enough rows for oneDNN."""
    if cpu_linear.skinny_kernel() is None:
        pytest.skip("no AVX-512 or no C++ compiler")
    lin = _packed(1411, 513, torch.float32)
    x = torch.randn(20, 513)
    with torch.no_grad():
        lin.load_state_dict({"weight": torch.randn(1411, 513), "bias": torch.randn(1411)})
        one = lin(x[:1])
        assert torch.equal(one[0], lin(x)[0])


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skinny", [True, False])
@pytest.mark.parametrize("rows", [3, 20, 72])  # AVX-512 kernel or F.linear; kernel or oneDNN; oneDNN
def test_strided_and_batched_inputs(dtype, skinny, rows):
    """Inputs that are not row-major [rows, in]: a transposed [rows, in] reshapes to itself, still
    strided, which the C++ kernel refuses unless made contiguous first."""
    lin = _packed(70, 33, dtype)
    if not skinny:
        lin._skinny = None
    inputs = [
        torch.randn(33, rows).to(dtype).t(),  # transposed
        torch.randn(rows, 66).to(dtype)[:, ::2],  # every other column
        torch.randn(1, 33).to(dtype).expand(rows, 33),  # stride 0 along rows
        torch.randn(rows, 2, 33).to(dtype).transpose(0, 1),  # [B, T, H] with T and B swapped in memory
        torch.randn(2, 3, rows, 33).to(dtype)[:, 1:],  # 4-D, sliced
    ]
    with torch.inference_mode():
        for x in inputs:
            got = lin(x)
            assert got.shape == (*x.shape[:-1], 70)
            _close(got, x, lin)
        x = torch.randn(33).to(dtype)  # nn.Linear takes a single vector too
        assert lin(x).shape == (70,)
        _close(lin(x), x, lin)


@needs_onednn
def test_non_contiguous_weight_is_served():
    """A weight stored transposed (a Parameter made from w.t()) is not for the kernel, which refuses
    strided tensors: it must take oneDNN or F.linear instead of raising."""
    lin = nn.Linear(33, 70)
    lin.weight = nn.Parameter(torch.randn(33, 70).t())
    assert not lin.weight.is_contiguous() and pack_linears(lin) == 1
    with torch.inference_mode():
        for rows in (1, 5, 20, 72):
            x = torch.randn(rows, 33)
            _close(lin(x), x, lin)


@needs_onednn
@pytest.mark.parametrize("rows", [3, 72])
def test_dtype_mismatch_raises_like_nn_linear(rows):
    """x in another dtype than the weight: nn.Linear's own error, not the C++ kernel's or oneDNN's
    ("could not create a primitive descriptor"), which say nothing of dtypes."""
    lin = _packed(70, 33, torch.float32)
    x = torch.randn(rows, 33, dtype=torch.float64)
    with pytest.raises(RuntimeError) as want:
        F.linear(x, lin.weight, lin.bias)
    with torch.inference_mode(), pytest.raises(RuntimeError) as got:
        lin(x)
    assert str(got.value) == str(want.value)


@needs_onednn
def test_pack_linears_leaves_other_dtypes_and_subclasses_alone():
    """float16/float64 have no fast path here (oneDNN refuses float64 weights); a subclass of
    nn.Linear has a forward of its own (quantised, LoRA) that PackedLinear's would replace."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(8, 8).half(), nn.Linear(8, 8).double(), Scaled(8, 8), nn.Linear(8, 8).bfloat16())
    assert pack_linears(model) == 1
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, Scaled, PackedLinear]
    # no kernel handle on a bf16 layer: bench.py reports "float32 calls on the kernel" from it
    assert model[3]._skinny is None


@needs_onednn
def test_skinny_results_do_not_depend_on_the_thread_count():
    """Each output is summed by one thread in a fixed order, so changing torch's thread count between
    calls (a server sizing its pool after load) gives bit-identical outputs."""
    if cpu_linear.skinny_kernel() is None:
        pytest.skip("no AVX-512 or no C++ compiler")
    lin = _packed(1411, 513, torch.float32)
    x = torch.randn(13, 513)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            with torch.inference_mode():
                outs.append(lin(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_onednn
def test_state_dict_and_save_of_a_packed_model():
    """The packed copy is no parameter or buffer: a packed model's state dict is the plain one (a
    checkpoint written from a server loads into an unpacked model), and a whole-module save loads
    back as a PackedLinear that repacks and computes the same."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(33, 70), nn.Linear(70, 5, bias=False))
    packed = nn.Sequential(nn.Linear(33, 70), nn.Linear(70, 5, bias=False))
    packed.load_state_dict(plain.state_dict())
    assert pack_linears(packed) == 2
    sd = packed.state_dict()
    assert list(sd) == list(plain.state_dict())
    assert all(v.layout == torch.strided and torch.equal(v, plain.state_dict()[k]) for k, v in sd.items())
    buf = io.BytesIO()
    torch.save(packed, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(72, 33)
    with torch.inference_mode():
        assert type(loaded[0]) is PackedLinear
        torch.testing.assert_close(loaded(x), plain(x), atol=1e-4, rtol=1e-4)


def test_no_cpu_kernel_env_turns_the_kernel_off(monkeypatch):
    """OSD_SERVE_NO_CPU_KERNEL is the documented way to keep float32 calls off the C++ kernel."""
    monkeypatch.setenv("OSD_SERVE_NO_CPU_KERNEL", "1")
    cpu_linear.skinny_kernel.cache_clear()
    try:
        assert cpu_linear.skinny_kernel() is None
        monkeypatch.delenv("OSD_SERVE_NO_CPU_KERNEL")
        cpu_linear.skinny_kernel.cache_clear()
        unset = cpu_linear.skinny_kernel()
        monkeypatch.setenv("OSD_SERVE_NO_CPU_KERNEL", "0")  # "0" says no: it turned the kernel off too
        cpu_linear.skinny_kernel.cache_clear()
        assert (cpu_linear.skinny_kernel() is None) == (unset is None)
    finally:
        monkeypatch.delenv("OSD_SERVE_NO_CPU_KERNEL", raising=False)
        cpu_linear.skinny_kernel.cache_clear()


@needs_onednn
def test_failed_build_falls_back_and_says_why(tmp_path, monkeypatch, caplog):
    """A compile that fails (no compiler, a broken toolchain) leaves F.linear and oneDNN serving, and
    the warning carries the build's own error, the one thing a user can act on."""
    from torch.utils import cpp_extension

    def broken(*a, **kw):
        raise RuntimeError("Error building extension 'osd_serve_cpu_skinny': c++: not found")

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the kernel is not tried without AVX-512")
    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setenv("OSD_SERVE_KERNEL_CACHE", str(tmp_path))
    cpu_linear.skinny_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cpu_linear.__name__):
            lin = _packed(70, 33, torch.float32)
        assert lin._skinny is None
        assert any("c++: not found" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
        x = torch.randn(5, 33)
        with torch.inference_mode():
            _close(lin(x), x, lin)
    finally:
        monkeypatch.undo()
        cpu_linear.skinny_kernel.cache_clear()


def test_build_copy_is_refreshed_when_the_source_changes(tmp_path, monkeypatch):
    """The build compiles a copy of cpu_skinny.cpp kept in the build directory; a copy left by an
    older source must be overwritten, or every later start would load the old kernel. A stale torch
    lock file goes too. The compiler is faked: this checks the bookkeeping around it."""
    from torch.utils import cpp_extension

    seen = {}

    class Built:
        skinny_linear = object()

    def fake_load(name, sources, **kw):
        seen["sources"] = sources
        seen["text"] = open(sources[0], "rb").read()
        return Built

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    (tmp_path / "cpu_skinny.cpp").write_text("// an older kernel\n")
    (tmp_path / "lock").touch()
    assert cpu_linear._load_skinny(tmp_path) is Built.skinny_linear
    real = (cpu_linear.Path(cpu_linear.__file__).with_name("cpu_skinny.cpp")).read_bytes()
    assert seen == {"sources": [str(tmp_path / "cpu_skinny.cpp")], "text": real}
    assert not (tmp_path / "lock").exists()


# ---- fused_kl ------------------------------------------------------------------------------------

BACKENDS = [False] + ([True] if HAS_TRITON else [])
# Triton on the GPU where there is one (TRITON_INTERPRET=1 is set only without CUDA, and a compiled
# kernel cannot read CPU tensors); the torch path and the reference on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3, torch.softmax(torch.randn(n, v, generator=g) * 2, -1)


def _loss_and_grad(fn, s, p, mask, scale=1.0, device="cpu"):
    """Loss and dL/ds (on the CPU) of fn run on `device`."""
    s = s.detach().to(device).requires_grad_(True)
    loss = fn(s, p.to(device), None if mask is None else mask.to(device))
    (loss * scale).backward()
    return loss.detach().cpu(), s.grad.cpu()


def _kl(use_triton, chunk_size):
    return lambda s, p, m: chunked_forward_kl(s, p, m, chunk_size=chunk_size, use_triton=use_triton)


@pytest.mark.parametrize("use_triton", BACKENDS, ids=lambda t: "triton" if t else "torch")
def test_gradient_follows_the_incoming_gradient(use_triton):
    """The loss scaled before backward (AMP's grad scaler, a loss weight, accumulation over
    micro-batches): the gradient must scale with it. Every other test backpropagates 1."""
    s, p = _inputs(7, 300, 0)
    mask = torch.arange(7) % 3 != 1
    _, want = _loss_and_grad(forward_kl_reference, s, p, mask, scale=-2.5)
    _, got = _loss_and_grad(_kl(use_triton, 3), s, p, mask, scale=-2.5, device=DEVICE if use_triton else "cpu")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("use_triton", BACKENDS, ids=lambda t: "triton" if t else "torch")
@pytest.mark.parametrize("n", [0, 5])
def test_all_masked_or_empty_is_zero_not_nan(use_triton, n):
    """No kept position (a minibatch of prompts only): loss 0 and gradient 0, as the reference and
    losses.py give; dividing by the unclamped count made both NaN, and the trainer skips NaN steps."""
    s, p = _inputs(n, 50, 1)
    loss, grad = _loss_and_grad(_kl(use_triton, 2), s, p, torch.zeros(n, dtype=torch.bool), device=DEVICE if use_triton else "cpu")
    assert float(loss) == 0.0 and grad.shape == (n, 50) and not grad.any()


@pytest.mark.parametrize("use_triton", BACKENDS, ids=lambda t: "triton" if t else "torch")
def test_strided_inputs(use_triton):
    """The Triton kernels index row * V, which is right only for contiguous rows: the trainer's
    student logits are a [N, :width] cut of wider ones."""
    d = DEVICE if use_triton else "cpu"
    wide, p_t = torch.randn(6, 500, device=d) * 3, torch.softmax(torch.randn(333, 6, device=d), 0)
    s, p = wide[:, :333], p_t.t()  # column cut; transposed (cut on the device: .to() would compact them)
    assert not s.is_contiguous() and not p.is_contiguous()
    mask = torch.tensor([True, False, True, True, True, False], device=d)
    want_loss, want = _loss_and_grad(forward_kl_reference, s.cpu(), p.cpu(), mask.cpu())
    got_loss, got = _loss_and_grad(_kl(use_triton, 4), s, p, mask, device=d)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="without triton the torch path is the only one")
def test_cpu_tensors_take_the_torch_path_by_default(monkeypatch):
    """use_triton=None picks Triton on CUDA only: on CPU without TRITON_INTERPRET the kernel cannot
    run at all (the trainer on CPU passes None)."""
    import kernels.fused_kl_triton as kt

    def refuse(*a):
        raise AssertionError("Triton kernel called for CPU tensors")

    monkeypatch.setattr(kt, "kl_rows_fwd", refuse)
    monkeypatch.setattr(kt, "kl_rows_bwd", refuse)
    s, p = _inputs(4, 40, 2)
    _, grad = _loss_and_grad(lambda a, b, m: chunked_forward_kl(a, b, m, chunk_size=3), s, p, None)
    _, want = _loss_and_grad(forward_kl_reference, s, p, None)
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mask_shape", [(1,), (6, 1), (5,)])
def test_mask_of_another_shape_is_refused(mask_shape):
    """A [1] or [N, 1] mask broadcast against the [N] per-row losses: the result was their sum over
    all rows (6x the mean here) with no error. losses.py refuses these and says the fused path does."""
    s, p = _inputs(6, 40, 3)
    with pytest.raises(ValueError, match="mask shape"):
        chunked_forward_kl(s, p, torch.ones(mask_shape, dtype=torch.bool), use_triton=False)


def test_other_bad_inputs_are_refused_by_name():
    s, p = _inputs(6, 40, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_forward_kl(s, p, chunk_size=0)  # range() with step 0 raised its own, nameless error
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        chunked_forward_kl(s.view(2, 3, 40), p.view(2, 3, 40))  # failed in a chunk with a broadcasting error
