"""The backward's first readout with a readout P in two mode-tiled launches (InterdomainPlan.bwd_a_split_tile).

P mixes every mode, so _bwd_a_mixed_kernel (readout.py) takes all M modes as one tile: at M = 64 it holds a, da,
their inter-chunk parts and two sheared [C, C] products at once, spills, and took 2.60 of 7.19 ms fwd+bwd at
12 x 64, 4K on the H200 (kernels/interdomain/README.md). Here each program owns one tile of BM modes:
  _bwd_a_raw_kernel   the unmixed a and d(a P) of its tile (araw, dar), the two readouts of _bwd_a without mixing
  _bwd_a_mix_kernel   its tile of a P and da = d(a P) P^H from all of araw and dar (complex [C, M] x [M, BM]
                      products), stored in a and da, then its tile's intra-chunk parameter partials, with the
                      sheared Q K^T, dO V^T and the inter-chunk parts recomputed (one [C, C] product per side)
Results equal _bwd_a_mixed_kernel's (the tests run both against naive.py).

Names as in readout.py's legend (each program's mode tile om: program_id(2)), and on / mn [MP] every mode (padded to
MP) and its mask.
"""
import triton
import triton.language as tl

from megahybrid_kernels._triton import next_pow2

from .readout import _chunk_program, _lag_partials, _mix_modes, _readout_a, _store_pair
from .utils import DEFAULT_PLAN, InterdomainPlan


@triton.jit
def _bwd_a_raw_kernel(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, araw_ptr, dar_ptr, T, NC, H, M,
                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, PREC: tl.constexpr):
    ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi = _chunk_program(b_ptr, pw_ptr, T, H, M, C, BM, TILED=True)
    out = rows[:, None] * 2 * M + om[None, :]
    mo = ok[:, None] & mm[None, :]
    ub = ub_ptr + (i_bh * NC + ic) * 2 * M * K
    ar, ai, _, _, _ = _readout_a(x_ptr=q_ptr, z_ptr=k_ptr, sb=ub, pw=pw, br=br[None, :], bi=bi[None, :], rows=rows,
                                 ok=ok, oc=oc, om=om, mm=mm, M=M, D=K, C=C, BD=BK, BM=BM, PREC=PREC)
    _store_pair(araw_ptr, out, ar, ai, mo, M)
    gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
    gr, gi, _, _, _ = _readout_a(x_ptr=do_ptr, z_ptr=v_ptr, sb=gb, pw=pw, br=br[None, :], bi=bi[None, :], rows=rows,
                                 ok=ok, oc=oc, om=om, mm=mm, M=M, D=V, C=C, BD=BV, BM=BM, PREC=PREC)
    _store_pair(dar_ptr, out, gr, gi, mo, M)


@triton.jit
def _mix_tile(x_ptr, p_ptr, rows, ok, om, mm, i_h, M, MP: tl.constexpr, PREC: tl.constexpr,
              ADJOINT: tl.constexpr):
    """Columns om of x P (ADJOINT: x P^H) for the chunk's rows of x [B, T, H, 2, M], all M modes read."""
    on = tl.arange(0, MP)
    mn = on < M
    xp = x_ptr + rows[:, None] * 2 * M + on[None, :]
    mx = ok[:, None] & mn[None, :]
    # the stored dtype as it is: the H200 gave a wrong dq in bf16 (relative RMS 1.09 at M = 32) and an illegal address
    # at 12 x 64, M = 64 with these bf16 tiles upcast to fp32 for a tf32 product (session 16)
    xr = tl.load(xp, mask=mx, other=0.0)
    xi = tl.load(xp + M, mask=mx, other=0.0)
    return _mix_modes(xr=xr, xi=xi, p_ptr=p_ptr, i_h=i_h, on=on, mn=mn, om=om, mm=mm, M=M, PREC=PREC,
                      ADJOINT=ADJOINT)


