"""Attention over selected chunks: Triton kernels (interpreter on CPU) and the decode step against the naive
definition, for the output and every gradient including keep."""
import math

import pytest
import torch
import torch.nn.functional as F

from megahybrid_kernels.nats.attention import (
    chunk_selected_attention,
    naive_chunk_selected_attention,
    selected_attention_prefill,
    selected_attention_step,
)
from megahybrid_kernels.nats.attention import chunk as attention_chunk
from megahybrid_kernels.nats.attention.chunk import chunk_selected_attention_fwd
from tests.utils import assert_close, requires_gpu, test_device

# fp32: the kernels use exact fp32 products (input_precision="ieee"), so errors are at rounding level.
TOL_FP32 = 1e-5
# bf16 inputs against the fp32 reference on the same bf16-rounded inputs.
TOL_BF16 = 2e-2


def make_inputs(B, T, H, D, C=64, p_keep=0.5, dtype=torch.float32, device=None, seed=0, Dv=None):
    device = device or test_device()
    g = torch.Generator().manual_seed(seed)
    dims = (D, D, Dv or D, Dv or D)
    q, k, v, do = (torch.randn(B, T, H, d, generator=g).to(device, dtype) for d in dims)
    keep = (torch.rand(B, H, math.ceil(T / C), generator=g) < p_keep).float().to(device)
    return q, k, v, keep, do


def run_with_grads(fn, q, k, v, keep, do, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, keep)]
    o = fn(*leaves, **kw)
    grads = torch.autograd.grad(o, leaves, do)
    return o, grads


def check_against_naive(q, k, v, keep, do, tol, **kw):
    o, grads = run_with_grads(chunk_selected_attention, q, k, v, keep, do, **kw)
    f32 = [x.float() for x in (q, k, v, keep, do)]
    o_ref, grads_ref = run_with_grads(naive_chunk_selected_attention, *f32, **kw)
    assert_close(o, o_ref, tol, "o")
    for name, g, g_ref in zip(("dq", "dk", "dv", "dkeep"), grads, grads_ref):
        assert_close(g, g_ref, tol, name)
    return grads_ref


@pytest.mark.parametrize("T", [63, 64, 100, 300])
def test_matches_naive(T, nan_empty):
    q, k, v, keep, do = make_inputs(2, T, 2, 32, seed=T)
    grads_ref = check_against_naive(q, k, v, keep, do, TOL_FP32)
    if T > 64:
        assert grads_ref[3].abs().sum() > 0, "the keep gradient must be exercised"


@pytest.mark.parametrize("G,KB", [(1, 1), (4, 4)])
def test_program_shapes(G, KB, nan_empty, monkeypatch):
    """G query chunks per program (selection mask across the program's own chunks) and KB kept chunks per key
    block (a partial last group) in the forward and dQ kernels."""
    cfg = {"fwd": {"G": G, "KB": KB}, "dkdv": {}, "dq": {"G": G, "KB": KB}}
    monkeypatch.setattr(attention_chunk, "CPU_CONFIG", cfg)
    gpu_cfg = {**attention_chunk.GPU_CONFIG, "fwd": cfg["fwd"], "dq": cfg["dq"]}
    monkeypatch.setattr(attention_chunk, "GPU_CONFIG", gpu_cfg)
    q, k, v, keep, do = make_inputs(1, 640, 2, 16, C=32, seed=10 + G)
    check_against_naive(q, k, v, keep, do, TOL_FP32, chunk_size=32)


@pytest.mark.parametrize("T,C,Dk,Dv", [(100, 64, 16, 32), (200, 32, 24, 8), (130, 64, 64, 128)])
def test_value_head_dim_differs(T, C, Dk, Dv, nan_empty, monkeypatch):
    """NAtS-L's attention view: d_qk = 64, d_v = 128; also Dv < Dk, a padded Dk and kept-chunk groups (KB = 2)."""
    q, k, v, keep, do = make_inputs(1, T, 2, Dk, C=C, seed=T + Dv, Dv=Dv)
    keep[..., 0] = 1
    grads_ref = check_against_naive(q, k, v, keep, do, TOL_FP32, chunk_size=C)
    assert grads_ref[3].abs().sum() > 0
    o, lse = chunk_selected_attention_fwd(q, k, v, keep, Dk**-0.5, C)
    o_c, lse_c = chunk_selected_attention_fwd(q, k, v, keep, Dk**-0.5, C, compact=True)
    assert o.shape == (1, T, 2, Dv)
    assert_close(o_c, o, TOL_FP32, "o (compacted)")


