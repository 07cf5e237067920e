"""Chunkwise Interdomain Attention (README.md, "Chunkwise algorithm"): the host side of the Triton op.

`interdomain_fwd` / `interdomain_bwd` run the state scans (scan.py) and the readout kernels (readout.py) for one
call; the custom ops `megahybrid::interdomain_fwd` / `_bwd` tie them into autograd and torch.compile;
`interdomain_attention` is the public op, which sends CPU
tensors (and the cases `uses_torch_path` names) to the chunked torch path in torch_chunk.py. Every launch takes
its tuning knobs from one `InterdomainPlan` (utils.py), so a benchmark sweeps plans without touching module state.
"""
import torch
import triton

from megahybrid_kernels._triton import absent, present

from .checks import check_decay, check_inputs
from .naive import EPS, sign_nonzero
from .readout import readout_bwd_a, readout_fwd, readout_grad
from .scan import powers, scan, scan_layout
from .torch_chunk import interdomain_torch
from .utils import DEFAULT_PLAN, PLANS, InterdomainPlan, readout_p, uses_torch_path


def interdomain_fwd(q, k, v, decay, b, u0=None, g0=None, chunk_size=64, p=None,
                    plan: InterdomainPlan = DEFAULT_PLAN):
    """Forward. q, k [B, T, H, K], v [B, T, H, V]; u0/g0 [B, H, 2, M, K/V] fp32 or None; p: the readout's
    P = C^T conj(C) as [H, M, M, 2] fp32, or None (identity).

    Returns o [B, T, H, V], the final U, G [B, H, 2, M, K/V] fp32, the U and G scans' segment start states (None
    unsegmented; small: one state per plan.scan_segment chunks) and, with plan.keep_states, the chunk-boundary
    states U, G [B, H, NC, 2, M, K/V] themselves (else None, None): what the backward needs of this pass."""
    C = chunk_size
    pw = powers(decay, C)
    ub, uf, su = scan(k, b, pw, decay, C, x0=u0, plan=plan)
    gb, gf, sg = scan(v, b, pw, decay, C, x0=g0, plan=plan)
    o = torch.empty_like(v)
    readout_fwd(q, k, v, ub, gb, b, pw, o, C, p=p, plan=plan)
    return o, uf, gf, (su, sg), (ub, gb) if plan.keep_states else (None, None)


def interdomain_bwd(q, k, v, decay, b, u0, g0, do, duf, dgf, chunk_size=64, starts=(None, None), p=None,
                    plan: InterdomainPlan = DEFAULT_PLAN, kept=(None, None)):
    """Backward: dq, dk, dv, ddecay, db, du0, dg0 (du0/dg0 None when there was no initial state), dp (None without
    a readout). starts: the forward's segment start states (interdomain_fwd), so that recomputing its states takes
    one pass over k and v; kept: the forward's chunk-boundary states (plan.keep_states), which skip that pass."""
    B, T, H, _ = q.shape
    C, M, NC = chunk_size, b.shape[1], triton.cdiv(T, chunk_size)
    pw = powers(decay, C)
    ub, gb = kept
    if ub is None:
        ub, _, _ = scan(k, b, pw, decay, C, x0=u0, starts=starts[0], plan=plan)
        gb, _, _ = scan(v, b, pw, decay, C, x0=g0, starts=starts[1], plan=plan)
    # a and da feed bf16 products and scan coefficients only, so a 16-bit copy of bf16 runs loses nothing
    cdt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    a = q.new_empty(B, T, H, 2, M, dtype=cdt)
    da = q.new_empty(B, T, H, 2, M, dtype=cdt)
    part_a = q.new_empty(B, H, NC, 4, M, dtype=torch.float32)
    dp = None
    if p is None:
        readout_bwd_a(q, k, v, do, ub, gb, b, pw, C, a=a, da=da, part=part_a, plan=plan)
    else:
        araw, dar = torch.empty_like(a), torch.empty_like(a)  # bf16 runs: dP is a bf16 product (readout_p_grad)
        readout_bwd_a(q, k, v, do, ub, gb, b, pw, C, a=a, da=da, part=part_a, p=p, araw=araw, dar=dar, plan=plan)
        dp = readout_p_grad(araw, dar)
    rub, du0, _ = scan(q, b, pw, decay, C, c=da, x0=duf, rev=True, plan=plan)
    rgb, dg0, _ = scan(do, b, pw, decay, C, c=a, x0=dgf, rev=True, plan=plan)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    part_m = q.new_empty(2, B, H, NC, 4, M, dtype=torch.float32)  # the dk and dv shares; dq writes none
    for which, slot in (("dq", 0), ("dk", 0), ("dv", 1)):
        readout_grad(which, q, k, v, do, b, pw, C, a=a, da=da, ub=ub, gb=gb, rub=rub, rgb=rgb, dq=dq, dk=dk, dv=dv,
                     part=part_m[slot], plan=plan)
    sums = (part_a.double() + part_m.double().sum(0)).sum((0, 2))  # [H, 4, M]
    ddecay = torch.stack((sums[:, 2], sums[:, 3]), -1).float()
    dbb = torch.stack((sums[:, 0], sums[:, 1]), -1).float()
    return dq, dk, dv, ddecay, dbb, du0 if u0 is not None else None, dg0 if g0 is not None else None, dp


