"""The FFT S4D contraction and its decode step against the defining token loop (fp32, CPU or GPU)."""
import pytest
import torch

from megahybrid_kernels.interdomain.s4d import s4d_contraction, s4d_contraction_naive, s4d_contraction_step
from tests.utils import assert_close, requires_gpu, test_device

TOL = 1e-5  # fp32 relative RMS error: the FFT's rounding is ~1e-7 relative to each channel's norm


def _inputs(B=2, T=37, H=3, M=5, D=6, seed=0, state=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=g)
    decay = torch.stack((-torch.rand(H, M, generator=g) * 0.3 - 1e-3, torch.randn(H, M, generator=g)), -1)
    b = torch.randn(H, M, 2, generator=g)
    c = torch.randn(H, M, D, 2, generator=g)
    s0 = torch.randn(B, H, M, 2, D, generator=g) if state else None
    dev = test_device()
    return [t.to(dev) if t is not None else None for t in (x, decay, b, c, s0)]


@pytest.mark.parametrize("T, state", [(1, True), (37, True), (63, False), (64, False), (100, True), (300, True)])
def test_fft_matches_naive_with_grads(T, state):
    x, decay, b, c, s0 = _inputs(T=T, state=state)
    leaves = [t.requires_grad_() for t in (x, decay, b, c) + ((s0,) if state else ())]
    outs = {}
    for name, fn in (("naive", s4d_contraction_naive), ("fft", s4d_contraction)):
        y, sf = fn(x, decay, b, c, s0, True)
        grads = torch.autograd.grad((y * y.detach().sin()).sum() + (sf * sf.detach().cos()).sum(), leaves)
        outs[name] = (y, sf, grads)
    (y_r, s_r, g_r), (y_c, s_c, g_c) = outs["naive"], outs["fft"]
    assert_close(y_c, y_r, TOL, "y")
    assert_close(s_c, s_r, TOL, "final state")
    for i, (a, e) in enumerate(zip(g_c, g_r)):
        assert_close(a, e, 1e-4, f"grad {i}")


def test_slow_decay_long_sequence():
    """Modes that barely decay over 2000 tokens (|lambda| = 0.9999) at fast rotations: the kernel's phases at large
    lags, where a float32 tau * arg(lambda) would drift."""
    x, decay, b, c, _ = _inputs(T=2000, H=2, M=4, D=3, state=False)
    decay = torch.stack((torch.full_like(decay[..., 0], -1e-4), decay[..., 1] * 3), -1)
    y_r, s_r = s4d_contraction_naive(x.double(), decay.double(), b.double(), c.double(), None, True)
    y, s = s4d_contraction(x, decay, b, c, None, True)
    assert_close(y, y_r.float(), 1e-4, "y")
    assert_close(s, s_r.float(), 1e-4, "final state")


def test_without_final_state_returns_none():
    x, decay, b, c, s0 = _inputs(T=20)
    y, s = s4d_contraction(x, decay, b, c, s0)
    assert s is None and y.shape == x.shape


def test_steps_continue_the_sequence():
    x, decay, b, c, s0 = _inputs(T=9)
    y_r, s_r = s4d_contraction_naive(x, decay, b, c, s0, True)
    s, ys = s0, []
    for t in range(x.shape[1]):
        y, s = s4d_contraction_step(x[:, t], decay, b, c, s)
        ys.append(y)
    assert_close(torch.stack(ys, 1), y_r, TOL, "stepped y")
    assert_close(s, s_r, TOL, "stepped state")


def test_bad_shapes_name_the_fix():
    x, decay, b, c, _ = _inputs()
    with pytest.raises(ValueError, match="c must be"):
        s4d_contraction(x, decay, b, c[:, :, :2])


def _float64_summary(x, decay, b):
    """sum_s b lambda^(T-1-s) x_s in complex128 (every power in float64): the reference of the summary forms."""
    T = x.shape[1]
    tau = torch.arange(T - 1, -1, -1, dtype=torch.float64)
    weights = torch.exp(tau[:, None, None] * torch.complex(decay[..., 0], decay[..., 1]))
    return torch.einsum("thm,bthd->bhmd", weights * torch.complex(b[..., 0], b[..., 1]), x.to(torch.complex128))