@triton.jit
def _bwd_a_mix_kernel(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, p_ptr,
                      araw_ptr, dar_ptr, T, NC, H, M, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, MP: tl.constexpr, PREC: tl.constexpr):
    ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi = _chunk_program(b_ptr, pw_ptr, T, H, M, C, BM, TILED=True)
    DT = q_ptr.dtype.element_ty
    out = rows[:, None] * 2 * M + om[None, :]
    mo = ok[:, None] & mm[None, :]
    ar, ai = _mix_tile(x_ptr=araw_ptr, p_ptr=p_ptr, rows=rows, ok=ok, om=om, mm=mm, i_h=i_h, M=M, MP=MP, PREC=PREC,
                       ADJOINT=False)
    _store_pair(a_ptr, out, ar, ai, mo, M)
    gr, gi = _mix_tile(x_ptr=dar_ptr, p_ptr=p_ptr, rows=rows, ok=ok, om=om, mm=mm, i_h=i_h, M=M, MP=MP, PREC=PREC,
                       ADJOINT=True)
    _store_pair(da_ptr, out, gr, gi, mo, M)
    # d(log lam), intra-chunk x inter-chunk: sum_t (j+1) [da conj(a_inter) + (a P) conj(d(a P)_inter)], as _bwd_a
    ub = ub_ptr + (i_bh * NC + ic) * 2 * M * K
    par, pai, _, _, shq = _readout_a(x_ptr=q_ptr, z_ptr=k_ptr, sb=ub, pw=pw, br=br[None, :], bi=bi[None, :],
                                     rows=rows, ok=ok, oc=oc, om=om, mm=mm, M=M, D=K, C=C, BD=BK, BM=BM, PREC=PREC,
                                     INTRA=False)
    wj = (oc + 1).to(tl.float32)[:, None]
    lr = tl.sum(wj * (gr * par + gi * pai), 0)
    li = tl.sum(wj * (gi * par - gr * pai), 0)
    gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
    pgr, pgi, _, _, shd = _readout_a(x_ptr=do_ptr, z_ptr=v_ptr, sb=gb, pw=pw, br=br[None, :], bi=bi[None, :],
                                     rows=rows, ok=ok, oc=oc, om=om, mm=mm, M=M, D=V, C=C, BD=BV, BM=BM, PREC=PREC,
                                     INTRA=False)
    lr += tl.sum(wj * (ar * pgr + ai * pgi), 0)
    li += tl.sum(wj * (ai * pgr - ar * pgi), 0)
    # lag sums from the transposed sheared readouts (transposes of gathers, not of dots: readout.py's _bwd_a)
    sh = tl.trans(shq)
    shg = tl.trans(shd)
    cr = tl.dot(sh, gr.to(DT), input_precision=PREC) + tl.dot(shg, ar.to(DT), input_precision=PREC)
    ci = tl.dot(sh, gi.to(DT), input_precision=PREC) + tl.dot(shg, ai.to(DT), input_precision=PREC)
    _lag_partials(part_ptr=part_ptr, cr=cr, ci=ci, lr=lr, li=li, pw=pw, br=br[None, :], bi=bi[None, :], oc=oc,
                  om=om, mm=mm, i_bh=i_bh, NC=NC, ic=ic, M=M)


def readout_bwd_a_split(q, k, v, do, ub, gb, b, pw, C, *, a, da, part, p, araw, dar, sizes: dict,
                        plan: InterdomainPlan = DEFAULT_PLAN):
    """readout.readout_bwd_a with a readout P in mode tiles of plan.bwd_a_split_tile (or narrower where M is);
    sizes: readout.tiles' entries. Returns the second launch's kernel."""
    B, T, H, _ = q.shape
    M, NC = b.shape[1], triton.cdiv(T, C)
    BM = min(sizes["BM"], plan.bwd_a_split_tile)
    grid = (NC, B * H, triton.cdiv(M, BM))
    common = dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, ub_ptr=ub, gb_ptr=gb, b_ptr=b, pw_ptr=pw, araw_ptr=araw,
                  dar_ptr=dar, T=T, NC=NC, H=H, M=M, C=C, **dict(sizes, BM=BM), num_warps=plan.warps("bwd_a"))
    _bwd_a_raw_kernel[grid](**common)
    return _bwd_a_mix_kernel[grid](**common, a_ptr=a, da_ptr=da, part_ptr=part, p_ptr=p, MP=next_pow2(M, 16))
