"""Chunk-selected Gated DeltaNet: Triton kernels vs the fp32 naive definition (CPU: interpreter, fp32)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megahybrid_kernels.nats import chunk_selected_gdn, chunk_selected_gdn_step
from megahybrid_kernels.nats.gdn import chunk as gdn_chunk
from megahybrid_kernels.nats.gdn import naive_chunk_selected_gdn
from tests.utils import (HAS_CUDA, assert_close, nan_poisoned_empty, rel_rms_error, requires_gpu,
                         subprocess_pythonpath, test_device)

DEV = test_device()
# fp32 on a GPU runs tl.dot in tf32; in the interpreter it is exact fp32
FP32_TOL = 1e-2 if HAS_CUDA else 1e-4
NAMES = ["q", "k", "v", "g", "beta", "keep", "h0"]


def make_inputs(B, T, H, K, V, dtype=torch.float32, keep_p=0.5, seed=0, device=DEV, g_scale=None):
    """g_scale=None: weak decays (about -0.05 per token); a number: the layer's gates, -A * softplus(x) with A up
    to g_scale, so a chunk's summed log decay goes far below -88 (where e^{-G} overflows fp32)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    NT = math.ceil(T / 64)
    q = F.normalize(rnd(B, T, H, K), dim=-1)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    g = F.logsigmoid(rnd(B, T, H) + 3.0)
    if g_scale is not None:
        g = -torch.rand(1, 1, H, generator=gen) * g_scale * F.softplus(rnd(B, T, H))
    beta = torch.rand(B, T, H, generator=gen)
    keep = (torch.rand(B, H, NT, generator=gen) < keep_p).float()
    h0 = 0.5 * rnd(B, H, K, V)
    xs = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), keep, h0]
    return [x.to(device) for x in xs]


def run_op(fn, inputs, do, dht, **kw):
    """Output, final state and the gradients of sum(o * do) + sum(ht * dht) for every input."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    o, ht = fn(*xs[:6], initial_state=xs[6], **kw)
    ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
    return o, ht, [x.grad for x in xs]


def errors_vs_naive(inputs, **kw):
    """Relative RMS errors of the op's output, final state and every gradient against the fp32 naive reference."""
    B, T, H, K = inputs[0].shape
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, inputs[2].shape[-1], generator=gen).to(inputs[0].device)
    dht = torch.randn(B, H, K, inputs[2].shape[-1], generator=gen).to(inputs[0].device)
    o, ht, grads = run_op(chunk_selected_gdn, inputs, do, dht, output_final_state=True, **kw)
    ref_inputs = [x.float() for x in inputs]
    ro, rht, rgrads = run_op(naive_chunk_selected_gdn, ref_inputs, do, dht, **kw)
    errors = {"o": rel_rms_error(o, ro), "ht": rel_rms_error(ht, rht)}
    errors.update({f"d{n}": rel_rms_error(a, b) for n, a, b in zip(NAMES, grads, rgrads)})
    return errors, (o, ht, grads), (ro, rht, rgrads)