def test_decode_steps_value_head_dim_differs():
    B, T, H, Dk, Dv, C = 1, 90, 2, 8, 24, 16
    q, k, v, keep, _ = make_inputs(B, T, H, Dk, C=C, seed=12, device="cpu", Dv=Dv)
    expected = naive_chunk_selected_attention(q, k, v, keep, chunk_size=C)
    cache = selected_attention_prefill(k[:, :20], v[:, :20], keep[..., :2], C)
    outs = []
    for t in range(20, T):
        outs.append(selected_attention_step(q[:, t], k[:, t], v[:, t], cache))
        if cache.chunk_full():
            cache.commit(keep[:, :, t // C])
    assert cache.v.shape[-1] == Dv and cache.k.shape[-1] == Dk
    assert_close(torch.stack(outs, 1), expected[:, 20:], TOL_FP32, "o (decode)")


def test_small_chunks_odd_head_dim(nan_empty):
    q, k, v, keep, do = make_inputs(1, 100, 3, 24, C=16, p_keep=0.3, seed=1)
    check_against_naive(q, k, v, keep, do, TOL_FP32, chunk_size=16)


def test_grad_unselected(nan_empty):
    q, k, v, keep, do = make_inputs(1, 300, 2, 16, seed=2)
    grads_ref = check_against_naive(q, k, v, keep, do, TOL_FP32, grad_unselected=True)
    unselected = (keep == 0)[..., :-1]
    assert grads_ref[3][..., :-1][unselected].abs().min() > 0


def test_keep_grad_is_sum_of_ds_from_later_chunks(nan_empty):
    """d keep[c] = Σ dS over queries in chunks after c and keys in chunk c (own chunk excluded), dS = P (dP - Δ)."""
    B, T, H, D, C = 1, 200, 2, 16, 64
    q, k, v, keep, do = make_inputs(B, T, H, D, seed=3)
    keep[..., 0] = 1
    _, grads = run_with_grads(chunk_selected_attention, q, k, v, keep, do)
    qf, kf, vf, dof = (x.double().cpu().transpose(1, 2) for x in (q, k, v, do))
    chunk = torch.arange(T) // C
    keep_tok = keep.double().cpu()[..., chunk]
    visible = (torch.arange(T)[:, None] >= torch.arange(T)[None, :]) & (
        (chunk[:, None] == chunk[None, :]) | (keep_tok[:, :, None, :] == 1)
    )
    s = (qf @ kf.transpose(-1, -2) / math.sqrt(D)).masked_fill(~visible, float("-inf"))
    p = s.softmax(-1)
    o = p @ vf
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * o).sum(-1, keepdim=True))
    later = chunk[:, None] > chunk[None, :]
    expected = torch.stack([(ds * later * (chunk[None, :] == c)).sum((-1, -2)) for c in range(chunk.max() + 1)], -1)
    expected = expected * (keep.double().cpu() == 1)
    assert_close(grads[3], expected, TOL_FP32, "dkeep")


def test_all_ones_equals_causal_sdpa(nan_empty):
    q, k, v, keep, do = make_inputs(1, 150, 2, 32, p_keep=1.0, seed=4)
    o, grads = run_with_grads(chunk_selected_attention, q, k, v, keep, do)
    sdpa = lambda q, k, v, keep: F.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2) + 0 * keep.sum()
    o_ref, grads_ref = run_with_grads(sdpa, q, k, v, keep, do)
    assert_close(o, o_ref, TOL_FP32, "o")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads[:3], grads_ref[:3]):
        assert_close(g, g_ref, TOL_FP32, name)