def readout_p_grad(araw: torch.Tensor, dar: torch.Tensor) -> torch.Tensor:
    """dP[h, m, n] = sum over tokens of conj(a_m) d(aP)_n, as [H, M, M, 2] (re, im) fp32, from araw, dar
    [B, T, H, 2, M]: one real product of the stacked (re, im) parts per head, accumulated in fp32.

    bf16 runs store araw, dar in bf16 and take the product on the tensor cores with an fp32 result (the precision
    of every other weight gradient of a bf16 run). The fp32 product ran cuBLAS's non-tensor-core kernel at 1.2 ms
    per 125M layer call on the H200, as slow as the complex einsum before it (1.4 ms)."""
    B, T, H, _, M = araw.shape
    a = araw.reshape(B * T, H, 2 * M).transpose(0, 1)  # [H, tokens, 2M]
    d = dar.reshape(B * T, H, 2 * M).transpose(0, 1)
    if a.dtype == torch.bfloat16 and a.is_cuda:
        g = torch.bmm(a.transpose(1, 2), d, out_dtype=torch.float32)  # [H, 2M, 2M]
    else:
        g = torch.bmm(a.transpose(1, 2).float(), d.float())
    rr, ri, ir, ii = g[:, :M, :M], g[:, :M, M:], g[:, M:, :M], g[:, M:, M:]  # blocks (re re, re im; im re, im im)
    return torch.stack((rr + ii, ri - ir), -1)


# The op enters autograd and torch.compile as two custom ops: a compiled model then keeps each Interdomain layer in
# one graph with the op an opaque node in it. (torch.compiler.disable, used before, broke the graph once per frame
# on the stack: four extra graphs per layer, whose per-call host cost left the H200 idle 25% of a 125M step.) The
# plan, not a tensor, travels as its index into PLANS (plan.plan_id).


@torch.library.custom_op("megahybrid::interdomain_fwd", mutates_args=())
def interdomain_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, b: torch.Tensor,
                       u0: torch.Tensor | None, g0: torch.Tensor | None, p: torch.Tensor | None, chunk_size: int,
                       plan_id: int, check_values: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """interdomain_fwd on contiguous inputs: o, the final U and G, then what the backward takes back: the scans'
    segment start states (empty unsegmented or where the states are kept) and the kept chunk-boundary states
    (empty without plan.keep_states)."""
    if check_values:
        check_decay(decay)
    o, uf, gf, starts, kept = interdomain_fwd(q, k, v, decay, b, u0, g0, chunk_size, p, PLANS[plan_id])
    if kept[0] is not None:
        starts = (None, None)  # the backward recomputes nothing: the starts need not be kept
    return o, uf, gf, *(absent(q) if t is None else t for t in starts + kept)


