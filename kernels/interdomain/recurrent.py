"""Fused recurrent Interdomain Attention for decoding and short prompts (forward only, see README.md, "Decoding").

One Triton program per (V tile, batch row, head) walks the T tokens in order and keeps the complex states
U [M, 2, K], the Gamma tile [M, 2, BV] and eta [M, 2] in fp32 registers, so only q_t, k_t, v_t are read and o_t
written per token, plus the initial state once and the final state once. Every V tile recomputes U (M·K work
per token, cheap next to the state traffic a split would add); the V tile 0 program alone writes U and eta.

Names (complex values as (re, im) pairs `*r`, `*i`):
  q, k [B, T, H, K]; v, o [B, T, H, V]   inputs and output; qt, kt, vt: token t's rows, pqk, pvo: their offsets
  ur, ui [BM, BK]; gr, gi [BM, BV]        the states U and this program's Gamma tile; er, ei [BM]: eta
  u0 / g0 / e0, uf / gf / ef              initial and final states [B, H, M, 2, K / V] and [B, H, M, 2] fp32
  lr, li; br, bi [BM]                     lambda and b per mode (padded modes: lambda = 0, b = 0)
  pr, pi [BM, BM]                         the readout P = C^T conj(C) (HAS_READOUT); ar, ai: the query's a (times P)
  om, ok, ov / mm, mk, mv                 mode, key and value offsets of the tiles / their masks
  BM, BK, BV                              tiles (launch_config); NORMALIZE: divide by Re(a conj eta) + eps * sign
"""

import torch
import triton
import triton.language as tl

from megahybrid_kernels._triton import interpreting

from .checks import check_inputs
from .chunk import interdomain_attention
from .naive import EPS
from .utils import DEFAULT_PLAN, InterdomainPlan, readout_p, uses_torch_path


@triton.jit
def _token(q_ptr, k_ptr, v_ptr, o_ptr, pqk, pvo, t, H, K, V, mk, mv, eps, lr, li, br, bi, ur, ui, gr, gi, er, ei,
           pr, pi, NORMALIZE: tl.constexpr, HAS_READOUT: tl.constexpr):
    """Token t: advance U, the Gamma tile and eta by one step, then write o_t's V tile (with a readout C, read by
    a P, P = C^T conj(C): README.md, "Full readout")."""
    qt = tl.load(q_ptr + pqk + t * H * K, mask=mk, other=0.0).to(tl.float32)[None, :]
    kt = tl.load(k_ptr + pqk + t * H * K, mask=mk, other=0.0).to(tl.float32)[None, :]
    vt = tl.load(v_ptr + pvo + t * H * V, mask=mv, other=0.0).to(tl.float32)[None, :]
    lr2, li2, br2, bi2 = lr[:, None], li[:, None], br[:, None], bi[:, None]
    ur, ui = lr2 * ur - li2 * ui + br2 * kt, lr2 * ui + li2 * ur + bi2 * kt
    gr, gi = lr2 * gr - li2 * gi + br2 * vt, lr2 * gi + li2 * gr + bi2 * vt
    ar, ai = tl.sum(ur * qt, axis=1), tl.sum(ui * qt, axis=1)
    if HAS_READOUT:
        ar, ai = (tl.sum(ar[:, None] * pr - ai[:, None] * pi, axis=0),
                  tl.sum(ar[:, None] * pi + ai[:, None] * pr, axis=0))
    o = tl.sum(ar[:, None] * gr + ai[:, None] * gi, axis=0)
    if NORMALIZE:
        er, ei = lr * er - li * ei + br, lr * ei + li * er + bi
        den = tl.sum(ar * er + ai * ei, axis=0)
        o = o / (den + tl.where(den >= 0, eps, -eps))
    tl.store(o_ptr + pvo + t * H * V, o.to(o_ptr.dtype.element_ty), mask=mv)
    return ur, ui, gr, gi, er, ei