def test_all_zeros_equals_chunk_local_attention(nan_empty):
    T, C = 150, 64
    q, k, v, keep, do = make_inputs(1, T, 2, 32, p_keep=0.0, seed=5)
    chunk = torch.arange(T, device=q.device) // C
    pos = torch.arange(T, device=q.device)
    mask = (chunk[:, None] == chunk[None, :]) & (pos[:, None] >= pos[None, :])
    sdpa = lambda q, k, v, keep: F.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2) + 0 * keep.sum()
    o, grads = run_with_grads(chunk_selected_attention, q, k, v, keep, do)
    o_ref, grads_ref = run_with_grads(sdpa, q, k, v, keep, do)
    assert_close(o, o_ref, TOL_FP32, "o")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads[:3], grads_ref[:3]):
        assert_close(g, g_ref, TOL_FP32, name)


def test_compacted_kv_forward_equals_block_skipping(nan_empty):
    q, k, v, keep, _ = make_inputs(2, 200, 2, 32, seed=6)
    o, lse = chunk_selected_attention_fwd(q, k, v, keep, 32**-0.5, 64)
    o_c, lse_c = chunk_selected_attention_fwd(q, k, v, keep, 32**-0.5, 64, compact=True)
    assert_close(o_c, o, TOL_FP32, "o")
    assert_close(lse_c, lse, TOL_FP32, "lse")


