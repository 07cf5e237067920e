"""The Triton ops as torch custom ops (megahybrid::interdomain_*, selected_attention_*, selected_gdn_*, tf32_bmm): their
registration passes torch's own checks (torch.library.opcheck), and a compiled caller keeps each op inside one
graph (fullgraph=True) with the same outputs and gradients as eager.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), small fp32 shapes; the compiled
callers also on the GPU (fp32)."""
import dataclasses

import pytest
import torch

from megahybrid_kernels.interdomain import DEFAULT_PLAN, InterdomainPlan, interdomain_attention, interdomain_fwd_op
from megahybrid_kernels.interdomain.utils import PLANS, plan_key
from megahybrid_kernels.interdomain.chunk import readout_p
from megahybrid_kernels.nats.attention import chunk as attention_chunk
from megahybrid_kernels.nats.gdn import chunk as gdn_chunk
from tests.kernels import test_nats_attention, test_nats_gdn
from tests.kernels.test_interdomain import make_inputs
from tests.kernels.test_interdomain_torch import make_readout
from tests.utils import rel_rms_error, requires_gpu

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu])]

COMPILED_TOL = 1e-5  # relative RMS: the same kernels; only the torch ops around them are fused by inductor
# segmented scans from 3 chunks on (the default plan segments only past 128 chunks, too long for the interpreter),
# the backward rescanning from the segment starts; KEPT: the default, whose backward takes the forward's states
SEGMENTED = InterdomainPlan(scan_segment=2, scan_segment_above=2, keep_states=False)
KEPT = InterdomainPlan(keep_states=True)


def _op_args(plan: InterdomainPlan, with_state: bool, with_readout: bool):
    q, k, v, decay, b, u0, g0 = make_inputs(1, 40, 2, 16, 24, 8)
    state = (u0.transpose(2, 3).contiguous(), g0.transpose(2, 3).contiguous()) if with_state else (None, None)
    p = readout_p(make_readout(2, 8)) if with_readout else None
    args = [t.requires_grad_() if t is not None else None for t in (q, k, v, decay, b, *state, p)]
    return (*args, 16, plan.plan_id)


@pytest.mark.parametrize("plan,with_state,with_readout",
                         [(InterdomainPlan(), False, False), (SEGMENTED, True, True), (KEPT, True, False)],
                         ids=["default", "segmented", "with-state"])
def test_custom_op_registration(plan, with_state, with_readout):
    """torch.library.opcheck: schema, fake (meta) shapes against the real outputs, autograd registration and
    AOT dispatch, static and dynamic shapes."""
    args = _op_args(plan, with_state, with_readout)
    outs = interdomain_fwd_op(*args)
    if plan is SEGMENTED:  # the case carries segment start states
        assert outs[3].numel() > 0
    if plan.keep_states:  # the chunk-boundary states [B, H, NC, 2, M, K / V] instead of empty stand-ins
        assert outs[5].shape == (1, 2, 3, 2, 8, 16) and outs[6].shape == (1, 2, 3, 2, 8, 24)
    else:
        assert outs[5].numel() == 0 and outs[6].numel() == 0
    torch.library.opcheck(interdomain_fwd_op, args)


def _compiled_matches_eager(fn, leaves, tol=COMPILED_TOL):
    runs = []
    for compiled in (False, True):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        torch._dynamo.reset()
        outs = (torch.compile(fn, fullgraph=True) if compiled else fn)(*xs)
        gen = torch.Generator().manual_seed(3)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
        loss.backward()
        runs.append([*outs, *(x.grad for x in xs)])
    assert all(t is not None for t in runs[0])
    for got, want in zip(runs[1], runs[0]):
        assert rel_rms_error(got, want) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan", [None, SEGMENTED], ids=["default-kept", "segmented-rescan"])
def test_compiled_caller_keeps_the_op_in_one_graph(plan, device):
    """fullgraph=True fails on any graph break; outputs, final state and every gradient (C's too) equal eager's."""
    q, k, v, decay, b, u0, g0 = make_inputs(2, 63, 2, 16, 24, 8, device=device)

    def fn(q, k, v, decay, b, u0, g0, c):
        o, state = interdomain_attention(q, k, v, decay, b, initial_state=(u0, g0), output_final_state=True,
                                         chunk_size=16, readout=c, plan=plan)
        return (o, *state)

    _compiled_matches_eager(fn, [q, k, v, decay, b, u0, g0, make_readout(2, 8, device=device)])


def test_plan_key_is_stable():
    """Equal plans share a key and unequal ones do not; the key is a digest of the fields (the same in every
    process and order of creation), which a compiled graph and inductor's on-disk cache carry."""
    assert InterdomainPlan().plan_id == DEFAULT_PLAN.plan_id
    assert SEGMENTED.plan_id == InterdomainPlan(scan_segment=2, scan_segment_above=2, keep_states=False).plan_id
    assert KEPT.plan_id == DEFAULT_PLAN.plan_id != InterdomainPlan(keep_states=False).plan_id
    fields = dataclasses.astuple(DEFAULT_PLAN)  # another version of the op's source: another key
    assert plan_key(fields) == DEFAULT_PLAN.plan_id != plan_key(fields, source="an earlier version")
    assert len({DEFAULT_PLAN.plan_id, SEGMENTED.plan_id, InterdomainPlan(warps_fwd=8).plan_id}) == 3
    assert PLANS[KEPT.plan_id] == KEPT and 0 < KEPT.plan_id < 2**63


