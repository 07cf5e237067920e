"""Interdomain Attention: the chunked torch path (CPU tensors, full readouts) and the readout C vs the naive
definition; GPU checks of the Triton kernels at the presets' shapes."""
import re

import pytest
import torch

from megahybrid_kernels import interdomain
from megahybrid_kernels.interdomain import (interdomain_attention, interdomain_readout, interdomain_recurrent,
                                 interdomain_step, uses_torch_path)
from megahybrid_kernels.interdomain.naive import interdomain_attention_naive
from tests.kernels.test_interdomain import BF16_GRAD_TOL, BF16_TOL, FP32_TOL, make_inputs, run_op
from tests.utils import assert_close, rel_rms_error, requires_gpu

NAMES = ["q", "k", "v", "decay", "b", "readout", "U0", "G0", "eta0"]


@pytest.fixture
def torch_path(monkeypatch):
    """CPU tensors take the torch path as they do outside the tests (conftest sets TRITON_INTERPRET=1); the
    Triton op must not run."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def refuse(*args):
        raise AssertionError("the Triton chunk op ran on the torch path")

    monkeypatch.setattr(interdomain.chunk, "interdomain_fwd", refuse)


def make_readout(H, M, normalize=False, seed=5, device="cpu"):
    """A random complex C [H, M, M, 2]; near the identity with `normalize`, so the denominator stays positive."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(H, M, M, 2, generator=gen) / M**0.5
    if normalize:
        c = 0.2 * c + torch.eye(M)[None, :, :, None] * torch.tensor([1.0, 0.0])
    return c.to(device)