@triton.jit
def _fused_recurrent_fwd_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, b_ptr, u0_ptr, g0_ptr, e0_ptr, p_ptr,
                                o_ptr, uf_ptr, gf_ptr, ef_ptr, T, H, M, K, V, eps,
                                BM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr,
                                NORMALIZE: tl.constexpr, STORE_FINAL: tl.constexpr, INTERPRET: tl.constexpr,
                                HAS_READOUT: tl.constexpr = False):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    om, ok = tl.arange(0, BM), tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mm, mk, mv = om < M, ok < K, ov < V
    # padded modes get lambda = 0 and b = 0, so their rows stay zero and add nothing to o or den
    al = tl.load(decay_ptr + (i_h * M + om) * 2, mask=mm, other=float("-inf"))
    th = tl.load(decay_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)
    lr, li = tl.exp(al) * tl.cos(th), tl.exp(al) * tl.sin(th)
    br = tl.load(b_ptr + (i_h * M + om) * 2, mask=mm, other=0.0)
    bi = tl.load(b_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)
    if HAS_READOUT:
        pp = ((i_h * M + om[:, None]) * M + om[None, :]) * 2
        pr = tl.load(p_ptr + pp, mask=mm[:, None] & mm[None, :], other=0.0)
        pi = tl.load(p_ptr + pp + 1, mask=mm[:, None] & mm[None, :], other=0.0)
    else:
        pr, pi = lr, li  # unused

    pu = (i_bh * M + om[:, None]) * 2 * K + ok[None, :]
    pg = (i_bh * M + om[:, None]) * 2 * V + ov[None, :]
    pe = (i_bh * M + om) * 2
    mu, mg = mm[:, None] & mk[None, :], mm[:, None] & mv[None, :]
    if HAS_INIT:
        ur, ui = tl.load(u0_ptr + pu, mask=mu, other=0.0), tl.load(u0_ptr + pu + K, mask=mu, other=0.0)
        gr, gi = tl.load(g0_ptr + pg, mask=mg, other=0.0), tl.load(g0_ptr + pg + V, mask=mg, other=0.0)
    else:
        ur, ui = tl.zeros([BM, BK], tl.float32), tl.zeros([BM, BK], tl.float32)
        gr, gi = tl.zeros([BM, BV], tl.float32), tl.zeros([BM, BV], tl.float32)
    er, ei = tl.zeros([BM], tl.float32), tl.zeros([BM], tl.float32)
    if NORMALIZE and HAS_INIT:
        er, ei = tl.load(e0_ptr + pe, mask=mm, other=0.0), tl.load(e0_ptr + pe + 1, mask=mm, other=0.0)

    pqk = (i_b * T * H + i_h) * K + ok
    pvo = (i_b * T * H + i_h) * V + ov
    # the interpreter (numpy >= 2.4) cannot take a runtime range() bound; compiled code keeps the for loop
    if INTERPRET:
        t = 0
        while t < T:
            ur, ui, gr, gi, er, ei = _token(q_ptr, k_ptr, v_ptr, o_ptr, pqk, pvo, t, H, K, V, mk, mv, eps, lr, li,
                                            br, bi, ur, ui, gr, gi, er, ei, pr, pi, NORMALIZE, HAS_READOUT)
            t += 1
    else:
        for t in range(T):
            ur, ui, gr, gi, er, ei = _token(q_ptr, k_ptr, v_ptr, o_ptr, pqk, pvo, t, H, K, V, mk, mv, eps, lr, li,
                                            br, bi, ur, ui, gr, gi, er, ei, pr, pi, NORMALIZE, HAS_READOUT)

    if STORE_FINAL:
        tl.store(gf_ptr + pg, gr, mask=mg)
        tl.store(gf_ptr + pg + V, gi, mask=mg)
        if i_v == 0:
            tl.store(uf_ptr + pu, ur, mask=mu)
            tl.store(uf_ptr + pu + K, ui, mask=mu)
            if NORMALIZE:
                tl.store(ef_ptr + pe, er, mask=mm)
                tl.store(ef_ptr + pe + 1, ei, mask=mm)


def launch_config(B, H, M, K, V, block_v=None):
    """Block sizes and warps: V tiles shrink (down to 16) until B·H·tiles fills ~128 SMs; warps keep the fp32
    state near 64 registers per thread."""
    BM, BK = max(2, triton.next_power_of_2(M)), max(16, triton.next_power_of_2(K))
    BV = block_v or min(64, max(16, triton.next_power_of_2(V)))
    while block_v is None and BV > 16 and B * H * triton.cdiv(V, BV) < 128:
        BV //= 2
    state = 2 * BM * (BK + BV)
    num_warps = min(16, max(1, triton.next_power_of_2(triton.cdiv(state, 32 * 64))))
    return dict(BM=BM, BK=BK, BV=BV, num_warps=num_warps)