def _starts_shape(z, b, chunk_size, plan):
    B, T, H, D = z.shape
    M, NC = b.shape[1], triton.cdiv(T, chunk_size)
    NS = triton.cdiv(NC, scan_layout(B, H, D, M, NC, plan)[0])
    return (B, H, NS, 2, M, D) if NS > 1 and not plan.keep_states else (0,)


def _kept(z, b, chunk_size, plan):
    """The fake of a kept chunk-boundary state (z's dtype) or of its empty stand-in."""
    if not plan.keep_states:
        return absent(z)
    B, T, H, D = z.shape
    return z.new_empty(B, H, triton.cdiv(T, chunk_size), 2, b.shape[1], D)


@interdomain_fwd_op.register_fake
def _(q, k, v, decay, b, u0, g0, p, chunk_size, plan_id, check_values=True):
    B, T, H, K = q.shape
    M, V, plan = b.shape[1], v.shape[-1], PLANS[plan_id]
    f32 = dict(dtype=torch.float32)
    return (torch.empty_like(v), q.new_empty(B, H, 2, M, K, **f32), q.new_empty(B, H, 2, M, V, **f32),
            q.new_empty(_starts_shape(k, b, chunk_size, plan), **f32),
            q.new_empty(_starts_shape(v, b, chunk_size, plan), **f32), _kept(k, b, chunk_size, plan),
            _kept(v, b, chunk_size, plan))


@torch.library.custom_op("megahybrid::interdomain_bwd", mutates_args=())
def interdomain_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, b: torch.Tensor,
                       u0: torch.Tensor | None, g0: torch.Tensor | None, p: torch.Tensor | None, su: torch.Tensor,
                       sg: torch.Tensor, ub: torch.Tensor, gb: torch.Tensor, do: torch.Tensor,
                       duf: torch.Tensor | None, dgf: torch.Tensor | None, chunk_size: int,
                       plan_id: int) -> list[torch.Tensor]:
    """interdomain_bwd: dq, dk, dv, ddecay, db, du0, dg0, dp (the last three empty where their input was None)."""
    grads = interdomain_bwd(q, k, v, decay, b, u0, g0, do, duf, dgf, chunk_size,
                            (present(su), present(sg)), p, PLANS[plan_id], (present(ub), present(gb)))
    return [absent(q) if g is None else g for g in grads]


@interdomain_bwd_op.register_fake
def _(q, k, v, decay, b, u0, g0, p, su, sg, ub, gb, do, duf, dgf, chunk_size, plan_id):
    like = lambda t: absent(q) if t is None else torch.empty_like(t)  # noqa: E731
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(decay),
            torch.empty_like(b), like(u0), like(g0), like(p)]


def _setup_context(ctx, inputs, output):
    q, k, v, decay, b, u0, g0, p, chunk_size, plan_id, *_ = inputs
    ctx.save_for_backward(q, k, v, decay, b, u0, g0, p, *output[3:7])
    ctx.chunk_size, ctx.plan_id = chunk_size, plan_id


def _backward(ctx, do, duf, dgf, *_unused):  # no gradient flows into the starts or the kept states
    q, k, v, decay, b, u0, g0, p, su, sg, ub, gb = ctx.saved_tensors
    dq, dk, dv, ddecay, db, du0, dg0, dp = interdomain_bwd_op(
        q, k, v, decay, b, u0, g0, p, su, sg, ub, gb, do.contiguous(), _opt(duf), _opt(dgf), ctx.chunk_size,
        ctx.plan_id)
    return (dq, dk, dv, ddecay, db, du0 if u0 is not None else None, dg0 if g0 is not None else None,
            dp if p is not None else None, None, None, None)


