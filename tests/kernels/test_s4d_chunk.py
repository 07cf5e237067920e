"""The chunked S4D contraction (kernels/interdomain/s4d_chunk.py) against the float64 token loop, its carry kernel
against the torch walk, and bf16 on the GPU against the fp32 FFT contraction."""
import pytest
import torch

from megahybrid_kernels.interdomain import s4d_chunk
from megahybrid_kernels.interdomain.s4d import s4d_contraction
from megahybrid_kernels.interdomain.s4d_chunk import s4d_contraction_chunked
from tests.kernels.test_s4d import _inputs
from tests.utils import assert_close, nan_poisoned_empty, requires_gpu

# fp32 against the float64 loop, output, state and every gradient: measured <= 3e-7 (the FFT contraction <= 6e-7, the
# complex64 token loop <= 2e-6)
TOL = 2e-6


def _run(fn, inputs, seed=1):
    """y, the final state and the gradients of a random linear function of both, for every input."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    y, s = fn(*leaves, True)
    g = torch.Generator().manual_seed(seed)
    loss = (y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device)).sum()
    loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.device)).sum()
    live = [t for t in leaves if t is not None]
    return y, s, torch.autograd.grad(loss, live)


def _loop64(x, decay, b, c, s0=None, output_final_state=True):
    """The defining token loop in complex128 (s4d_contraction_naive computes in complex64)."""
    pairs = lambda t: torch.complex(t[..., 0].double(), t[..., 1].double())  # noqa: E731
    lam, bc, cc = torch.exp(pairs(decay))[..., None], pairs(b)[..., None], pairs(c)
    s = pairs(s0.transpose(-1, -2)) if s0 is not None else 0
    ys = []
    for t in range(x.shape[1]):
        s = lam * s + bc * x[:, t, :, None, :].double()
        ys.append((cc * s).real.sum(2))
    return torch.stack(ys, 1), torch.stack((s.real, s.imag), -2)


def _check_against_float64(inputs, chunk_size):
    y, s, grads = _run(lambda *a: s4d_contraction_chunked(*a, chunk_size=chunk_size), inputs)
    ry, rs, rgrads = _run(_loop64, inputs)
    assert_close(y, ry, TOL, "y")
    assert_close(s, rs, TOL, "final state")
    for name, a, r in zip(("dx", "ddecay", "db", "dc", "ds0"), grads, rgrads):
        assert_close(a, r, TOL, name)


@pytest.mark.parametrize("T, state", [(1, True), (37, True), (63, False), (64, False), (100, True), (300, True)])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("walk", ["kernel", "torch"])
def test_chunked_matches_float64_with_grads(T, state, chunk_size, walk, monkeypatch):
    """On CPU tensors the carry runs as Triton's interpreter (kernel) or as the torch loop training uses (torch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if walk == "kernel" else "0")
    _check_against_float64(_inputs(T=T, state=state), chunk_size)


def test_chunked_at_many_modes_and_features():
    """M = 40 and D = 70: two mode tiles and two feature tiles per head in the carry kernel (32 x 64 tiles)."""
    _check_against_float64(_inputs(B=1, T=100, H=2, M=40, D=70), 32)


def test_chunked_slow_decay_long_sequence():
    """|lambda| = 0.9999 at fast rotations over 2000 tokens: lambda^L is formed in float64, so the carried phase
    does not drift."""
    x, decay, b, c, _ = _inputs(T=2000, H=2, M=4, D=3, state=False)
    decay = torch.stack((torch.full_like(decay[..., 0], -1e-4), decay[..., 1] * 3), -1)
    y_r, s_r = _loop64(x, decay, b, c)
    y, s = s4d_contraction_chunked(x, decay, b, c, None, True)
    assert_close(y, y_r, TOL, "y")
    assert_close(s, s_r, TOL, "final state")


def _walk_case(rev, seed=0, B=2, N=5, H=2, M=40, D=70):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(H, 2, M, B, N, D, generator=g)
    s = torch.randn(H, 2, M, B, N, D, generator=g) if rev else None
    x0 = torch.randn(B, H, 2, M, D, generator=g)
    decay = torch.stack((-torch.rand(H, M, generator=g) * 0.2, torch.randn(H, M, generator=g)), -1)
    return u, s, x0, decay


@pytest.mark.parametrize("rev", [False, True])
@pytest.mark.parametrize("init", [False, True])
def test_carry_kernel_matches_torch_walk(rev, init, monkeypatch):
    """_carry_kernel (Triton's interpreter) against _carry_torch: every state, the last one and, in reverse, the
    per-head sums for lambda's gradient; kernel outputs start as NaN, so an element left unwritten fails."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    u, s, x0, decay = _walk_case(rev)
    x0 = x0 if init else None
    with nan_poisoned_empty():
        xb, last, part = s4d_chunk._carry_triton(u, s, x0, decay, 16, 7, rev)
    rxb, rlast, rpart = s4d_chunk._carry_torch(u, s, x0, decay, 16, 7, rev)
    assert_close(xb, rxb, 1e-6, "states")
    assert_close(last, rlast, 1e-6, "last")
    if rev:
        assert_close(part.sum(2), rpart.sum(2), 1e-6, "lambda sums")


def test_bad_shapes_name_the_fix():
    x, decay, b, c, _ = _inputs()
    with pytest.raises(ValueError, match="c must be"):
        s4d_contraction_chunked(x, decay, b, c[:, :, :2])


def _gpu_case(dtype, T, B=2, H=4, M=64, D=128, seed=3, device="cuda"):
    x, decay, b, c, s0 = _inputs(B=B, T=T, H=H, M=M, D=D, seed=seed)
    decay = torch.stack((-torch.rand_like(decay[..., 0]) * 0.1 - 1e-3, decay[..., 1]), -1)  # S4D-like |lambda|
    b, c = b / M ** 0.5, c / M ** 0.5
    return [t.to(device) for t in (x.to(dtype), decay, b, c, s0)]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T", [63, 1000, 4096])
@pytest.mark.parametrize("dtype, tol, grad_tol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 2e-2, 3e-2)])
def test_chunked_on_gpu_matches_fft(T, dtype, tol, grad_tol):
    """The carry kernel and the products on the GPU (D = R + d_h = 128, M = 64 as at every preset) against the fp32
    FFT contraction, output, final state and every gradient: fp32 (TF32-free products) and bf16 (16-bit operands)."""
    inputs = _gpu_case(dtype, T)
    y, s, grads = _run(s4d_contraction_chunked, inputs)
    ref = [inputs[0].float()] + inputs[1:]
    ry, rs, rgrads = _run(s4d_contraction, ref)
    assert_close(y, ry, tol, "y")
    assert_close(s, rs, tol, "final state")
    for name, a, r in zip(("dx", "ddecay", "db", "dc", "ds0"), grads, rgrads):
        assert_close(a, r, grad_tol, name)