def interdomain_recurrent_fwd(q, k, v, decay, b, initial_state, normalize, output_final_state=True,
                              block_v=None, readout=None):
    """Fused recurrent forward on checked inputs. q, k [B, T, H, K]; v [B, T, H, V]; returns o, final state."""
    B, T, H, K = q.shape
    V, M = v.shape[-1], decay.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cfg = launch_config(B, H, M, K, V, block_v)
    o = torch.empty_like(v)
    uf = q.new_empty(B, H, M, 2, K, dtype=torch.float32)
    gf = q.new_empty(B, H, M, 2, V, dtype=torch.float32)
    ef = q.new_empty(B, H, M, 2, dtype=torch.float32) if normalize else uf
    init = [s.contiguous() for s in initial_state] if initial_state is not None else [uf, gf, ef]
    e0 = init[2] if normalize else init[0]
    grid = (triton.cdiv(V, cfg["BV"]), B * H)
    p = readout_p(readout) if readout is not None else e0
    _fused_recurrent_fwd_kernel[grid](q_ptr=q, k_ptr=k, v_ptr=v, decay_ptr=decay.contiguous(), b_ptr=b.contiguous(),
                                      u0_ptr=init[0], g0_ptr=init[1], e0_ptr=e0, p_ptr=p, o_ptr=o, uf_ptr=uf,
                                      gf_ptr=gf, ef_ptr=ef, T=T, H=H, M=M, K=K, V=V, eps=EPS,
                                      HAS_INIT=initial_state is not None, NORMALIZE=normalize,
                                      STORE_FINAL=output_final_state, INTERPRET=interpreting(),
                                      HAS_READOUT=readout is not None, **cfg)
    if not output_final_state:
        return o, None
    return o, (uf, gf, ef) if normalize else (uf, gf)


def interdomain_recurrent(q, k, v, decay, b, initial_state=None, normalize=None, readout=None,
                          plan: InterdomainPlan | None = None):
    """Interdomain Attention for short prompts and decoding, token by token in one fused kernel.

    Forward only: under grad mode with any input requiring grad the call goes to the differentiable chunk op
    `interdomain_attention` (same definition, same results within fp32 rounding). On a CPU tensor outside the
    Triton interpreter the chunk op's torch path runs instead of the fused kernel (one chunk of T tokens for
    T <= 64). A readout is applied in the kernel (a P per token) unless plan.fused_readout is off.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (fp32, bf16 or fp16, one dtype); decay, b: [H, M, 2] fp32.
        initial_state: None (zeros) or (U [B, H, M, 2, K], G [B, H, M, 2, V]) fp32, plus eta [B, H, M, 2]
            for the normalized readout.
        normalize: the normalized readout; None means "initial_state has eta".
        readout: C [H, M, M, 2] fp32 or None (identity), as in `interdomain_attention`.
        plan: tuning knobs (None: DEFAULT_PLAN), passed on to the chunk op where it runs.
    Returns:
        o [B, T, H, V] in v's dtype and the final state in initial_state's layout.
    """
    plan = plan or DEFAULT_PLAN
    if normalize is None:
        normalize = initial_state is not None and len(initial_state) == 3
    check_inputs(q, k, v, decay, b, initial_state, normalize, 64, readout)
    inputs = [q, k, v, decay, b, *(initial_state or ()), *([readout] if readout is not None else [])]
    torch_path = uses_torch_path(q) or (readout is not None and not plan.fused_readout)
    if torch_path or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return interdomain_attention(q, k, v, decay, b, initial_state, True, normalize, readout=readout, plan=plan)
    return interdomain_recurrent_fwd(q, k, v, decay, b, initial_state, normalize, readout=readout)


def interdomain_step(q, k, v, decay, b, state, readout=None):
    """One decoding token: the fused recurrent kernel with T = 1.

    Args:
        q, k: [B, H, K]; v: [B, H, V]; decay, b: [H, M, 2] fp32.
        state: (U [B, H, M, 2, K], G [B, H, M, 2, V]) fp32, plus eta [B, H, M, 2] for the normalized readout;
            None means a zero state without normalization.
        readout: C [H, M, M, 2] fp32 or None (identity).
    Returns:
        o [B, H, V] in v's dtype and the new state tuple (new tensors; the inputs are not modified).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"interdomain_step takes one token: q, k [B, H, K], v [B, H, V] (no T axis); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    o, state = interdomain_recurrent(q[:, None], k[:, None], v[:, None], decay, b, state, readout=readout)
    return o[:, 0], state