def compare(inputs, tol, grad_tol=None, **kw):
    errors, (o, ht, grads), (ro, rht, rgrads) = errors_vs_naive(inputs, **kw)
    print(" ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert_close(o, ro, tol, "o")
    assert_close(ht, rht, tol, "final state")
    for n, a, b in zip(NAMES, grads, rgrads):
        assert_close(a, b, grad_tol or tol, f"d{n}")
    return errors


@pytest.mark.parametrize("decay_dropped", [True, False])
@pytest.mark.parametrize("T", [63, 64, 100, 300])
def test_kernels_match_naive(T, decay_dropped, nan_empty):
    compare(make_inputs(1, T, 2, 32, 16, seed=T), FP32_TOL, decay_dropped=decay_dropped)


@pytest.mark.parametrize("T", [100, 200])
def test_strong_decays_stay_finite(T, nan_empty):
    """The N/G layers' gates: a chunk's decay e^{G} underflows to 0 while e^{-G_t} would overflow."""
    inputs = make_inputs(1, T, 2, 32, 16, seed=T, g_scale=16.0)
    assert inputs[3][0, :64].sum(0).max() < -88
    compare(inputs, FP32_TOL)


def test_odd_head_sizes_and_batch(nan_empty):
    compare(make_inputs(2, 100, 2, 40, 48, seed=3), FP32_TOL)


@pytest.mark.parametrize("K,V", [(64, 16), (192, 24)])
def test_head_dims_64_and_192(K, V, nan_empty):
    """The head sizes of issue 14 (K = 64 faulted on the GPU; K = 192 is the 760M preset), a partial chunk."""
    compare(make_inputs(1, 70, 1, K, V, seed=K), FP32_TOL, decay_dropped=K == 64)


def test_gpu_state_tile_padding_in_interpreter(nan_empty, monkeypatch):
    """The GPU's state tile for K = 64 (128 rows, the upper half masked) gives the same result."""
    monkeypatch.setattr(gdn_chunk, "_state_bk", lambda K, device: max(128, gdn_chunk.next_pow2(K)))
    compare(make_inputs(1, 70, 1, 64, 16, seed=13), FP32_TOL)


def test_dkeep_for_dropped_chunks_option(nan_empty):
    inputs = make_inputs(1, 200, 2, 32, 16, seed=5)
    assert (inputs[5] == 0).any() and (inputs[5] == 1).any()
    compare(inputs, FP32_TOL, dkeep_dropped=True, decay_dropped=False)


def test_dkeep_is_zero_where_dropped_by_default(nan_empty):
    inputs = make_inputs(1, 200, 2, 32, 16, seed=6)
    keep = inputs[5].clone().requires_grad_()
    o, _ = chunk_selected_gdn(*inputs[:5], keep, initial_state=inputs[6])
    o.sum().backward()
    assert (keep.grad[keep == 0] == 0).all() and (keep.grad[keep == 1] != 0).all()


def plain_gdn(q, k, v, g, beta, scale, h0):
    """Independent Gated DeltaNet: S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T."""
    S, outs = h0.float().clone(), []
    eye = torch.eye(q.shape[-1], device=q.device)
    for t in range(q.shape[1]):
        kt, bt = k[:, t].float(), beta[:, t].float()[..., None, None]
        P = eye - bt * kt[..., :, None] * kt[..., None, :]
        S = g[:, t].float().exp()[..., None, None] * (P @ S) + bt * kt[..., :, None] * v[:, t].float()[..., None, :]
        outs.append(scale * (q[:, t].float()[..., None, :] @ S)[..., 0, :])
    return torch.stack(outs, 1), S


def test_keep_all_equals_plain_gdn(nan_empty):
    q, k, v, g, beta, _, h0 = make_inputs(1, 150, 2, 32, 16, seed=7)
    keep = torch.ones(1, 2, 3, device=DEV)
    o, ht = chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=h0, output_final_state=True)
    ro, rht = plain_gdn(q, k, v, g, beta, 32 ** -0.5, h0)
    assert_close(o, ro, FP32_TOL, "o")
    assert_close(ht, rht, FP32_TOL, "final state")


@pytest.mark.parametrize("decay_dropped", [True, False])
def test_keep_none_rolls_back_to_initial_state(decay_dropped, nan_empty):
    q, k, v, g, beta, _, h0 = make_inputs(1, 130, 2, 32, 16, seed=8)
    keep = torch.zeros(1, 2, 3, device=DEV)
    _, ht = chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=h0, output_final_state=True,
                               decay_dropped=decay_dropped)
    expected = h0 * g.sum(1).exp()[..., None, None] if decay_dropped else h0
    assert_close(ht, expected, FP32_TOL, "rolled-back state")


def test_split_at_chunk_boundary_equals_one_call(nan_empty):
    q, k, v, g, beta, keep, h0 = make_inputs(1, 228, 2, 32, 16, seed=9)
    o, ht = chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=h0, output_final_state=True)
    s = 128
    o1, h1 = chunk_selected_gdn(q[:, :s], k[:, :s], v[:, :s], g[:, :s], beta[:, :s], keep[..., :2],
                                initial_state=h0, output_final_state=True)
    o2, h2 = chunk_selected_gdn(q[:, s:], k[:, s:], v[:, s:], g[:, s:], beta[:, s:], keep[..., 2:],
                                initial_state=h1, output_final_state=True)
    assert_close(torch.cat([o1, o2], 1), o, FP32_TOL, "o")
    assert_close(h2, ht, FP32_TOL, "final state")