def compare_readout(inputs, readout, tol, grad_tol=None, normalize=False, **kw):
    """Output, final state and every gradient (readout included) of the op against naive.py in fp32."""
    ordered = inputs[:5] + [readout] + inputs[5:]
    op = lambda *a, initial_state, **k: interdomain_attention(  # noqa: E731
        *a, initial_state=initial_state[1:] or None, readout=initial_state[0], **k, **kw)
    ref = lambda *a, initial_state, **k: interdomain_attention_naive(  # noqa: E731
        *a, initial_state=initial_state[1:] or None, readout=initial_state[0], **k)
    o, st, grads = run_op(op, ordered, normalize)
    ro, rst, rgrads = run_op(ref, [x.float() for x in ordered], normalize)
    errors = {"o": rel_rms_error(o, ro), **{f"d{n}": rel_rms_error(a, r) for n, a, r in zip(NAMES, grads, rgrads)}}
    print(" ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert_close(o, ro, tol, "o")
    assert len(st) == len(rst)
    for i, (a, r) in enumerate(zip(st, rst)):
        assert_close(a, r, tol, f"final state {i}")
    for n, a, r in zip(NAMES, grads, rgrads):
        assert_close(a, r, grad_tol or tol, f"d{n}")


@pytest.mark.parametrize("T,M,K,V,normalize,init", [
    (1, 8, 16, 24, False, True),
    (63, 1, 16, 24, False, True),  # normalized, one mode's |C|^2 cancels: dC would be rounding only
    (64, 32, 24, 16, False, False),
    (100, 8, 16, 24, True, False),
    (64, 64, 16, 8, True, True),
    (300, 16, 8, 12, False, True),
])
def test_readout_matches_naive(nan_empty, torch_path, T, M, K, V, normalize, init):
    """The full readout on the torch path: output, final state and every gradient incl. dC."""
    inputs = make_inputs(1, T, 2, K, V, M, normalize=normalize, init=init, device="cpu")
    compare_readout(inputs, make_readout(2, M, normalize), FP32_TOL, normalize=normalize)


@pytest.mark.parametrize("T,M,K,V,C,normalize,init", [
    (1, 8, 16, 32, 64, False, True),
    (63, 1, 16, 32, 64, True, True),
    (64, 8, 32, 16, 64, False, False),
    (100, 32, 16, 24, 32, True, False),
    (300, 64, 8, 12, 64, False, True),
])
def test_torch_path_matches_naive(nan_empty, torch_path, T, M, K, V, C, normalize, init):
    """readout=None on a CPU tensor: the torch path against naive.py, every gradient incl. the initial state."""
    from tests.kernels.test_interdomain import compare

    compare(make_inputs(2, T, 2, K, V, M, normalize=normalize, init=init, device="cpu"), FP32_TOL,
            normalize=normalize, chunk_size=C)


def test_torch_path_strong_decay(nan_empty, torch_path):
    """log|lambda| down to -33 beside |lambda| = 1 modes over full chunks: the lag tables hold only lam^n, n >= 0."""
    from tests.kernels.test_interdomain import compare

    inputs = make_inputs(1, 200, 2, 16, 32, 16, strong=True, seed=3, device="cpu")
    inputs[3][:, 1::4, 0] = 0.0
    compare(inputs, FP32_TOL)


@pytest.mark.parametrize("T,M,K,V,C,normalize", [
    (1, 8, 16, 24, 64, True),
    (63, 1, 16, 24, 64, False),
    (100, 32, 24, 16, 32, True),
    (300, 16, 16, 24, 64, False),
    (70, 64, 16, 8, 64, True),
])
def test_readout_kernels_match_naive(nan_empty, T, M, K, V, C, normalize):
    """The chunk kernels with the readout (interpreter, fp32: _fwd_mixed_kernel, _bwd_a_mixed_kernel, dP summed on
    the host): output, final state and every gradient incl. dC."""
    inputs = make_inputs(1, T, 2, K, V, M, normalize=normalize, device="cpu")
    compare_readout(inputs, make_readout(2, M, normalize), FP32_TOL, normalize=normalize, chunk_size=C)


def test_readout_kernels_mixing_in_fp32(nan_empty):
    """InterdomainPlan(mix_in_input_dtype=False), the mode mixing on fp32 operands, builds and computes the same in
    the interpreter (fp32 inputs: the default's cast is a no-op there; the GPU tests check both in bf16)."""
    inputs = make_inputs(1, 100, 2, 16, 24, 32, device="cpu")
    compare_readout(inputs, make_readout(2, 32), FP32_TOL, plan=interdomain.InterdomainPlan(mix_in_input_dtype=False))


def test_dispatch(monkeypatch):
    q, c = torch.zeros(1, 1, 1, 1), torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not uses_torch_path(q) and not uses_torch_path(q, readout=c)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert uses_torch_path(q) and uses_torch_path(q, readout=c)
    assert interdomain.DEFAULT_PLAN.readout_on_gpu
    if torch.cuda.is_available():
        assert not uses_torch_path(q.cuda()) and not uses_torch_path(q.cuda(), readout=c)
        assert uses_torch_path(q.cuda(), readout=c, normalize=True)
        assert uses_torch_path(q.cuda(), readout=c, plan=interdomain.InterdomainPlan(readout_on_gpu=False))


@pytest.mark.parametrize("normalize", [False, True])
def test_readout_split_equals_one_call(nan_empty, torch_path, normalize):
    """With a readout the state stays the unmixed U, Gamma, eta: T = a + b in two calls equals one call."""
    q, k, v, decay, b, *state = make_inputs(1, 150, 2, 16, 24, 8, normalize=normalize, device="cpu")
    c = make_readout(2, 8, normalize)
    o, st = interdomain_attention(q, k, v, decay, b, tuple(state), True, normalize, readout=c)
    o1, st1 = interdomain_attention(q[:, :70], k[:, :70], v[:, :70], decay, b, tuple(state), True, normalize,
                                    readout=c)
    o2, st2 = interdomain_attention(q[:, 70:], k[:, 70:], v[:, 70:], decay, b, st1, True, normalize, readout=c)
    assert_close(torch.cat((o1, o2), 1), o, FP32_TOL, "split output")
    for a, r in zip(st2, st):
        assert_close(a, r, FP32_TOL, "split final state")


@pytest.mark.parametrize("normalize,interpret", [(False, "0"), (True, "0"), (True, "1")])
def test_readout_decode_equals_chunk_op(nan_empty, monkeypatch, normalize, interpret):
    """A prompt through the chunk op, then interdomain_recurrent and single interdomain_step calls with the
    readout, equal one chunk-op call (on the torch path, and with the interpreter set)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v, decay, b, *state = make_inputs(2, 45, 2, 16, 24, 8, normalize=normalize, device="cpu")
    c = make_readout(2, 8, normalize)
    o, st = interdomain_attention(q, k, v, decay, b, tuple(state), True, normalize, readout=c)
    o1, st1 = interdomain_attention(q[:, :33], k[:, :33], v[:, :33], decay, b, tuple(state), True, normalize,
                                    readout=c)
    o2, st2 = interdomain_recurrent(q[:, 33:43], k[:, 33:43], v[:, 33:43], decay, b, st1, readout=c)
    steps = [o1, o2]
    for t in (43, 44):
        o_t, st2 = interdomain_step(q[:, t], k[:, t], v[:, t], decay, b, st2, readout=c)
        steps.append(o_t[:, None])
    assert_close(torch.cat(steps, 1), o, FP32_TOL, "prefill + decode output")
    for a, r in zip(st2, st):
        assert_close(a, r, FP32_TOL, "prefill + decode final state")


def test_decode_step_on_cpu(nan_empty, torch_path):
    """interdomain_step on a CPU tensor without the interpreter (torch path) equals naive."""
    q, k, v, decay, b, u0, g0 = make_inputs(3, 1, 2, 16, 24, 8, device="cpu")
    o, st = interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))
    ro, rst = interdomain_attention_naive(q, k, v, decay, b, (u0, g0), True)
    assert_close(o, ro[:, 0], FP32_TOL, "step output")
    for a, r in zip(st, rst):
        assert_close(a, r, FP32_TOL, "step state")


def readout_reference(coef, v, decay, b, readout, g0):
    """Token loop of interdomain_readout's definition: o_t = sum_m Re(coef_t conj(C Gamma_t))."""
    lam = torch.exp(torch.complex(decay[..., 0], decay[..., 1]))[None, :, :, None]
    bc = torch.complex(b[..., 0], b[..., 1])[None, :, :, None]
    c = torch.complex(readout[..., 0], readout[..., 1])
    g, outs = torch.complex(g0[..., 0, :], g0[..., 1, :]), []
    for t in range(v.shape[1]):
        g = lam * g + bc * v[:, t, :, None, :]
        gm = torch.einsum("hmn,bhnd->bhmd", c, g)
        a = torch.complex(coef[:, t, ..., 0], coef[:, t, ..., 1])[..., None]
        outs.append((a.real * gm.real + a.imag * gm.imag).sum(2))
    return torch.stack(outs, 1), torch.stack((g.real, g.imag), -2)


@pytest.mark.parametrize("T", [1, 100])
def test_interdomain_readout_matches_loop(nan_empty, T):
    """The value side alone with given coefficients (the S4D baseline's contraction): output, state, gradients."""
    _, _, v, decay, b, _, g0 = make_inputs(2, T, 2, 16, 24, 8, device="cpu")
    coef = torch.randn(2, T, 2, 8, 2, generator=torch.Generator().manual_seed(4))
    inputs = [coef, v, decay, b, make_readout(2, 8), g0]
    outs = []
    for fn in (lambda *a: interdomain_readout(*a, output_final_state=True), readout_reference):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o, st = fn(*xs)
        gen = torch.Generator().manual_seed(1)
        ((o * torch.randn(o.shape, generator=gen)).sum() + (st * torch.randn(st.shape, generator=gen)).sum()).backward()
        outs.append([o, st] + [x.grad for x in xs])
    for name, a, r in zip(["o", "G", "dcoef", "dv", "ddecay", "db", "dC", "dG0"], *outs):
        assert_close(a, r, FP32_TOL, name)


# the presets' shapes (125M: 12 heads, 1.3B: 32 heads, head dims 64, M = 64); the reference is the torch path in
# fp32 (checked against naive.py above), much faster than the token loop at T = 4096
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,H", [(1, 4096, 12), (1, 1000, 32)])
def test_presets_shapes_gpu(nan_empty, dtype, B, T, H):
    from megahybrid_kernels.interdomain import torch_chunk

    inputs = make_inputs(B, T, H, 64, 64, 64, dtype=dtype, device="cuda")
    o, st, grads = run_op(interdomain_attention, inputs, False)
    ref = [x.float() for x in inputs]
    ro, rst, rgrads = run_op(lambda *a, **kw: interdomain_torch_fp32(torch_chunk, *a, **kw), ref, False)
    tol, grad_tol = (FP32_TOL, FP32_TOL) if dtype == torch.float32 else (BF16_TOL, BF16_GRAD_TOL)
    assert_close(o, ro, tol, "o")
    for i, (a, r) in enumerate(zip(st, rst)):
        assert_close(a, r, tol, f"final state {i}")
    for n, a, r in zip(["q", "k", "v", "decay", "b", "U0", "G0"], grads, rgrads):
        assert_close(a, r, grad_tol, f"d{n}")


def interdomain_torch_fp32(torch_chunk, q, k, v, decay, b, initial_state, output_final_state, normalize):
    """The public op's call on the torch path (full fp32 matmuls: TF32 off)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        u0, g0 = (s.transpose(2, 3).contiguous() for s in initial_state)
        o, uf, gf = torch_chunk.interdomain_torch(q, k, v, decay, b, u0, g0)
        return o, (uf.transpose(2, 3), gf.transpose(2, 3))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.fixture(params=["torch", "kernels", "kernels-lowmix"])
def gpu_readout(request):
    """A plan sending a readout on the GPU through the torch path or the chunk kernels (plan.readout_on_gpu, on
    by default), the latter with the mode mixing in fp32 and in the inputs' dtype (plan.mix_in_input_dtype, the
    default)."""
    return interdomain.InterdomainPlan(readout_on_gpu=request.param != "torch",
                                       mix_in_input_dtype=request.param == "kernels-lowmix")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T,M,normalize", [(300, 32, False), (100, 32, True), (1000, 64, False)])
def test_readout_gpu_bf16(nan_empty, gpu_readout, T, M, normalize):
    """The readout on the GPU, bf16 inputs, against naive.py in fp32."""
    inputs = make_inputs(2, T, 3, 64, 64, M, dtype=torch.bfloat16, normalize=normalize, device="cuda")
    compare_readout(inputs, make_readout(3, M, normalize, device="cuda"), BF16_TOL, BF16_GRAD_TOL,
                    normalize=normalize, plan=gpu_readout)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T,M", [(300, 32), (200, 64)])
def test_readout_gpu_fp32(nan_empty, gpu_readout, T, M):
    inputs = make_inputs(2, T, 3, 64, 64, M, device="cuda")
    compare_readout(inputs, make_readout(3, M, device="cuda"), FP32_TOL, plan=gpu_readout)


@pytest.mark.parametrize("path", ["torch", "interpreter"])
def test_decay_check_sees_writes_through_data(monkeypatch, path):
    """Issue 21 case 12: a write through decay.data (no version bump) after a checked call is refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "0" if path == "torch" else "1")
    q, k, v, decay, b, u0, g0 = make_inputs(1, 1, 2, 16, 16, 4, device="cpu")
    interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))
    version = decay._version
    decay.data[0, 0, 0] = 0.5
    assert decay._version == version
    with pytest.raises(ValueError, match=re.escape("log|lambda| must be <= 0")):
        interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))


