"""chunk_selected_gdn over segments run side by side (kernels/nats/gdn/segmented.py) against one op call: output,
final state and every gradient (keep's straight-through one and the initial state's included), on the CPU's torch
path (fp32) and on the GPU's kernels (bf16, the prefill's dtype, and fp32)."""
import pytest
import torch

from megahybrid_kernels.nats import chunk_selected_gdn
from megahybrid_kernels.nats.gdn.segmented import chunk_selected_gdn_segmented, gdn_segments
from tests.kernels import test_nats_gdn as gdn_tests
from tests.utils import assert_close, requires_gpu

TOL = 1e-5  # fp32 on both sides: the segments only reorder the state's sums


def _both(B, T, H, K, V, segments, device="cpu", dtype=torch.float32, seed=0, **kw):
    inputs = [x.to(device) for x in gdn_tests.make_inputs(B, T, H, K, V, seed=seed, device="cpu", g_scale=16.0)]
    inputs[:3] = [x.to(dtype) for x in inputs[:3]]
    gen = torch.Generator().manual_seed(seed + 1)
    do, dht = (torch.randn(*s, generator=gen).to(device) for s in ((B, T, H, V), (B, H, K, V)))
    args = dict(output_final_state=True, use_qk_l2norm=True, check_values=False, **kw)
    ref = gdn_tests.run_op(chunk_selected_gdn, inputs, do, dht, **args)
    seg = gdn_tests.run_op(lambda *x, **a: chunk_selected_gdn_segmented(*x, segments=segments, **a), inputs, do,
                           dht, **args)
    return seg, ref


def _compare(seg, ref, tol, grad_tol=None):
    (o, ht, grads), (ro, rht, rgrads) = seg, ref
    assert_close(o, ro, tol, "o")
    assert_close(ht, rht, tol, "final state")
    for name, a, b in zip(gdn_tests.NAMES, grads, rgrads):
        assert_close(a, b, grad_tol or tol, f"d{name}")


@pytest.mark.parametrize("segments", [2, 4])
@pytest.mark.parametrize("decay_dropped", [True, False])
def test_segments_equal_one_call(segments, decay_dropped, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path, as a CPU run takes it
    _compare(*_both(2, 64 * 8, 2, 16, 24, segments, decay_dropped=decay_dropped), TOL)


def test_one_segment_is_the_op_and_shapes_are_checked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _compare(*_both(1, 100, 2, 8, 8, 1), 0.0)
    q, k, v, g, beta, keep, _ = gdn_tests.make_inputs(1, 64 * 3, 2, 8, 8, device="cpu")
    with pytest.raises(ValueError, match="multiple of 64 x segments = 128"):
        chunk_selected_gdn_segmented(q, k, v, g, beta, keep, segments=2)


def test_segment_count_rule(monkeypatch):
    assert gdn_segments(1, 6, 131072, torch.device("cpu")) == 1  # the CPU's torch path has no idle SMs

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    cuda = torch.device("cuda")
    assert gdn_segments(1, 6, 131072, cuda) == 32  # 6 rows -> 192, 2,048 chunks -> 64 per segment
    assert gdn_segments(1, 6, 8192, cuda) == 2  # 128 chunks: no segment below 64 chunks
    assert gdn_segments(16, 6, 4096, cuda) == 1  # 64 chunks, and 96 rows already
    assert gdn_segments(32, 6, 65536, cuda) == 1  # 192 rows fill the SMs
    assert gdn_segments(1, 6, 131072 + 64, cuda) == 1  # 2,049 chunks: no power of two divides them
    assert gdn_segments(1, 6, 1000, cuda) == 1  # not whole chunks


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype, tol, grad_tol", [(torch.bfloat16, 2e-2, 4e-2), (torch.float32, 1e-3, 3e-3)])
@pytest.mark.parametrize("K, V", [(128, 256), (64, 128), (192, 384)])
def test_segments_equal_one_call_gpu(dtype, tol, grad_tol, K, V):
    """The kernels at width K + V (the presets' K = 64 / 128 / 192) from the [I | 0] start: 8 segments of 4 chunks
    of a 2K sequence against one call (the H200's tf32 GDN dots: fp32 at 1e-3)."""
    _compare(*_both(1, 2048, 2, K, V, 8, device="cuda", dtype=dtype, seed=K), tol, grad_tol)
