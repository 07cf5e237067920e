"""The fused input path of the `I` layer (kernels/interdomain_input): the Triton kernels against the fp32 naive
definition, outputs and every gradient (CPU: Triton's interpreter, fp32, which conftest turns on), the naive
definition against the layer's own functions, one-line errors, the custom op's registration and a compiled caller.

Interpreter time is per program (~0.3 s forward, ~0.6 s backward on 2 cores, whatever the tile width), so the CPU
grid covers each feature of the kernels once rather than their product: T in {1, 63, 64, 100, 300} against 64-row
tiles (one and several programs, the backward's halo across a program edge), R in {16, 32, 64, 128}, V in
{32, 64, 96, 128}, with and without a tail, RoPE on and off, offsets 0 and large, H 1 and 3, conv sizes 1, 2, 4."""
import re

import pytest
import torch

from megahybrid_kernels.interdomain_input import interdomain_input, interdomain_input_fwd_op, interdomain_input_naive
from tests.utils import assert_close, rel_rms_error, requires_gpu, test_device

FP32_TOL = 1e-5  # relative RMS: the same fp32 math in another order (measured ~3e-7 in the interpreter)
BF16_TOL = 1e-2  # bf16 inputs against fp32 naive on the same rounded inputs: one bf16 rounding of each output
BASE = 10000.0
EPS = 1e-5
NAMES = ("q", "k", "v", "tail", "dx", "dw", "dtail", "dwk", "dbk", "dwv", "dbv")


def make_inputs(B, T, H, R, V, KC=4, tail=True, dtype=torch.float32, strided=False, seed=0, device="cpu"):
    """x [B, T, H, 2R + V] (strided: the layer's view of a [T, B, .] projection output), w, tail, wk, bk, wv, bv."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    W = 2 * R + V
    x = rnd(T, B, H * W).transpose(0, 1).reshape(B, T, H, W) if strided else rnd(B, T, H, W)
    w = rnd(H, 2 * R, KC) * KC ** -0.5
    prev = rnd(B, KC - 1, H * 2 * R) if tail else None
    norms = (1 + 0.2 * rnd(R), 0.2 * rnd(H, R), 1 + 0.2 * rnd(V), 0.2 * rnd(H, V))
    xs = [x.to(device, dtype), w.to(device), None if prev is None else prev.to(device, dtype)]
    return xs + [t.to(device) for t in norms]


def run(fn, inputs, offset, use_rope, seed=1):
    """Outputs (q, k~, v~, new tail) and the gradients of a random linear function of them for every input."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    x, w, tail, wk, bk, wv, bv = leaves
    outs = fn(x, w, tail, offset, use_rope, BASE, wk, bk, wv, bv, EPS)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    loss.backward()
    grads = [t.grad if t is not None else None for t in (x, w, tail, wk, bk, wv, bv)]
    return [*outs, *grads]


def compare(inputs, offset=0, use_rope=True, tol=FP32_TOL):
    got = run(interdomain_input, inputs, offset, use_rope)
    ref = run(interdomain_input_naive, [None if t is None else t.float() for t in inputs], offset, use_rope)
    errors = {n: rel_rms_error(a, r) for n, a, r in zip(NAMES, got, ref) if r is not None}
    print(" ".join(f"{n}={e:.1e}" for n, e in errors.items()))
    assert (got[NAMES.index("dtail")] is None) == (inputs[2] is None)
    for n, a, r in zip(NAMES, got, ref):
        if r is not None:
            assert a.dtype == (inputs[0].dtype if n in ("q", "k", "v", "tail", "dx", "dtail") else torch.float32), n
            assert_close(a, r, tol, n)
    return errors


@pytest.mark.parametrize("B,T,H,R,V,KC,tail,use_rope,offset,strided", [
    (2, 1, 3, 64, 64, 4, True, True, 7, False),  # a decode step: every conv input but one from the tail
    (2, 63, 1, 64, 64, 4, False, True, 0, True),  # the layer's strided view; backward: 2 programs for 63 rows
    (2, 64, 1, 16, 32, 4, True, True, 0, False),  # a whole forward tile; half rows of 8 padded to 16
    (2, 100, 3, 32, 96, 4, True, False, 0, False),  # RoPE off, V not a power of two
    (2, 300, 1, 64, 64, 4, True, True, 4093, True),  # the preset head at a CP shard's offset, 5-6 programs
    (2, 100, 1, 128, 128, 4, False, True, 5, False),  # wide rows: 32-row tiles
    (2, 63, 3, 64, 64, 2, True, True, 1, False),  # conv size 2
    (2, 2, 1, 16, 32, 4, True, True, 0, False),  # T < KC - 1: the new tail is part old tail
    (2, 64, 1, 32, 64, 1, False, True, 0, False),  # conv size 1: no tail rows
])
def test_kernels_match_naive(nan_empty, B, T, H, R, V, KC, tail, use_rope, offset, strided):
    compare(make_inputs(B, T, H, R, V, KC, tail, strided=strided), offset, use_rope)


