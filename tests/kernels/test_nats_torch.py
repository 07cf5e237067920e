"""The CPU torch chunk paths of both NAtS-L ops against their naive definitions (output, final state, every
gradient including keep's straight-through gradient), and the public ops' choice of that path on CPU."""
import pytest
import torch

from megahybrid_kernels.nats import chunk_selected_attention, chunk_selected_gdn
from megahybrid_kernels.nats.attention import naive_chunk_selected_attention
from megahybrid_kernels.nats.attention.torch_chunk import torch_chunk_selected_attention
from megahybrid_kernels.nats.gdn import naive_chunk_selected_gdn
from megahybrid_kernels.nats.gdn.torch_chunk import torch_chunk_selected_gdn
from tests.kernels import test_nats_attention as attn_tests
from tests.kernels import test_nats_gdn as gdn_tests
from tests.utils import assert_close

# both sides are fp32 on the CPU; the chunked form reorders sums (WY solve, blocked softmax)
TOL = 1e-5


def gdn_case(B, T, H, K, V, seed, g_scale=None, **kw):
    inputs = gdn_tests.make_inputs(B, T, H, K, V, seed=seed, device="cpu", g_scale=g_scale)
    gen = torch.Generator().manual_seed(seed + 1)
    do, dht = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    fns = [lambda *x, **a: torch_chunk_selected_gdn(*x[:6], K ** -0.5, initial_state=a["initial_state"], **kw),
           lambda *x, **a: naive_chunk_selected_gdn(*x[:6], initial_state=a["initial_state"], **kw)]
    (o, ht, grads), (ro, rht, rgrads) = (gdn_tests.run_op(fn, inputs, do, dht) for fn in fns)
    assert_close(o, ro, TOL, "o")
    assert_close(ht, rht, TOL, "final state")
    for name, a, b in zip(gdn_tests.NAMES, grads, rgrads):
        assert_close(a, b, TOL, f"d{name}")
    return inputs, rgrads


@pytest.mark.parametrize("decay_dropped", [True, False])
@pytest.mark.parametrize("T", [1, 63, 64, 100, 300])
def test_gdn_torch_matches_naive(T, decay_dropped):
    inputs, rgrads = gdn_case(2, T, 2, 24, 40, seed=T, decay_dropped=decay_dropped)
    keep, dkeep = inputs[5], rgrads[5]
    if T > 64:
        assert dkeep[keep == 1].abs().min() > 0 and (dkeep[keep == 0] == 0).all()


def test_gdn_torch_strong_decays():
    """The layers' gates: chunk decays below e^-88 stay finite and match the definition."""
    gdn_case(1, 100, 2, 16, 8, seed=9, g_scale=16.0)


def test_gdn_torch_dkeep_dropped():
    inputs, rgrads = gdn_case(1, 200, 2, 16, 8, seed=5, dkeep_dropped=True, decay_dropped=False)
    assert rgrads[5][inputs[5] == 0].abs().min() > 0


def attention_case(T, C, Dk, Dv, seed, **kw):
    q, k, v, keep, do = attn_tests.make_inputs(2, T, 2, Dk, C=C, seed=seed, device="cpu", Dv=Dv)
    o, grads = attn_tests.run_with_grads(torch_chunk_selected_attention, q, k, v, keep, do, scale=Dk ** -0.5,
                                         chunk_size=C, **kw)
    ro, rgrads = attn_tests.run_with_grads(naive_chunk_selected_attention, q, k, v, keep, do, chunk_size=C, **kw)
    assert_close(o, ro, TOL, "o")
    for name, a, b in zip(("dq", "dk", "dv", "dkeep"), grads, rgrads):
        assert_close(a, b, TOL, name)
    return keep, rgrads[3]


@pytest.mark.parametrize("T", [1, 63, 64, 100, 300])
def test_attention_torch_matches_naive(T):
    keep, dkeep = attention_case(T, 64, 16, 24, seed=T)
    if T > 128:
        assert dkeep[..., :-1][keep[..., :-1] == 1].abs().min() > 0


@pytest.mark.parametrize("C", [16, 128])
def test_attention_torch_chunk_sizes_and_query_blocks(C, monkeypatch):
    from megahybrid_kernels.nats.attention import torch_chunk
    monkeypatch.setattr(torch_chunk, "QUERY_BLOCK", 2 * C)  # several query blocks, the last one partial
    attention_case(5 * C + 7, C, 8, 8, seed=C)


def test_attention_torch_grad_unselected():
    keep, dkeep = attention_case(300, 64, 16, 16, seed=3, grad_unselected=True)
    assert dkeep[..., :-1][keep[..., :-1] == 0].abs().min() > 0


def test_public_ops_use_torch_path_on_cpu(monkeypatch):
    """Without TRITON_INTERPRET=1 the public ops run on CPU tensors (the torch path) and agree with naive."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, g, beta, keep, h0 = gdn_tests.make_inputs(1, 100, 2, 16, 32, seed=7, device="cpu")
    o, ht = chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=h0, output_final_state=True)
    ro, rht = naive_chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=h0)
    assert_close(o, ro, TOL, "gdn o")
    assert_close(ht, rht, TOL, "gdn final state")
    assert chunk_selected_gdn(q, k, v, g, beta, keep)[1] is None
    q, k, v, keep, _ = attn_tests.make_inputs(1, 100, 2, 16, seed=8, device="cpu", Dv=32)
    o = chunk_selected_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), keep)
    ro = naive_chunk_selected_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), keep)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 100, 2, 32)
    assert_close(o, ro, 1e-2, "attention o (bf16)")