@pytest.mark.gpu
@requires_gpu
def test_decay_check_sees_writes_through_data_gpu():
    """On the GPU the cached tensor's check runs on the device without a sync; a later call raises."""
    q, k, v, decay, b, u0, g0 = make_inputs(1, 1, 2, 16, 16, 4, device="cuda")
    interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))
    decay.data[0, 0, 0] = 0.5
    with pytest.raises(ValueError, match=re.escape("log|lambda| must be <= 0")):
        for _ in range(4):
            interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))
            torch.cuda.synchronize()
    decay.data[0, 0, 0] = -0.5
    for _ in range(3):
        interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))
        torch.cuda.synchronize()


@pytest.mark.parametrize("T,M,K,V,normalize,init", [
    (1, 8, 16, 24, False, True),
    (5, 1, 20, 40, True, False),
    (63, 32, 16, 24, True, True),
    (30, 64, 16, 8, False, True),
])
def test_fused_recurrent_readout_matches_naive(nan_empty, T, M, K, V, normalize, init):
    """The fused recurrent kernel (interpreter) with a readout: a P per token, padded modes masked."""
    q, k, v, decay, b, *state = make_inputs(2, T, 2, K, V, M, normalize=normalize, init=init, device="cpu")
    c = make_readout(2, M, normalize)
    o, st = interdomain_recurrent(q, k, v, decay, b, tuple(state) or None, normalize, readout=c)
    ro, rst = interdomain_attention_naive(q, k, v, decay, b, tuple(state) or None, True, normalize, readout=c)
    print(f"o={rel_rms_error(o, ro):.2e}")
    assert_close(o, ro, FP32_TOL, "recurrent o")
    for i, (a, r) in enumerate(zip(st, rst)):
        assert_close(a, r, FP32_TOL, f"recurrent final state {i}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("B,T,M", [(8, 1, 64), (2, 100, 32)])
def test_fused_recurrent_readout_gpu_bf16(nan_empty, B, T, M):
    """The fused decode kernel with a readout on the GPU (P in registers) against naive.py in fp32."""
    q, k, v, decay, b, *state = make_inputs(B, T, 3, 64, 64, M, dtype=torch.bfloat16, device="cuda")
    c = make_readout(3, M, device="cuda")
    o, st = interdomain_recurrent(q, k, v, decay, b, tuple(state), readout=c)
    ref = [x.float() for x in (q, k, v)]
    ro, rst = interdomain_attention_naive(*ref, decay, b, tuple(state), True, readout=c)
    assert_close(o, ro, BF16_TOL, "recurrent o")
    for i, (a, r) in enumerate(zip(st, rst)):
        assert_close(a, r, 1e-3, f"recurrent final state {i}")