def test_features_that_vanish_stay_finite(nan_empty):
    """x = 0 rows: silu(0) = 0, so xi's norm clamps at 1e-6 and k~ is the bias; the backward's clamped branch."""
    inputs = make_inputs(2, 70, 1, 16, 32, tail=False)
    inputs[0][:, 10:20] = 0.0
    compare(inputs)


def test_naive_is_the_layers_input_path():
    """naive.py against the layer's own pieces (causal_depthwise_conv, rope, feature_map, HeadNorm) in fp32."""
    from megahybrid.model.mixers.interdomain import Dims, HeadNorm, feature_map, rope
    from megahybrid.model.mixers.shortconv import causal_depthwise_conv

    B, T, H, R, V, KC = 2, 37, 3, 16, 24, 4
    x, w, tail, wk, bk, wv, bv = make_inputs(B, T, H, R, V, KC)
    offset = 11
    norms = []
    for width, scale, bias in ((R, wk, bk), (V, wv, bv)):
        norm = HeadNorm(Dims(H, slice(0, H), V, R, 8, KC), width, EPS, 1e-3)
        norm.weight.data, norm.bias.data = scale.clone(), bias.clone()
        norms.append(norm)
    conv, new_tail = causal_depthwise_conv(x[..., :2 * R].reshape(B, T, -1), w.reshape(-1, KC), tail)
    conv = conv.view(B, T, H, 2 * R)
    want = (feature_map(rope(conv[..., :R], offset, BASE)),
            norms[0](feature_map(rope(conv[..., R:], offset, BASE))), norms[1](x[..., 2 * R:]), new_tail)
    got = interdomain_input_naive(x, w, tail, offset, True, BASE, wk, bk, wv, bv, EPS)
    for name, a, r in zip(("q", "k", "v", "tail"), got, want):
        assert_close(a, r, 1e-6, name)


def _bad(**over):
    x, w, tail, wk, bk, wv, bv = make_inputs(1, 8, 2, 16, 24, 4)
    args = dict(x=x, w=w, tail=tail, offset=0, use_rope=True, rope_base=BASE, wk=wk, bk=bk, wv=wv, bv=bv,
                norm_eps=EPS)
    args.update(over)
    return args


@pytest.mark.parametrize("over,msg", [
    (dict(x=torch.randn(1, 8, 2, 40, 1)), "x must be [B, T, H, 2R + V] and w [H, 2R, KC]"),
    (dict(w=torch.randn(2, 30, 4)), "choose an even feature_dim"),
    (dict(w=torch.randn(3, 32, 4)), "w must be [H=2, 2R, KC]"),
    (dict(x=torch.randn(1, 8, 2, 32)), "2R + V > 2R = 32 columns per head"),
    (dict(x=torch.randn(1, 8, 2, 32 + 300), wv=torch.ones(300), bv=torch.zeros(2, 300)), "use smaller heads"),
    (dict(w=torch.randn(2, 32, 9), tail=None), "1 <= conv_size <= 8"),
    (dict(wk=torch.ones(24)), "wk must be [16]"),
    (dict(bv=torch.zeros(24)), "bv must be [2, 24]"),
    (dict(tail=torch.zeros(1, 4, 64)), "tail must be [1, 3, 64]"),
    (dict(wv=torch.ones(24, dtype=torch.int64)), "must be fp32/bf16/fp16"),
])
def test_bad_inputs(over, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        interdomain_input(**_bad(**over))


def test_custom_op_registration():
    """torch.library.opcheck: schema, fake shapes against the real outputs, autograd registration, AOT dispatch."""
    x, w, tail, wk, bk, wv, bv = (t.requires_grad_() for t in make_inputs(1, 20, 2, 16, 24, 4))
    torch.library.opcheck(interdomain_input_fwd_op, (x, w, tail, wk, bk, wv, bv, 3, True, BASE, EPS))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu])])
def test_compiled_caller_keeps_the_op_in_one_graph(device):
    """fullgraph=True fails on any graph break; outputs and every gradient equal eager's."""
    from tests.kernels.test_custom_ops import _compiled_matches_eager

    inputs = make_inputs(2, 40, 2, 16, 24, 4, device=device)

    def fn(x, w, tail, wk, bk, wv, bv):
        return interdomain_input(x * 2, w, tail, 5, True, BASE, wk, bk, wv, bv, EPS)

    _compiled_matches_eager(fn, inputs)


GPU_CASES = [  # (B, T, H, R, V, KC, tail, offset): the preset head (125M: 12 heads of R = V = 64) and odd shapes
    (2, 4096, 12, 64, 64, 4, False, 0),
    (2, 1000, 12, 64, 64, 4, True, 3000),
    (2, 1, 12, 64, 64, 4, True, 77),
    (2, 300, 3, 128, 96, 4, True, 0),
    (2, 100, 3, 16, 256, 2, False, 0),
    (2, 333, 3, 256, 32, 4, True, 5),
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,H,R,V,KC,tail,offset", GPU_CASES)
def test_kernels_match_naive_gpu(nan_empty, dtype, B, T, H, R, V, KC, tail, offset):
    inputs = make_inputs(B, T, H, R, V, KC, tail, dtype=dtype, strided=True, device=test_device())
    compare(inputs, offset, True, FP32_TOL if dtype == torch.float32 else BF16_TOL)