@pytest.mark.parametrize("prompt", [1, 32, 40, 64, 150])
def test_decode_steps_equal_op(prompt):
    """A prompt of part of a chunk, exactly one or two chunks, or the whole sequence, then steps."""
    B, T, H, D, C = 2, 150, 2, 16, 32
    q, k, v, keep, _ = make_inputs(B, T, H, D, C=C, seed=7, device="cpu")
    expected = naive_chunk_selected_attention(q, k, v, keep, chunk_size=C)
    if prompt < T:
        o, cache = decode_outputs(q, k, v, keep, prompt, C)
        assert_close(o, expected[:, prompt:], TOL_FP32, "o (decode)")
    else:
        cache = selected_attention_prefill(k, v, keep, C)
    assert torch.equal(cache.n_kept, C * keep[..., : T // C].sum(-1).long())
    for b, h in ((0, 0), (1, 1)):  # the cache holds exactly the kept chunks, in order
        chunks = [c for c in range(T // C) if keep[b, h, c] == 1]
        rows = torch.cat([k[b, c * C:(c + 1) * C, h] for c in chunks]) if chunks else k.new_zeros(0, D)
        assert torch.equal(cache.kept(b, h)[0], rows)


def decode_outputs(q, k, v, keep, prompt, C):
    """Outputs of the tokens after `prompt` decoded step by step (committing each full chunk)."""
    cache = selected_attention_prefill(k[:, :prompt], v[:, :prompt], keep[..., : math.ceil(prompt / C)], C)
    outs = []
    for t in range(prompt, q.shape[1]):
        outs.append(selected_attention_step(q[:, t], k[:, t], v[:, t], cache))
        if cache.chunk_full():
            cache.commit(keep[:, :, t // C])
    return torch.stack(outs, 1), cache


@pytest.mark.gpu
@requires_gpu
def test_gpu_decode_steps_bf16():
    """The decode step's masked SDPA over the bf16 cache on the GPU, against the fp32 definition."""
    q, k, v, keep, _ = make_inputs(2, 300, 4, 64, C=64, dtype=torch.bfloat16, device="cuda", seed=3, Dv=128)
    expected = naive_chunk_selected_attention(q.float(), k.float(), v.float(), keep, chunk_size=64)
    o, _ = decode_outputs(q, k, v, keep, 70, 64)
    assert o.dtype == torch.bfloat16
    assert_close(o.float(), expected[:, 70:], TOL_BF16, "o (decode, bf16)")


def test_decode_cache_holds_only_kept_chunks():
    B, H, D, C = 1, 2, 8, 16
    q, k, v, _, _ = make_inputs(B, 3 * C, H, D, C=C, seed=8, device="cpu")
    keep = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]])
    cache = selected_attention_prefill(k, v, keep, C)
    assert cache.n_kept.tolist() == [[0, 2 * C]] and cache.n_cur == 0
    assert cache.k.shape[2] == 3 * C  # the two kept chunks and room for the next one
    keys, values = cache.kept(0, 1)
    assert torch.equal(keys, torch.cat((k[0, :C, 1], k[0, 2 * C:, 1])))
    assert torch.equal(values, torch.cat((v[0, :C, 1], v[0, 2 * C:, 1])))
    assert cache.kept(0, 0)[0].shape[0] == 0


def bad_inputs():
    q, k, v, keep, _ = make_inputs(1, 100, 2, 16, device="cpu")
    return [
        ((q[0], k, v, keep), {}, "q must be"),
        ((q, k[:, :99], v, keep), {}, "share one shape"),
        ((q, k, v, keep[..., :1]), {}, "keep must be"),
        ((q, k, v, keep.long()), {}, "float tensor"),
        ((q, k, v.double(), keep), {}, "share one float dtype"),
        ((q, k, v, keep), {"chunk_size": 48}, "chunk_size must be"),
        ((q, k, v, keep * 0.5), {}, "keep must hold only 0 and 1"),
        ((q, k, v, keep - 1), {}, "keep must hold only 0 and 1"),
        ((q, k, v[..., :1].expand(1, 100, 2, 300), keep), {}, "head dims must be <= 256"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_inputs(case):
    args, kw, msg = bad_inputs()[case]
    with pytest.raises(ValueError, match=msg):
        chunk_selected_attention(*args, **kw)


def test_decode_bad_inputs():
    cache = selected_attention_prefill(*make_inputs(1, 31, 2, 8, C=16, device="cpu")[1:3], torch.ones(1, 2, 2), 16)
    x = torch.randn(1, 2, 8)
    selected_attention_step(x, x, x, cache)
    with pytest.raises(ValueError, match="commit"):
        selected_attention_step(x, x, x, cache)
    with pytest.raises(ValueError, match="one decoding step"):
        selected_attention_step(x[:, :1], x, x, cache)
    cache.commit(torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs a full chunk"):
        cache.commit(torch.ones(1, 2))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T,C", [(1000, 64), (4096, 64), (700, 128)])
def test_gpu_bf16_matches_fp32_reference(T, C, nan_empty):
    q, k, v, keep, do = make_inputs(2, T, 4, 64, C=C, p_keep=0.3, dtype=torch.bfloat16, seed=T)
    check_against_naive(q, k, v, keep, do, TOL_BF16, chunk_size=C)


@pytest.mark.gpu
@requires_gpu
def test_gpu_fp32_backward_matches_reference(nan_empty):
    q, k, v, keep, do = make_inputs(2, 777, 4, 64, p_keep=0.4, seed=9)
    check_against_naive(q, k, v, keep, do, TOL_FP32)
    check_against_naive(q, k, v, keep, do, TOL_FP32, grad_unselected=True)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL_FP32), (torch.bfloat16, TOL_BF16)])
def test_gpu_value_head_dim_differs(dtype, tol, nan_empty):
    """NAtS-L's attention view (d_qk = 64, d_v = 128) on the GPU kernels, every gradient."""
    q, k, v, keep, do = make_inputs(2, 1000, 4, 64, p_keep=0.3, dtype=dtype, seed=21, Dv=128)
    check_against_naive(q, k, v, keep, do, tol)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL_FP32), (torch.bfloat16, TOL_BF16)])
@pytest.mark.parametrize("Dk,Dv", [(16, 32), (32, 32), (96, 192), (128, 256), (256, 256)])
def test_gpu_small_and_odd_head_dims(Dk, Dv, dtype, tol, nan_empty):
    """The tiny preset's attention view (q/k 16, v 32; narrow tiles faulted on the H200 before the 64-wide
    minimum), head dims that are not powers of two and the widest tiles the op serves, every gradient."""
    q, k, v, keep, do = make_inputs(2, 300, 3, Dk, p_keep=0.4, dtype=dtype, seed=Dk + Dv, Dv=Dv)
    check_against_naive(q, k, v, keep, do, tol)
