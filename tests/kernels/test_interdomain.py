"""Interdomain Attention: Triton chunk kernels vs the fp32 naive definition (CPU: interpreter, fp32)."""
import dataclasses
import re

import pytest
import torch

from megahybrid_kernels.interdomain import (DEFAULT_PLAN, InterdomainPlan, interdomain_attention, interdomain_recurrent,
                                 interdomain_step)
from megahybrid_kernels.interdomain.naive import interdomain_attention_naive
from tests.utils import assert_close, rel_rms_error, requires_gpu, test_device

DEV = test_device()
# fp32 inputs run tl.dot in IEEE fp32 (interpreter) or 3xTF32 (GPU); bf16 runs bf16 tensor-core dots with fp32 states
FP32_TOL = 1e-4
BF16_TOL = 2e-2
BF16_GRAD_TOL = 4e-2


def make_inputs(B, T, H, K, V, M, dtype=torch.float32, normalize=False, init=True, strong=False, seed=0,
                device=DEV):
    """Random q, k, v, decay, b and an initial state; `normalize` keeps the denominator away from 0."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    uni = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    if normalize:
        q, k, v = uni(B, T, H, K), uni(B, T, H, K) / K, rnd(B, T, H, V)
        decay = torch.stack((-0.3 * uni(H, M) - 0.01, 0.3 * uni(H, M)), -1)
        b = torch.stack((1 + uni(H, M), 0.1 * rnd(H, M)), -1)
    else:
        q, k, v = rnd(B, T, H, K), rnd(B, T, H, K) / K**0.5, rnd(B, T, H, V)
        decay = torch.stack((-uni(H, M) ** 2, 3.1 * uni(H, M)), -1)
        b = rnd(H, M, 2) / M**0.5
    if strong:
        decay[:, ::2, 0] = -30.0 * uni(H, (M + 1) // 2) - 3.0
    state = None
    if init:
        state = (0.3 * rnd(B, H, M, 2, K), 0.3 * rnd(B, H, M, 2, V))
        if normalize:
            state = state + (torch.stack((1 + uni(B, H, M), 0.1 * rnd(B, H, M)), -1),)
    xs = [q.to(dtype), k.to(dtype), v.to(dtype), decay, b] + list(state or ())
    return [x.to(device) for x in xs]


def run_op(fn, inputs, normalize, seed=1, **kw):
    """Output, final state and the gradients of a random linear function of both, for every input."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    state = tuple(xs[5:]) or None
    o, st = fn(*xs[:5], initial_state=state, output_final_state=True, normalize=normalize, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
    for s in st:
        loss = loss + (s * torch.randn(s.shape, generator=gen).to(s.device)).sum()
    loss.backward()
    return o, st, [x.grad for x in xs]


def compare(inputs, tol, grad_tol=None, normalize=False, **kw):
    o, st, grads = run_op(interdomain_attention, inputs, normalize, **kw)
    ref = [x.float() for x in inputs]
    ro, rst, rgrads = run_op(interdomain_attention_naive, ref, normalize)
    names = ["q", "k", "v", "decay", "b", "U0", "G0", "eta0"][: len(inputs)]
    errors = {"o": rel_rms_error(o, ro)}
    errors.update({f"state{i}": rel_rms_error(a, r) for i, (a, r) in enumerate(zip(st, rst))})
    errors.update({f"d{n}": rel_rms_error(a, r) for n, a, r in zip(names, grads, rgrads)})
    print(" ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert_close(o, ro, tol, "o")
    for i, (a, r) in enumerate(zip(st, rst)):
        assert_close(a, r, tol, f"final state {i}")
    for n, a, r in zip(names, grads, rgrads):
        assert_close(a, r, grad_tol or tol, f"d{n}")
    return errors


@pytest.mark.parametrize("T,M,K,V,C,normalize,init", [
    (1, 8, 16, 32, 64, False, True),
    (63, 1, 16, 32, 64, False, True),
    (64, 8, 32, 16, 64, True, True),
    (100, 32, 16, 32, 32, False, False),
    (100, 8, 16, 32, 16, True, False),
    (300, 8, 16, 32, 64, False, True),
    (150, 64, 32, 16, 128, True, True),
])
def test_chunk_matches_naive_cpu(nan_empty, T, M, K, V, C, normalize, init):
    inputs = make_inputs(1, T, 2, K, V, M, normalize=normalize, init=init)
    compare(inputs, FP32_TOL, normalize=normalize, chunk_size=C)


def test_strong_decay_is_exact(nan_empty):
    """log|lambda| down to -33: intra-chunk decays (lag tables lam^n, n >= 0) must not overflow or lose the
    diagonal."""
    inputs = make_inputs(2, 70, 1, 16, 16, 8, strong=True)
    compare(inputs, FP32_TOL, chunk_size=32)


def test_strong_decay_full_chunk(nan_empty):
    """Strong and |lambda| = 1 modes side by side over full 64-token chunks (lags up to 63 in one product)."""
    inputs = make_inputs(1, 200, 2, 16, 32, 16, strong=True, seed=3)
    inputs[3][:, 1::4, 0] = 0.0
    compare(inputs, FP32_TOL, chunk_size=64)


@pytest.mark.parametrize("normalize", [False, True])
def test_split_equals_one_call(nan_empty, normalize):
    """T = a + b in two calls with the state carried equals one call of T (context parallelism, decoding)."""
    q, k, v, decay, b, *state = make_inputs(1, 90, 2, 16, 32, 8, normalize=normalize)
    o, st = interdomain_attention(q, k, v, decay, b, tuple(state), True, normalize)
    o1, st1 = interdomain_attention(q[:, :37], k[:, :37], v[:, :37], decay, b, tuple(state), True, normalize)
    o2, st2 = interdomain_attention(q[:, 37:], k[:, 37:], v[:, 37:], decay, b, st1, True, normalize)
    assert_close(torch.cat((o1, o2), 1), o, FP32_TOL, "split output")
    for a, r in zip(st2, st):
        assert_close(a, r, FP32_TOL, "split final state")


@pytest.mark.parametrize("normalize", [False, True])
def test_step_repeated_equals_chunk(normalize):
    q, k, v, decay, b, *state = make_inputs(2, 21, 2, 16, 8, 4, normalize=normalize)
    o, st = interdomain_attention(q, k, v, decay, b, tuple(state), True, normalize)
    ro, rst = interdomain_recurrent(q, k, v, decay, b, tuple(state))
    assert_close(ro, o, FP32_TOL, "recurrent output")
    for a, r in zip(rst, st):
        assert_close(a, r, FP32_TOL, "recurrent final state")
    o1, _ = interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, tuple(state))
    assert_close(o1, o[:, 0], FP32_TOL, "one step")


@pytest.fixture(params=[True, False], ids=["all-hoisted", "none-hoisted"])
def scan_hoist(request):
    """A plan with both scan loops for both scan kinds (the default hoists every scan)."""
    return InterdomainPlan(hoist_const=request.param, hoist_per_token=request.param)


@pytest.mark.parametrize("T,C,init", [(63, 64, True), (64, 64, False), (100, 32, True), (300, 64, True)])
def test_scan_loops_match_naive(nan_empty, scan_hoist, T, C, init):
    """Hoisted full-chunk tables and the plain loop: no full chunk, only full chunks, a partial one."""
    inputs = make_inputs(1, T, 2, 16, 24, 8, init=init, strong=T == 300)
    compare(inputs, FP32_TOL, chunk_size=C, plan=scan_hoist)


@pytest.fixture(params=[True, False], ids=["hoisted-kept", "plain-rescan"])
def segmented(request):
    """A plan with every scan in segments of two chunks (the GPU cuts only long sequences, in segments of 32), its
    backward taking the forward's kept states (plan.keep_states) or rescanning from the segment starts."""
    return InterdomainPlan(scan_segment=2, scan_segment_below=1 << 30, scan_segment_above=0,
                           hoist_const=request.param, hoist_per_token=request.param, keep_states=request.param)


@pytest.mark.parametrize("T,C,init,normalize,strong", [
    (300, 32, True, False, False),  # 5 segments, the last one ending in a partial chunk
    (300, 64, True, True, True),  # the last segment is only the partial chunk
    (128, 32, False, False, False),  # 2 segments, full chunks only
    (64, 64, True, False, False),  # one chunk: one segment
])
def test_segmented_scans_match_naive(nan_empty, segmented, T, C, init, normalize, strong):
    """Output, final state and every gradient (the reverse scans segmented too) with the state carried across
    segments by _carry_kernel, and the backward taking the forward's states or recomputing them from its segment
    starts."""
    inputs = make_inputs(1, T, 2, 16, 24, 8, init=init, normalize=normalize, strong=strong)
    compare(inputs, FP32_TOL, chunk_size=C, normalize=normalize, plan=segmented)


@pytest.fixture(params=["plain", "stacked"])
def fwd_form(request):
    """A plan with the forward kernel in one form at every mode tile (plan.fwd_stack_below otherwise picks by
    tile width)."""
    return InterdomainPlan(fwd_stack_below=1 << 20 if request.param == "stacked" else 0)


@pytest.mark.parametrize("T,M,normalize", [(100, 8, True), (300, 32, False), (64, 24, False), (70, 64, False)])
def test_fwd_forms_match_naive(nan_empty, fwd_form, T, M, normalize):
    """The forward with its mode products plain or on stacked real / imaginary operands, also with padded modes
    (M = 24 in a 32-mode tile)."""
    compare(make_inputs(1, T, 2, 16, 24, M, normalize=normalize), FP32_TOL, normalize=normalize, plan=fwd_form)


def test_scan_from_segment_starts(segmented):
    """A scan given an earlier scan's segment starts (the backward's recomputation) stores the same states; starts
    of another segmentation are refused."""
    from megahybrid_kernels.interdomain.scan import powers, scan

    q, k, v, decay, b, u0, _ = make_inputs(2, 300, 2, 16, 24, 8)
    pw = powers(decay, 32)
    x0 = u0.transpose(2, 3).contiguous()
    xb, last, starts = scan(k, b, pw, decay, 32, x0=x0, plan=segmented)
    assert starts is not None and last is not None
    again, none, same = scan(k, b, pw, decay, 32, x0=x0, starts=starts, plan=segmented)
    assert none is None and same is starts
    assert torch.equal(again, xb)
    with pytest.raises(RuntimeError, match="do not fit"):
        scan(k, b, pw, decay, 32, x0=x0, starts=starts[:, :, :2], plan=segmented)


def _bad(**over):
    q, k, v, decay, b, u0, g0 = make_inputs(1, 8, 2, 16, 16, 4, device="cpu")
    args = dict(q=q, k=k, v=v, decay=decay, b=b, initial_state=(u0, g0), chunk_size=64)
    args.update(over)
    return args


@pytest.mark.parametrize("over,msg", [
    (dict(k=torch.randn(1, 8, 2, 8)), "q and k must both be [B, T, H, K]"),
    (dict(v=torch.randn(1, 7, 2, 16)), "v must be [B, T, H, V]"),
    (dict(v=torch.randn(1, 8, 2, 16, dtype=torch.float64)), "must share one dtype"),
    (dict(decay=torch.zeros(3, 4, 2)), "decay must be fp32 [H=2, M, 2]"),
    (dict(b=torch.zeros(2, 5, 2)), "decay and b must share M"),
    (dict(decay=torch.full((2, 4, 2), 0.1)), "log|lambda| must be <= 0"),
    (dict(chunk_size=48), "chunk_size must be 16, 32, 64 or 128"),
    (dict(initial_state=(torch.zeros(1, 2, 4, 2, 16),)), "initial_state must be a tuple of 2 tensors"),
    (dict(initial_state=(torch.zeros(1, 2, 4, 2, 16), torch.zeros(1, 2, 4, 16))), "initial_state tensors must be"),
])
def test_bad_inputs(over, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        interdomain_attention(**_bad(**over))


# GPU cases share K, V and M with each other and with the benchmark so that few kernel variants compile
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T,normalize", [(300, False), (64, True)])
def test_chunk_matches_naive_gpu_fp32(nan_empty, T, normalize):
    inputs = make_inputs(2, T, 3, 64, 95 if normalize else 96, 32, normalize=normalize)
    compare(inputs, FP32_TOL, normalize=normalize)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T,M,normalize", [(300, 32, False), (100, 32, True), (1000, 64, False)])
def test_chunk_matches_naive_gpu_bf16(nan_empty, T, M, normalize):
    inputs = make_inputs(2, T, 3, 128, 127 if normalize else 128, M, dtype=torch.bfloat16, normalize=normalize)
    compare(inputs, BF16_TOL, BF16_GRAD_TOL, normalize=normalize)


@pytest.mark.gpu
@requires_gpu
def test_small_head_dims_gpu_bf16(nan_empty):
    """K, V below one 64-wide feature tile and M = 16: the GPU pads both tiles (readout.tiles)."""
    compare(make_inputs(2, 100, 3, 32, 48, 16, dtype=torch.bfloat16), BF16_TOL, BF16_GRAD_TOL)


@pytest.mark.gpu
@requires_gpu
def test_strong_decay_gpu_bf16(nan_empty):
    inputs = make_inputs(2, 200, 2, 128, 128, 32, dtype=torch.bfloat16, strong=True)
    compare(inputs, BF16_TOL, BF16_GRAD_TOL)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T,M", [(300, 32), (1000, 64)])
def test_hoisted_scan_gpu_bf16(nan_empty, scan_hoist, T, M):
    compare(make_inputs(2, T, 3, 128, 128, M, dtype=torch.bfloat16), BF16_TOL, BF16_GRAD_TOL, plan=scan_hoist)


@pytest.mark.gpu
@requires_gpu
def test_stacked_forward_at_64_modes_gpu_bf16(nan_empty):
    """The stacked forward at a 64-mode tile (by default it runs at 32 and the plain one at 64: fwd_stack_below)."""
    compare(make_inputs(2, 1000, 3, 128, 128, 64, dtype=torch.bfloat16), BF16_TOL, BF16_GRAD_TOL,
            plan=InterdomainPlan(fwd_stack_below=128))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("keep_states", [True, False], ids=["kept", "rescan"])
def test_segmented_scans_gpu_bf16(nan_empty, keep_states):
    """The long-sequence scan path (segments of 32 chunks, few rows) at T = 4200: 3 segments, a partial chunk."""
    assert DEFAULT_PLAN.scan_segment == 32
    # 66 chunks: segmented like a long sequence
    plan = dataclasses.replace(DEFAULT_PLAN, scan_segment_above=32, keep_states=keep_states)
    inputs = make_inputs(1, 4200, 2, 128, 128, 32, dtype=torch.bfloat16, init=True)
    compare(inputs, BF16_TOL, BF16_GRAD_TOL, plan=plan)


# Fused recurrent kernel (recurrent.py): forward only, decoding and short prompts
def compare_recurrent(inputs, normalize, tol, state_tol=FP32_TOL):
    q, k, v, decay, b, *state = inputs
    o, st = interdomain_recurrent(q, k, v, decay, b, tuple(state) or None, normalize=normalize)
    ref = [x.float() for x in inputs]
    ro, rst = interdomain_attention_naive(*ref[:5], tuple(ref[5:]) or None, True, normalize)
    print(f"o={rel_rms_error(o, ro):.2e} " + " ".join(f"state{i}={rel_rms_error(a, r):.2e}"
                                                    for i, (a, r) in enumerate(zip(st, rst))))
    assert o.dtype == v.dtype and len(st) == len(rst)
    assert_close(o, ro, tol, "recurrent o")
    for i, (a, r) in enumerate(zip(st, rst)):
        assert_close(a, r, state_tol, f"recurrent final state {i}")


@pytest.mark.parametrize("T,M,K,V,normalize,init", [
    (1, 8, 16, 32, False, True),
    (1, 32, 16, 24, True, True),
    (5, 32, 32, 16, True, False),
    (5, 1, 20, 40, False, False),
    (63, 1, 16, 32, True, True),
    (63, 32, 16, 24, False, True),
    (100, 8, 20, 40, False, True),
    (100, 8, 32, 16, True, False),
])
def test_fused_recurrent_matches_naive(nan_empty, T, M, K, V, normalize, init):
    """K != V, K and V not powers of two (masked tiles), several V tiles per head."""
    compare_recurrent(make_inputs(1, T, 2, K, V, M, normalize=normalize, init=init), normalize, FP32_TOL)


@pytest.mark.parametrize("normalize", [False, True])
def test_prefill_then_decode_equals_one_call(nan_empty, normalize):
    """Chunk op over a prompt, then the fused kernel for a short continuation and single steps = one chunk call."""
    q, k, v, decay, b, *state = make_inputs(1, 45, 2, 16, 24, 8, normalize=normalize)
    o, st = interdomain_attention(q, k, v, decay, b, tuple(state), True, normalize)
    o1, st1 = interdomain_attention(q[:, :33], k[:, :33], v[:, :33], decay, b, tuple(state), True, normalize)
    o2, st2 = interdomain_recurrent(q[:, 33:43], k[:, 33:43], v[:, 33:43], decay, b, st1)
    steps = []
    for t in (43, 44):
        o_t, st2 = interdomain_step(q[:, t], k[:, t], v[:, t], decay, b, st2)
        steps.append(o_t[:, None])
    assert_close(torch.cat([o1, o2] + steps, 1), o, FP32_TOL, "prefill + decode output")
    for a, r in zip(st2, st):
        assert_close(a, r, FP32_TOL, "prefill + decode final state")


def test_fused_recurrent_grad_goes_to_chunk_op():
    """Inputs that need grad under grad mode are routed to the differentiable chunk op; gradients match naive."""
    inputs = make_inputs(1, 6, 2, 16, 8, 4)
    o, st, grads = run_op(lambda *a, initial_state, output_final_state, normalize:
                          interdomain_recurrent(*a, initial_state, normalize), inputs, False)
    ro, rst, rgrads = run_op(interdomain_attention_naive, inputs, False)
    assert o.grad_fn is not None
    for n, a, r in zip(["q", "k", "v", "decay", "b", "U0", "G0"], grads, rgrads):
        assert_close(a, r, FP32_TOL, f"routed d{n}")


def test_decay_check_sees_in_place_change():
    """The decay check is skipped for a tensor already checked, unless it was modified in place since."""
    q, k, v, decay, b, u0, g0 = make_inputs(1, 1, 2, 16, 16, 4)
    interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))
    decay[0, 0, 0] = 0.5
    with pytest.raises(ValueError, match=re.escape("log|lambda| must be <= 0")):
        interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0))


def test_step_bad_inputs():
    q, k, v, decay, b, u0, g0 = make_inputs(1, 1, 2, 16, 16, 4, device="cpu")
    with pytest.raises(ValueError, match=re.escape("interdomain_step takes one token")):
        interdomain_step(q, k, v, decay, b, (u0, g0))
    with pytest.raises(ValueError, match=re.escape("initial_state tensors must be")):
        interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, (u0, g0[..., :8]))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("B,T,normalize", [(8, 1, False), (2, 300, False), (2, 100, True)])
def test_fused_recurrent_matches_naive_gpu_bf16(nan_empty, B, T, normalize):
    inputs = make_inputs(B, T, 3, 128, 127 if normalize else 128, 32, dtype=torch.bfloat16, normalize=normalize)
    compare_recurrent(inputs, normalize, BF16_TOL, state_tol=1e-3)