interdomain_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _opt(t):
    return None if t is None else t.contiguous().float()


@torch.compiler.disable
def _torch_path(q, k, v, decay, b, u0, g0, chunk_size, readout, check_values):
    """The chunked torch path, eager inside a compiled model (complex tensors; inductor would gain nothing)."""
    if check_values:
        check_decay(decay)
    return interdomain_torch(q, k, v, decay, b, u0, g0, chunk_size, readout)


def interdomain_attention(q, k, v, decay, b, initial_state=None, output_final_state=False, normalize=False,
                          chunk_size=64, readout=None, plan: InterdomainPlan | None = None, check_values=True):
    """Interdomain Attention (see kernels/interdomain/README.md for the definition).

    Args:
        q, k: [B, T, H, K] query / key features; v: [B, T, H, V]; one dtype among fp32, bf16, fp16.
        decay: [H, M, 2] fp32 = (log|lambda| <= 0, arg lambda); b: [H, M, 2] fp32 = (Re b, Im b).
        initial_state: (U [B, H, M, 2, K], G [B, H, M, 2, V]) fp32, plus eta [B, H, M, 2] with `normalize`.
        normalize: divide by sum_m Re(a conj eta) + EPS * sign (sign(0) = +1).
        chunk_size: tokens per chunk (16, 32, 64 or 128); chunk-boundary states are the only states kept.
        readout: C [H, M, M, 2] fp32 (re, im) mixing the modes of U_t and Gamma_t before the query reads them; None
            is the identity. The Triton kernels carry C (a P per token, P = C^T conj(C)); with the normalized
            readout a C on the GPU runs the chunked torch path (torch_chunk.py) instead (InterdomainPlan says why).
        plan: the kernels' tuning knobs (None: DEFAULT_PLAN, as measured); results do not depend on it.
        check_values: check decay's values (log|lambda| <= 0, else ValueError). On a GPU reading a new tensor's
            values syncs the host, so a caller whose decay is <= 0 by construction (the `I` layer's -exp(.) real
            part) passes False; shapes and dtypes are always checked.
    Returns:
        o [B, T, H, V] in v's dtype and the final state (same layout as initial_state) or None.
    On CPU tensors the op runs the chunked torch path unless TRITON_INTERPRET=1 (which runs the Triton kernels in
    the interpreter, as their tests do).
    """
    plan = plan or DEFAULT_PLAN
    check_inputs(q, k, v, decay, b, initial_state, normalize, chunk_size, readout, values=False)  # values: in the op
    B, T, H, _ = q.shape
    V = v.shape[-1]
    if normalize:
        v = torch.cat((v, v.new_ones(B, T, H, 1)), -1)
        if initial_state is not None:
            g, eta = initial_state[1], initial_state[2]
            initial_state = (initial_state[0], torch.cat((g, eta[..., None]), -1))
    u0 = g0 = None
    if initial_state is not None:
        u0 = initial_state[0].transpose(2, 3).contiguous()
        g0 = initial_state[1].transpose(2, 3).contiguous()
    if uses_torch_path(q, readout, normalize, plan):
        o, uf, gf = _torch_path(q, k, v, decay, b, u0, g0, chunk_size, readout, check_values)
    else:
        o, uf, gf, *_ = interdomain_fwd_op(q.contiguous(), k.contiguous(), v.contiguous(), decay.contiguous(),
                                           b.contiguous(), u0, g0, readout_p(readout), chunk_size, plan.plan_id,
                                           check_values)
    state = (uf.transpose(2, 3).contiguous(), gf.transpose(2, 3).contiguous()) if output_final_state else None
    if normalize:
        den = o[..., V:].float()
        o = (o[..., :V].float() / (den + EPS * sign_nonzero(den))).to(o.dtype)
        if state is not None:
            state = (state[0], state[1][..., :V].contiguous(), state[1][..., V].contiguous())
    return o, state
