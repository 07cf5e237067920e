"""The chunked S4D contraction and its decode step against the defining token loop (fp32, CPU or GPU)."""
import pytest
import torch

from megahybrid_kernels.interdomain.s4d import s4d_contraction, s4d_contraction_naive, s4d_contraction_step
from tests.utils import assert_close, test_device

TOL = 1e-5  # fp32 relative RMS error; the chunked path only reorders sums


def _inputs(B=2, T=37, H=3, M=5, D=6, seed=0, state=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=g)
    decay = torch.stack((-torch.rand(H, M, generator=g) * 0.3 - 1e-3, torch.randn(H, M, generator=g)), -1)
    b = torch.randn(H, M, 2, generator=g)
    c = torch.randn(H, M, D, 2, generator=g)
    s0 = torch.randn(B, H, M, 2, D, generator=g) if state else None
    dev = test_device()
    return [t.to(dev) if t is not None else None for t in (x, decay, b, c, s0)]


@pytest.mark.parametrize("T, chunk, state", [(37, 16, True), (64, 32, False), (5, 64, True)])
def test_chunked_matches_naive_with_grads(T, chunk, state):
    x, decay, b, c, s0 = _inputs(T=T, state=state)
    leaves = [t.requires_grad_() for t in (x, decay, b, c) + ((s0,) if state else ())]
    outs = {}
    for name, fn in (("naive", s4d_contraction_naive), ("chunk", s4d_contraction)):
        kwargs = {"chunk_size": chunk} if name == "chunk" else {}
        y, sf = fn(x, decay, b, c, s0, True, **kwargs)
        grads = torch.autograd.grad((y * y.detach().sin()).sum() + (sf * sf.detach().cos()).sum(), leaves)
        outs[name] = (y, sf, grads)
    (y_r, s_r, g_r), (y_c, s_c, g_c) = outs["naive"], outs["chunk"]
    assert_close(y_c, y_r, TOL, "y")
    assert_close(s_c, s_r, TOL, "final state")
    for i, (a, e) in enumerate(zip(g_c, g_r)):
        assert_close(a, e, 1e-4, f"grad {i}")


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