@pytest.mark.parametrize("grad_unselected", [False, True])
def test_selected_attention_op_registration(grad_unselected):
    q, k, v, keep, _ = test_nats_attention.make_inputs(1, 40, 2, 16, C=16, Dv=24, device="cpu")
    args = (*(t.requires_grad_() for t in (q, k, v, keep)), 0.25, 16, grad_unselected)
    torch.library.opcheck(attention_chunk.selected_attention_fwd_op, args)


@pytest.mark.parametrize("with_state", [False, True])
def test_selected_gdn_op_registration(with_state):
    q, k, v, g, beta, keep, h0 = test_nats_gdn.make_inputs(1, 100, 2, 16, 32, device="cpu")
    args = [t.requires_grad_() for t in (q, k, v, g, beta, keep)]
    torch.library.opcheck(gdn_chunk.selected_gdn_fwd_op,
                          (*args, 0.25, h0.requires_grad_() if with_state else None, with_state, True, False))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_caller_keeps_selected_attention_in_one_graph(device):
    q, k, v, keep, _ = test_nats_attention.make_inputs(2, 100, 2, 16, C=16, Dv=24, device=device)
    _compiled_matches_eager(lambda q, k, v, keep: (attention_chunk.chunk_selected_attention(
        q * 2, k, v, keep, chunk_size=16),), [q, k, v, keep])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_caller_keeps_selected_gdn_in_one_graph(device):
    q, k, v, g, beta, keep, h0 = test_nats_gdn.make_inputs(2, 100, 2, 16, 32, device=device)
    _compiled_matches_eager(lambda q, k, v, g, beta, keep, h0: gdn_chunk.chunk_selected_gdn(
        q, k, v * 2, g, beta, keep, initial_state=h0, output_final_state=True), [q, k, v, g, beta, keep, h0])


@pytest.mark.parametrize("with_state", [False, True])
def test_s4d_carry_op_registration(with_state):
    from megahybrid_kernels.interdomain.s4d_chunk import s4d_carry
    from tests.kernels.test_s4d_chunk import _walk_case

    u, _, x0, decay = _walk_case(False, N=3, M=8, D=12)
    torch.library.opcheck(s4d_carry, (u.requires_grad_(), decay.requires_grad_(),
                                      x0.requires_grad_() if with_state else None, 16, 5))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_caller_keeps_the_s4d_carry_in_one_graph(device):
    """The chunked S4D contraction compiled whole (fullgraph) against eager: output, final state, every gradient."""
    from megahybrid_kernels.interdomain.s4d_chunk import s4d_contraction_chunked
    from tests.kernels.test_s4d import _inputs

    x, decay, b, c, s0 = (t.to(device) for t in _inputs(T=100, M=8, D=12))
    _compiled_matches_eager(lambda *a: s4d_contraction_chunked(*a, output_final_state=True, chunk_size=32),
                            [x, decay, b, c, s0])


def test_tf32_bmm_op_registration():
    from megahybrid_kernels._triton import tf32_bmm

    g = torch.Generator().manual_seed(0)
    torch.library.opcheck(tf32_bmm, (torch.randn(3, 5, 4, generator=g).bfloat16(), torch.randn(3, 4, 6, generator=g)))


def _aten_targets_when_compiled(fn, args) -> list[str]:
    """The call targets of fn(*args)'s forward and backward graphs as AOT autograd traces them (its backward run)."""
    from torch._dynamo.backends.common import aot_autograd

    targets = []

    def record(gm, _):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record))(
        *[a.detach().clone().requires_grad_() for a in args])
    out.sum().backward()
    return targets


@pytest.mark.parametrize("which", ["shard-summary", "start-state-readout"])
def test_compiled_tf32_products_stay_tf32(which):
    """The CP shard summary's and the GDN shard correction's TF32 products compiled: every product is the
    megahybrid::tf32_bmm op, forward and backward (traced, tf32_products' switch was dropped and the products ran
    in full fp32 on the GPU), with eager's outputs and gradients."""
    from megahybrid.model.cp import _Tf32StateReadout
    from megahybrid_kernels.interdomain.s4d import _Tf32Sum

    g = torch.Generator().manual_seed(1)
    if which == "shard-summary":
        fn, args = _Tf32Sum.apply, (torch.randn(40, 3, 8, generator=g), torch.randn(2, 40, 3, 5, generator=g))
    else:
        fn = _Tf32StateReadout.apply
        args = (torch.randn(2, 40, 3, 8, generator=g), torch.randn(2, 3, 8, 5, generator=g))
    targets = _aten_targets_when_compiled(fn, args)
    assert targets.count("megahybrid.tf32_bmm.default") == 3, targets  # the product and both gradients
    assert not [t for t in targets if t.startswith(("aten.mm", "aten.bmm"))], targets
    _compiled_matches_eager(lambda a, b: (fn(a, b),), list(args))