@pytest.mark.parametrize("decay_dropped", [True, False])
def test_decode_steps_equal_chunk_op(decay_dropped, nan_empty):
    q, k, v, g, beta, keep, h0 = make_inputs(1, 100, 2, 32, 16, seed=10)
    o, ht = chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=h0, output_final_state=True,
                               decay_dropped=decay_dropped)
    state, rollback, outs = h0.clone(), h0.clone(), []
    for t in range(100):
        last = t % 64 == 63 or t == 99
        o_t, state, rollback = chunk_selected_gdn_step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, rollback,
            keep=keep[..., t // 64] if last else None, decay_dropped=decay_dropped)
        outs.append(o_t)
    assert_close(torch.stack(outs, 1), o, FP32_TOL, "o")
    assert_close(state, ht, FP32_TOL, "final state")


def test_qk_l2norm_option(nan_empty):
    inputs = make_inputs(1, 70, 2, 32, 16, seed=11)
    raw = [3.0 * inputs[0], 0.5 * inputs[1]] + inputs[2:]
    o, _ = chunk_selected_gdn(*raw[:6], initial_state=raw[6], use_qk_l2norm=True)
    ro, _ = naive_chunk_selected_gdn(*inputs[:6], initial_state=inputs[6])
    assert_close(o, ro, FP32_TOL, "o")


BAD = [
    ("keep", lambda x: x[:, :, :1], "keep must be [B, H, ceil(T/64)]"),
    ("g", lambda x: x[..., :1], "g and beta must be [B, T, H]"),
    ("v", lambda x: x[:, :-1], "v must be [B, T, H, V]"),
    ("k", lambda x: x[..., :-1], "q and k must both be [B, T, H, K]"),
    ("h0", lambda x: x[..., :-1], "initial_state must be [B, H, K, V]"),
    ("q", lambda x: x.double(), "q, k, v must share one float dtype"),
    ("keep", lambda x: x * 0.5, "keep must hold only 0 and 1"),
    ("keep", lambda x: x + 1, "keep must hold only 0 and 1"),
    ("g", lambda x: x.abs() + 0.1, "g must be <= 0"),
]


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("name,mutate,message", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_inputs(name, mutate, message, interpret, monkeypatch):
    """Refused with one line on either CPU path (Triton interpreter, torch)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    inputs = dict(zip(NAMES, make_inputs(1, 70, 2, 16, 16, device="cpu")))
    inputs[name] = mutate(inputs[name])
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        chunk_selected_gdn(*[inputs[n] for n in NAMES[:6]], initial_state=inputs["h0"])
    assert "\n" not in str(info.value)


def test_bad_chunk_size_and_step_inputs():
    q, k, v, g, beta, keep, h0 = make_inputs(1, 70, 2, 16, 16)
    with pytest.raises(ValueError, match="chunk_size must be 64"):
        chunk_selected_gdn(q, k, v, g, beta, keep, chunk_size=32)
    with pytest.raises(ValueError, match="keep must be"):
        chunk_selected_gdn_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0, h0, keep=keep)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T", [300, 1000])
def test_gpu_bf16_matches_fp32_reference(T, nan_empty):
    errors = compare(make_inputs(2, T, 4, 128, 256, dtype=torch.bfloat16, seed=T), 2e-2, grad_tol=5e-2)
    assert max(errors.values()) < 5e-2


@pytest.mark.gpu
@requires_gpu
def test_gpu_fp32_backward_large_heads(nan_empty):
    compare(make_inputs(1, 300, 2, 128, 256, seed=4), 1e-2, decay_dropped=False, dkeep_dropped=True)


@pytest.mark.gpu
@requires_gpu
def test_gpu_keep_all_equals_fla_forward():
    fla_chunk = pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention not importable")
    q, k, v, g, beta, _, h0 = make_inputs(2, 1000, 4, 128, 256, dtype=torch.bfloat16, seed=12)
    keep = torch.ones(2, 4, 16, device=DEV)
    o, ht = chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=h0, output_final_state=True)
    fo, fht = fla_chunk.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, fo, 1e-2, "o vs fla")
    assert_close(ht, fht, 1e-2, "final state vs fla")


# Issue 14's grid: every K and V the layers use, fp32 (tf32 products) and bf16, T not a multiple of 64. Each
# (K, V, dtype) runs in its own process so that a fault (which poisons the CUDA context) fails only its own case.
GRID_TOL = {"float32": (1e-2, 1e-2), "bfloat16": (2e-2, 5e-2)}


def grid_errors(K, V, dtype, Ts, B=2, H=2, g_scale=None):
    """{T: errors vs the fp32 naive reference} for one head shape, or {T: "refused: ..."} for a ValueError."""
    out = {}
    for T in Ts:
        inputs = make_inputs(B, T, H, K, V, dtype=getattr(torch, dtype), seed=T + K + V, g_scale=g_scale)
        try:
            with nan_poisoned_empty():
                # both rollback rules and both dkeep options across the two short lengths
                out[T] = errors_vs_naive(inputs, decay_dropped=T < 200, dkeep_dropped=T >= 200)[0]
        except ValueError as e:
            out[T] = f"refused: {e}"
    return out


def run_grid_case(K, V, dtype, Ts, B=2, H=2, g_scale=None):
    code = (f"import json; from tests.kernels.test_nats_gdn import grid_errors; "
            f"print('GRID', json.dumps(grid_errors({K}, {V}, {dtype!r}, {list(Ts)}, {B}, {H}, {g_scale})))")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=subprocess_pythonpath())
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=270)
    assert proc.returncode == 0, f"K={K} V={V} {dtype} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.split("GRID ", 1)[1])
    tol, grad_tol = GRID_TOL[dtype]
    for T, errors in result.items():
        print(f"K={K} V={V} {dtype} T={T}: {errors}")
        if isinstance(errors, str):
            # the only shapes allowed to be refused: fp32 tiles of the largest heads may not fit shared memory
            assert dtype == "float32" and K >= 192 and "does not fit this GPU" in errors, errors
            continue
        for name, err in errors.items():
            assert err <= (tol if name in ("o", "ht") else grad_tol), f"K={K} V={V} {dtype} T={T} {name}: {err:.3e}"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("V", [64, 128, 256, 384])
@pytest.mark.parametrize("K", [32, 64, 128, 192, 256])
def test_gpu_head_size_grid(K, V, dtype):
    run_grid_case(K, V, dtype, [100, 300])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("K,V", [(32, 64), (128, 256)])
def test_gpu_shorter_than_a_chunk(K, V, dtype):
    """A decoding prompt is often one partial chunk (transformers' generate() prefill of 8 tokens on the tiny
    model faulted with an illegal address on the H200), with an initial state as the layer's open chunk has."""
    run_grid_case(K, V, dtype, [1, 8, 40, 64])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_long_sequence_k64(dtype):
    """Issue 14's second failing shape class: K = 64, V = 128 at T = 4096."""
    run_grid_case(64, 128, dtype, [4096], B=1, H=2)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("K,V", [(64, 128), (128, 256), (192, 384)])
def test_gpu_strong_decays(K, V, dtype):
    """The layers' gates (A up to 16): chunk decays far below e^-88, where e^{G_L} * e^{-G_t} gave NaN."""
    run_grid_case(K, V, dtype, [300, 4096], B=1, H=2, g_scale=16.0)


def test_state_kernel_probe_variants_match_the_stock_kernel():
    """tools/probe_gdn_state.py's variants of the forward state kernel (issue #14) equal the stock kernel in the
    interpreter, so that on the GPU a difference is the compiler's; and its check sees the keep mask (every chunk
    kept gives other states)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tools" / "probe_gdn_state.py"
    spec = importlib.util.spec_from_file_location("probe_gdn_state", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    rows = [probe.child({"shape": "tiny", "dtype": "fp32", "variant": name, "warps": 4, "stages": 1})
            for name in ["stock", *probe.VARIANTS]]
    assert all(row["ok"] for row in rows), rows
    inputs = probe.make_inputs("tiny", torch.float32, "cpu")
    k, w, u, G, keep = inputs
    unmasked = probe.run_variant((k, w, u, G, torch.ones_like(keep)), {"NO_BRANCH": True}, 4, 1)()
    assert probe.rel_rms(unmasked[2], probe.run_stock(inputs)()[2]) > 0.1