SUMMARY_TOL = 2e-5  # relative RMS against float64; both forms measured <= 8.3e-6 (complex64 powers, fp32 sums)


@pytest.mark.parametrize("T", [128, 320, 4096])
@pytest.mark.parametrize("form", ["blocked", "direct"])
def test_summary_forms_match_float64_with_grads(T, form, monkeypatch):
    """zero_start_state's blocked form (T a multiple of 64 above one block: a CP shard's summary) and its direct
    form (every [T, H, M] power) against the float64 sum, the gradients for x, decay and b included; the blocked
    form also against the token loop's final state."""
    from megahybrid_kernels.interdomain import s4d

    x, decay, b, c, _ = _inputs(T=T, M=8, D=16, state=False)
    monkeypatch.setattr(s4d, "SUMMARY_BLOCK", 64 if form == "blocked" else T + 1)
    outs = []
    for fn, dtype in ((s4d.zero_start_state, torch.float32), (_float64_summary, torch.float64)):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in (x, decay, b)]
        s = torch.view_as_real(fn(*leaves)).double()
        outs.append((s, torch.autograd.grad((s * s.detach().cos()).sum(), leaves)))
    (s, grads), (ref, ref_grads) = outs
    assert_close(s, ref, SUMMARY_TOL, "summary")
    for name, a, r in zip(("dx", "ddecay", "db"), grads, ref_grads):
        assert_close(a.double(), r, SUMMARY_TOL, name)
    if T <= 320:
        _, final = s4d_contraction_naive(x, decay, b, c, output_final_state=True)
        assert_close(s.float().transpose(-1, -2), final, TOL, "state")  # both [B, H, M, (re, im), D]


def _summary_case(device, dtype, T=300, B=2, H=3, M=8, D=16, seed=4):
    """zero_start_state on 16-bit x and its gradients (x, decay, b), and the same with x in float64 (plain fp32
    products: the reference)."""
    from megahybrid_kernels.interdomain.s4d import zero_start_state

    x, decay, b, _, _ = _inputs(B=B, T=T, H=H, M=M, D=D, seed=seed, state=False)
    x = x.to(device, dtype)
    outs = []
    for xi in (x, x.double()):
        leaves = [t.detach().clone().to(device).requires_grad_() for t in (xi, decay, b)]
        s = torch.view_as_real(zero_start_state(*leaves)).double()
        grads = torch.autograd.grad((s * s.detach().cos()).sum(), leaves)
        outs.append((s, grads))
    (s, grads), (ref, ref_grads) = outs
    return s, grads, ref, ref_grads


def test_tf32_summary_product_gradients_on_cpu():
    """The TF32 product's hand-written backward (the GPU's path for 16-bit x; on the CPU the switch is a no-op) equals
    autograd's through the plain product."""
    from megahybrid_kernels.interdomain.s4d import _Tf32Sum

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(50, 3, 8, generator=g), torch.randn(2, 50, 3, 5, generator=g).bfloat16()
    dy = torch.randn(2, 3, 8, 5, generator=g)
    outs = []
    for fn in (_Tf32Sum.apply, lambda w_, x_: torch.einsum("thk,bthd->bhkd", w_, x_.float())):
        leaves = [t.detach().clone().requires_grad_() for t in (w, x)]
        y = fn(*leaves)
        outs.append((y, torch.autograd.grad((y * dy).sum(), leaves)))
    (y, grads), (ry, rgrads) = outs
    assert_close(y, ry, 1e-6, "summary")
    for name, a, r in zip(("dw", "dx"), grads, rgrads):
        assert a.dtype == r.dtype
        assert_close(a, r, 1e-6, name)


@pytest.mark.gpu
@requires_gpu
def test_shard_summary_bf16_on_tf32_gpu():
    """The CP shard summary of bf16 inputs on the TF32 tensor cores against the same from float64 x, which takes the
    plain fp32 products (fp32 weights round to TF32: 1e-3 relative), gradients for x, decay and b included."""
    s, grads, ref, ref_grads = _summary_case("cuda", torch.bfloat16, T=4096)
    assert_close(s, ref, 2e-3, "summary")
    for name, a, r in zip(("dx", "ddecay", "db"), grads, ref_grads):
        assert_close(a, r, 1e-2 if name == "dx" else 3e-3, name)
