"""Readout kernels of the chunked Interdomain op: per (chunk of C tokens, batch row, head) program, the output o and
the backward's per-token coefficients and gradients from the chunk-start states that scan.py stored.

Every product is [C, .]-shaped. Intra-chunk decays are never factored: sums of the form sum_{s<=t} A[t, s]
lam^(t-s) are taken over the lag n = t - s, whose coefficient lam^n (n >= 0) is exact in range, by shearing the
[C, C] matrix with tl.gather (D[t, n] = A[t, t - n]) and multiplying by the [C, 2M] table of lam^n; the o-side
builds W'[t, n] = sum_m Re(a_t conj(b lam^n)) as a product and shears it back (W[t, s] = W'[t, t - s]). Kernels:
  _fwd_kernel          o from (q, k, U_c) and (v, Gamma_c); _fwd_mixed_kernel with a readout P
  _bwd_a_kernel        a and da per token, plus the intra-chunk parts of d(log lam) and db; _bwd_a_mixed_kernel
                       with a readout P
  _bwd_part_kernel     dq, dk or dv (one launch each), the dk and dv launches with their shares of the state parts
                       of d(log lam) and db
With mode tiles narrower than InterdomainPlan.fwd_stack_below the forward takes its products over the modes on
interleaved [., 2 BM] operands (STACK).

Names (complex values as (re, im) pairs `*r`, `*i`; j = t - chunk start, the token's place in its chunk):
  q, k [B, T, H, K]; v, o, do [B, T, H, V]   queries, keys, values, output, output gradient (x, z: either pair)
  ub, gb [B, H, NC, 2, M, K / V]   chunk-start states U_c (of k) and Gamma_c (of v); in a kernel this chunk's
                                   [2, M, D] block (sb: the state block a helper reads)
  rub, rgb                         the reverse (adjoint) states of the q and dO scans, same layout
  a, da [B, T, H, 2, M]            a_t[m] = q_t . U_t[m] (times P with a readout) and its gradient d(a)_t, the dO
                                   side's readout of Gamma; gr, gi: da in registers
  araw, dar [B, T, H, 2, M]        the unmixed a and d(a P) (MIXED), for dP on the host (a's dtype)
  p [H, M, M, 2]                   the readout P = C^T conj(C) (MIXED; ADJOINT: P^H)
  b [H, M, 2] / br, bi             input coefficient per mode
  pw / lam_pow(pw, n, ...)         one head's table lam^n, n = 0..C, [C + 1, 2, M]
  part [B, H, NC, 4, M] fp32       per-chunk parameter partials: Re db, Im db, Re d(log lam), Im d(log lam)
  W, wd, wt [C, C]                 intra-chunk weights W[t, s] = sum_m Re(a_t conj(b lam^(t-s))) (s <= t); wd: the
                                   same from da; wt: a transpose W^T; wp: W' before the shear back
  sheared, shq, shd [C, C]         D[t, n] = x_t . z_(t-n) (q K^T and dO V^T sheared by lag)
  ptr_, pti [BM, C] / pr_, pi_     (b lam^n)^T and b lam^n [C, BM]
  sr, si [C, BM]                   lam^(j+1); xr, xi: a conj(lam^(j+1)), what a token reads of the chunk-start state
  er, ei / yr, yi [C, BM]          lam^(L-1-j) and b lam^(L-1-j): a token's weight in the reverse state at chunk end
  zsr, zsi [C, BM]; sur, sui [BM]  Z S^T and sum_d S conj(U_c) (S: reverse state), for the parameter gradients
  m2, p2, mk2 [2 BM]               mode, part (0 re, 1 im) and mask of interleaved columns (STACK)
  rows, ok [C]                     the chunk's token rows of [B, T, H, .] and their in-range mask; L: its tokens
  ic, i_bh, i_h; oc, om, mm        chunk, b * H + h, head; in-chunk token and mode offsets, the mode mask
  K, V, BK, BV, BM, C, NC, T       head dims and their tiles, mode tile, chunk size, chunks, tokens
  PART                             1: dq, 2: dk, 4: dv; PREC: tl.dot input precision; DT: the inputs' dtype
"""

import triton
import triton.language as tl

from megahybrid_kernels._triton import dot_precision, interpreting, next_pow2

from .utils import DEFAULT_PLAN, InterdomainPlan, cmul, lam_pow


@triton.jit
def _lower(oc):
    """Causal mask (col <= row) and the shear index row - col (0 above the diagonal)."""
    low = oc[None, :] <= oc[:, None]
    return low, tl.where(low, oc[:, None] - oc[None, :], 0)


@triton.jit
def _upper(oc):
    """Anti-causal mask (col >= row) and the shear index col - row (0 below the diagonal)."""
    up = oc[None, :] >= oc[:, None]
    return up, tl.where(up, oc[None, :] - oc[:, None], 0)


@triton.jit
def _readout_a(x_ptr, z_ptr, sb, pw, br, bi, rows, ok, oc, om, mm, M, D: tl.constexpr, C: tl.constexpr,
               BD: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, STACK: tl.constexpr = False):
    """a_t = sum_{s<=t in chunk} b lam^(t-s) (x_t . z_s) + lam^(j+1) (x_t . S[m]) with S the chunk-start state.

    Returns (a re, a im, inter re, inter im) as [C, BM] fp32 and the sheared X Z^T, D[t, n] = x_t . z_(t-n), as
    [C, C] in x's dtype. STACK: the products against S and the power table take real and imaginary parts as one
    [., 2 BM] operand (columns interleaved: mode, then part), so that no product is BM = 32 wide."""
    DT = x_ptr.dtype.element_ty
    att = tl.zeros([C, C], dtype=tl.float32)
    if STACK:
        p2 = tl.zeros([C, 2 * BM], dtype=tl.float32)
        o2 = tl.arange(0, 2 * BM)
        m2, part = o2 // 2, o2 % 2
    else:
        pr = tl.zeros([C, BM], dtype=tl.float32)
        pi = tl.zeros([C, BM], dtype=tl.float32)
    for d0 in tl.static_range(0, D, BD):
        od = d0 + tl.arange(0, BD)
        md = od < D
        mrow = ok[:, None] & md[None, :]
        mcol = md[:, None] & ok[None, :]
        xt = tl.load(x_ptr + rows[:, None] * D + od[None, :], mask=mrow, other=0.0).to(DT)
        zc = tl.load(z_ptr + rows[None, :] * D + od[:, None], mask=mcol, other=0.0).to(DT)
        att += tl.dot(xt, zc, input_precision=PREC)
        if STACK:
            ps2 = sb + (part * M + m2)[None, :] * D + od[:, None]
            p2 += tl.dot(xt, tl.load(ps2, mask=md[:, None] & (m2 < M)[None, :], other=0.0).to(DT),
                         input_precision=PREC)
        else:
            ps = sb + om[None, :] * D + od[:, None]
            ms = md[:, None] & mm[None, :]
            pr += tl.dot(xt, tl.load(ps, mask=ms, other=0.0).to(DT), input_precision=PREC)
            pi += tl.dot(xt, tl.load(ps + M * D, mask=ms, other=0.0).to(DT), input_precision=PREC)
    low, gidx = _lower(oc)
    sheared = tl.where(low, tl.gather(att, gidx, 1), 0.0).to(DT)  # [t, n] = x_t . z_{t-n}
    if STACK:
        l2 = tl.load(pw + oc[:, None] * 2 * M + (part * M + m2)[None, :], mask=(m2 < M)[None, :], other=0.0)
        hr, hi = _split2(tl.dot(sheared, l2.to(DT), input_precision=PREC), C, BM)
        pr, pi = _split2(p2, C, BM)
    else:
        lr, li = lam_pow(pw, oc[:, None], om[None, :], mm[None, :], M)
        hr = tl.dot(sheared, lr.to(DT), input_precision=PREC)
        hi = tl.dot(sheared, li.to(DT), input_precision=PREC)
    sr, si = lam_pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
    pr, pi = cmul(sr, si, pr, pi)
    ar, ai = cmul(br, bi, hr, hi)
    return ar + pr, ai + pi, pr, pi, sheared


@triton.jit
def _split2(x, C: tl.constexpr, BM: tl.constexpr):
    """[C, 2 BM] with interleaved (mode, part) columns -> real and imaginary [C, BM]."""
    return tl.split(tl.reshape(x, [C, BM, 2]))


@triton.jit
def _join2(xr, xi, C: tl.constexpr, BM: tl.constexpr):
    """Real and imaginary [C, BM] -> [C, 2 BM] with interleaved (mode, part) columns."""
    return tl.reshape(tl.join(xr, xi), [C, 2 * BM])


@triton.jit
def _shear_lower(wp, oc):
    """W[t, s] = W'[t, t - s] for s <= t, 0 above the diagonal."""
    low, gidx = _lower(oc)
    return tl.where(low, tl.gather(wp, gidx, 1), 0.0)


@triton.jit
def _shear_upper(wp, oc):
    """W^T[t, s] = W'[s, s - t] for s >= t, 0 below the diagonal."""
    up, gidx = _upper(oc)
    return tl.where(up, tl.gather(wp, gidx, 0), 0.0)


@triton.jit
def _w_matrix(rr, ri, ptr_, pti, oc, DT, PREC: tl.constexpr):
    """W[t, s] = sum_m Re(r_t conj(b lam^(t-s))) for s <= t, from r [C, BM] and (b lam^n)^T [BM, C]."""
    wp = tl.dot(rr.to(DT), ptr_.to(DT), input_precision=PREC)
    wp += tl.dot(ri.to(DT), pti.to(DT), input_precision=PREC)
    return _shear_lower(wp, oc)


@triton.jit
def _w_matrix_t(pr_, pi_, rtr, rti, oc, DT, PREC: tl.constexpr):
    """W^T[t, s] = W[s, t] for s >= t, from b lam^n [C, BM] and r^T [BM, C]."""
    wp = tl.dot(pr_.to(DT), rtr.to(DT), input_precision=PREC)
    wp += tl.dot(pi_.to(DT), rti.to(DT), input_precision=PREC)
    return _shear_upper(wp, oc)


@triton.jit
def _chunk_program(b_ptr, pw_ptr, T, H, M, C: tl.constexpr, BM: tl.constexpr):
    """A readout program's chunk ic and (batch, head) row i_bh (head i_h); the chunk's token rows of [B, T, H, .]
    and their in-range mask; the mode tile and its mask; the head's power table and b (re, im)."""
    ic, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    oc = tl.arange(0, C)
    ok = ic * C + oc < T
    rows = (i_b * T + ic * C + oc) * H + i_h
    om = tl.arange(0, BM)
    mm = om < M
    pw = pw_ptr + i_h * (C + 1) * 2 * M
    br = tl.load(b_ptr + (i_h * M + om) * 2, mask=mm, other=0.0)
    bi = tl.load(b_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)
    return ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, o_ptr, T, NC, H, M,
                K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, PREC: tl.constexpr, STACK: tl.constexpr = False):
    ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi = _chunk_program(b_ptr, pw_ptr, T, H, M, C, BM)
    DT = q_ptr.dtype.element_ty
    ub = ub_ptr + (i_bh * NC + ic) * 2 * M * K
    ar, ai, _, _, _ = _readout_a(x_ptr=q_ptr, z_ptr=k_ptr, sb=ub, pw=pw, br=br[None, :], bi=bi[None, :], rows=rows,
                                 ok=ok, oc=oc, om=om, mm=mm, M=M, D=K, C=C, BD=BK, BM=BM, PREC=PREC, STACK=STACK)
    if STACK:
        gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
        _fwd_o_stacked(v_ptr=v_ptr, o_ptr=o_ptr, gb=gb, b_ptr=b_ptr, pw=pw, ar=ar, ai=ai, rows=rows, ok=ok, oc=oc,
                       om=om, mm=mm, i_h=i_h, M=M, V=V, C=C, BM=BM, BV=BV, PREC=PREC)
    else:
        ptr_, pti = lam_pow(pw, oc[None, :], om[:, None], mm[:, None], M)
        ptr_, pti = cmul(br[:, None], bi[:, None], ptr_, pti)
        w = _w_matrix(ar, ai, ptr_, pti, oc, DT, PREC).to(DT)
        sr, si = lam_pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
        xr, xi = cmul(ar, ai, sr, -si)
        xr = xr.to(DT)
        xi = xi.to(DT)
        gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
        for d0 in tl.static_range(0, V, BV):
            od = d0 + tl.arange(0, BV)
            md = od < V
            mrow = ok[:, None] & md[None, :]
            pg = gb + om[:, None] * V + od[None, :]
            mg = mm[:, None] & md[None, :]
            acc = tl.dot(xr, tl.load(pg, mask=mg, other=0.0).to(DT), input_precision=PREC)
            acc += tl.dot(xi, tl.load(pg + M * V, mask=mg, other=0.0).to(DT), input_precision=PREC)
            vt = tl.load(v_ptr + rows[:, None] * V + od[None, :], mask=mrow, other=0.0).to(DT)
            acc += tl.dot(w, vt, input_precision=PREC)
            tl.store(o_ptr + rows[:, None] * V + od[None, :], acc.to(o_ptr.dtype.element_ty), mask=mrow)


@triton.jit
def _fwd_mixed_kernel(q_ptr, k_ptr, v_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, p_ptr, o_ptr, T, NC, H, M,
                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr):
    """_fwd_kernel with the readout P [H, M, M, 2] (re, im): o reads a P instead of a (README.md, "Full readout");
    on stacked operands at every mode tile."""
    ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi = _chunk_program(b_ptr, pw_ptr, T, H, M, C, BM)
    ub = ub_ptr + (i_bh * NC + ic) * 2 * M * K
    ar, ai, _, _, _ = _readout_a(x_ptr=q_ptr, z_ptr=k_ptr, sb=ub, pw=pw, br=br[None, :], bi=bi[None, :], rows=rows,
                                 ok=ok, oc=oc, om=om, mm=mm, M=M, D=K, C=C, BD=BK, BM=BM, PREC=PREC, STACK=True)
    ar, ai = _mix_modes(xr=ar, xi=ai, p_ptr=p_ptr, i_h=i_h, om=om, mm=mm, M=M, PREC=PREC, ADJOINT=False, LOW=LOW,
                        DT=q_ptr.dtype.element_ty)
    gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
    _fwd_o_stacked(v_ptr=v_ptr, o_ptr=o_ptr, gb=gb, b_ptr=b_ptr, pw=pw, ar=ar, ai=ai, rows=rows, ok=ok, oc=oc, om=om,
                   mm=mm, i_h=i_h, M=M, V=V, C=C, BM=BM, BV=BV, PREC=PREC)


@triton.jit
def _mix_modes(xr, xi, p_ptr, i_h, om, mm, M, PREC: tl.constexpr, ADJOINT: tl.constexpr, LOW: tl.constexpr, DT):
    """x P (ADJOINT: x P^H) for per-token rows x [C, BM] (re, im, fp32) and the head's P [M, M] (re, im). LOW
    (InterdomainPlan.mix_in_input_dtype): both operands in DT, the inputs' dtype, as the kernels' other products."""
    mp = mm[:, None] & mm[None, :]
    if ADJOINT:
        pp = p_ptr + ((i_h * M + om[None, :]) * M + om[:, None]) * 2
        pr, pi = tl.load(pp, mask=mp, other=0.0), -tl.load(pp + 1, mask=mp, other=0.0)
    else:
        pp = p_ptr + ((i_h * M + om[:, None]) * M + om[None, :]) * 2
        pr, pi = tl.load(pp, mask=mp, other=0.0), tl.load(pp + 1, mask=mp, other=0.0)
    if LOW:
        xr, xi, pr, pi = xr.to(DT), xi.to(DT), pr.to(DT), pi.to(DT)
    yr = tl.dot(xr, pr, input_precision=PREC) - tl.dot(xi, pi, input_precision=PREC)
    yi = tl.dot(xr, pi, input_precision=PREC) + tl.dot(xi, pr, input_precision=PREC)
    return yr, yi


@triton.jit
def _b_modes2(b_ptr, i_h, M, BM: tl.constexpr):
    """Mode and part (0 real, 1 imaginary) of each of 2 BM interleaved columns, the mode mask, and b (re, im) per
    column."""
    o2 = tl.arange(0, 2 * BM)
    m2, p2 = o2 // 2, o2 % 2
    mk2 = m2 < M
    br2 = tl.load(b_ptr + (i_h * M + m2) * 2, mask=mk2, other=0.0)
    bi2 = tl.load(b_ptr + (i_h * M + m2) * 2 + 1, mask=mk2, other=0.0)
    return m2, p2, mk2, br2, bi2


@triton.jit
def _bpow2(pw, n, m2, p2, br2, bi2, mk, M):
    """b lam^n with real and imaginary parts interleaved along the (mode, part) axis; all arguments broadcast."""
    lr, li = lam_pow(pw, n, m2, mk, M)
    return tl.where(p2 == 0, br2 * lr - bi2 * li, br2 * li + bi2 * lr)


@triton.jit
def _fwd_o_stacked(v_ptr, o_ptr, gb, b_ptr, pw, ar, ai, rows, ok, oc, om, mm, i_h, M, V: tl.constexpr,
                   C: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """o = W V + Re((a conj lam^(j+1)) conj Gamma_c) with the products over the modes on interleaved [., 2 BM]
    operands (STACK)."""
    DT = v_ptr.dtype.element_ty
    m2, p2, mk2, br2, bi2 = _b_modes2(b_ptr, i_h, M, BM)
    pt2 = _bpow2(pw=pw, n=oc[None, :], m2=m2[:, None], p2=p2[:, None], br2=br2[:, None], bi2=bi2[:, None],
                 mk=mk2[:, None], M=M)
    w = _shear_lower(tl.dot(_join2(ar, ai, C, BM).to(DT), pt2.to(DT), input_precision=PREC), oc).to(DT)
    sr, si = lam_pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
    xr, xi = cmul(ar, ai, sr, -si)
    x2 = _join2(xr, xi, C, BM).to(DT)
    for d0 in tl.static_range(0, V, BV):
        od = d0 + tl.arange(0, BV)
        md = od < V
        mrow = ok[:, None] & md[None, :]
        g2 = tl.load(gb + (p2 * M + m2)[:, None] * V + od[None, :], mask=mk2[:, None] & md[None, :], other=0.0)
        acc = tl.dot(x2, g2.to(DT), input_precision=PREC)
        vt = tl.load(v_ptr + rows[:, None] * V + od[None, :], mask=mrow, other=0.0).to(DT)
        acc += tl.dot(w, vt, input_precision=PREC)
        tl.store(o_ptr + rows[:, None] * V + od[None, :], acc.to(o_ptr.dtype.element_ty), mask=mrow)


@triton.jit
def _bwd_a_kernel(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, T, NC, H, M,
                  K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, PREC: tl.constexpr):
    _bwd_a(q_ptr=q_ptr, k_ptr=k_ptr, v_ptr=v_ptr, do_ptr=do_ptr, ub_ptr=ub_ptr, gb_ptr=gb_ptr, b_ptr=b_ptr,
           pw_ptr=pw_ptr, a_ptr=a_ptr, da_ptr=da_ptr, part_ptr=part_ptr, p_ptr=b_ptr, araw_ptr=a_ptr, dar_ptr=da_ptr,
           T=T, NC=NC, H=H, M=M, K=K, V=V, C=C, BM=BM, BK=BK, BV=BV, PREC=PREC, MIXED=False, LOW=False)


@triton.jit
def _bwd_a_mixed_kernel(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, p_ptr,
                        araw_ptr, dar_ptr, T, NC, H, M, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr):
    """_bwd_a_kernel with the readout P: also stores the unmixed a and d(a P) (araw, dar) for dP on the host."""
    _bwd_a(q_ptr=q_ptr, k_ptr=k_ptr, v_ptr=v_ptr, do_ptr=do_ptr, ub_ptr=ub_ptr, gb_ptr=gb_ptr, b_ptr=b_ptr,
           pw_ptr=pw_ptr, a_ptr=a_ptr, da_ptr=da_ptr, part_ptr=part_ptr, p_ptr=p_ptr, araw_ptr=araw_ptr,
           dar_ptr=dar_ptr, T=T, NC=NC, H=H, M=M, K=K, V=V, C=C, BM=BM, BK=BK, BV=BV, PREC=PREC, MIXED=True, LOW=LOW)


@triton.jit
def _bwd_a(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, p_ptr, araw_ptr,
           dar_ptr, T, NC, H, M, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
           BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, MIXED: tl.constexpr, LOW: tl.constexpr):
    """a and da per token plus the intra-chunk parameter partials. MIXED (a readout P, o = Re(a P conj Gamma)): the
    dO side's readout is d(a P); the q side takes da = d(a P) P^H and the Gamma side a P, so a_ptr gets a P and
    da_ptr da, and the scans and gradient launches after this one run unchanged."""
    ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi = _chunk_program(b_ptr, pw_ptr, T, H, M, C, BM)
    DT = q_ptr.dtype.element_ty
    br = br[None, :]
    bi = bi[None, :]
    ub = ub_ptr + (i_bh * NC + ic) * 2 * M * K
    gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
    ar, ai, par, pai, shq = _readout_a(x_ptr=q_ptr, z_ptr=k_ptr, sb=ub, pw=pw, br=br, bi=bi, rows=rows, ok=ok, oc=oc,
                                       om=om, mm=mm, M=M, D=K, C=C, BD=BK, BM=BM, PREC=PREC)
    gr, gi, pgr, pgi, shd = _readout_a(x_ptr=do_ptr, z_ptr=v_ptr, sb=gb, pw=pw, br=br, bi=bi, rows=rows, ok=ok, oc=oc,
                                       om=om, mm=mm, M=M, D=V, C=C, BD=BV, BM=BM, PREC=PREC)
    out = rows[:, None] * 2 * M + om[None, :]
    mo = ok[:, None] & mm[None, :]
    if MIXED:
        _store_pair(araw_ptr, out, ar, ai, mo, M)
        _store_pair(dar_ptr, out, gr, gi, mo, M)
        ar, ai = _mix_modes(xr=ar, xi=ai, p_ptr=p_ptr, i_h=i_h, om=om, mm=mm, M=M, PREC=PREC, ADJOINT=False, LOW=LOW,
                            DT=DT)
        gr, gi = _mix_modes(xr=gr, xi=gi, p_ptr=p_ptr, i_h=i_h, om=om, mm=mm, M=M, PREC=PREC, ADJOINT=True, LOW=LOW,
                            DT=DT)
    _store_pair(a_ptr, out, ar, ai, mo, M)
    _store_pair(da_ptr, out, gr, gi, mo, M)
    # d(log lam), intra-chunk x inter-chunk: sum_t (j+1) [da conj(a_inter) + a conj(da_inter)]
    wj = (oc + 1).to(tl.float32)[:, None]
    lr = tl.sum(wj * (gr * par + gi * pai + ar * pgr + ai * pgi), 0)
    li = tl.sum(wj * (gi * par - gr * pai + ai * pgr - ar * pgi), 0)
    # (storing the dO side's four [C, M] tiles and reading them back after the q side cut the spills from 292 to
    # 184 B but saved only 0.03 of 2.47 ms for a [B, T, H, 2, M] scratch buffer: interdomain-sweep-plans)
    # lag sums c[n, m] = sum_t A[t, t-n] da_t + Ag[t, t-n] a_t (A = Q K^T, Ag = dO V^T): D^T da + Dg^T a with the
    # sheared D, Dg of the readouts. Transposing them (a gather result, not a dot result: the Hopper miscompile of
    # flash-linear-attention issue 640 is tl.trans of a tl.dot) replaced a second, transposed Q K^T and dO V^T
    # product: bwd_a 2.56 against 3.66 ms on the H200 (interdomain-sweep.md), spills 310 against 488 B
    sh = tl.trans(shq)
    shg = tl.trans(shd)
    cr = tl.dot(sh, gr.to(DT), input_precision=PREC) + tl.dot(shg, ar.to(DT), input_precision=PREC)
    ci = tl.dot(sh, gi.to(DT), input_precision=PREC) + tl.dot(shg, ai.to(DT), input_precision=PREC)
    _lag_partials(part_ptr=part_ptr, cr=cr, ci=ci, lr=lr, li=li, pw=pw, br=br, bi=bi, oc=oc, om=om, mm=mm,
                  i_bh=i_bh, NC=NC, ic=ic, M=M)


@triton.jit
def _store_pair(ptr, out, xr, xi, mask, M):
    """A complex [C, BM] tile into a [B, T, H, 2, M] buffer at offsets out (re; im M further on)."""
    tl.store(ptr + out, xr.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + out + M, xi.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lag_partials(part_ptr, cr, ci, lr, li, pw, br, bi, oc, om, mm, i_bh, NC, ic, M):
    """db = sum_n conj(lam^n) c[n] and d(log lam) = (lr, li) + sum_n n conj(b lam^n) c[n] from the lag sums c
    [C, BM]; stored as this chunk's intra-chunk partials."""
    nr, ni = lam_pow(pw, oc[:, None], om[None, :], mm[None, :], M)
    dbr = tl.sum(nr * cr + ni * ci, 0)
    dbi = tl.sum(nr * ci - ni * cr, 0)
    qr, qi = cmul(br, bi, nr, ni)
    wn = oc.to(tl.float32)[:, None]
    lr += tl.sum(wn * (qr * cr + qi * ci), 0)
    li += tl.sum(wn * (qr * ci - qi * cr), 0)
    pp = part_ptr + (i_bh * NC + ic) * 4 * M + om
    tl.store(pp, dbr, mask=mm)
    tl.store(pp + M, dbi, mask=mm)
    tl.store(pp + 2 * M, lr, mask=mm)
    tl.store(pp + 3 * M, li, mask=mm)


@triton.jit
def _load_coef(p_ptr, rows, ok, oc, om, mm, M):
    """Per-token complex coefficients [B, T, H, 2, M] as [C, BM] and transposed [BM, C] fp32 tiles."""
    p = p_ptr + rows[:, None] * 2 * M + om[None, :]
    mk = ok[:, None] & mm[None, :]
    pt = p_ptr + rows[None, :] * 2 * M + om[:, None]
    mt = mm[:, None] & ok[None, :]
    return (tl.load(p, mask=mk, other=0.0).to(tl.float32), tl.load(p + M, mask=mk, other=0.0).to(tl.float32),
            tl.load(pt, mask=mt, other=0.0).to(tl.float32), tl.load(pt + M, mask=mt, other=0.0).to(tl.float32))


@triton.jit
def _feature_tile(d0, ok, om, mm, D: tl.constexpr, BD: tl.constexpr):
    """Feature tile d0..d0+BD: its offsets and mask, the [C, BD] token-row mask, and the [BM, BD] mask and offsets
    of a state's mode rows."""
    od = d0 + tl.arange(0, BD)
    md = od < D
    return od, md, ok[:, None] & md[None, :], mm[:, None] & md[None, :], om[:, None] * D + od[None, :]


@triton.jit
def _grad_dq(dq_ptr, k_ptr, wd, xr, xi, ub, rows, ok, om, mm, M, D: tl.constexpr, BD: tl.constexpr,
             PREC: tl.constexpr):
    """dq = W_da K + Re((da conj lam^(j+1)) conj U_c), tiled over the feature dim."""
    DT = k_ptr.dtype.element_ty
    for d0 in tl.static_range(0, D, BD):
        od, md, mrow, ms, st = _feature_tile(d0, ok, om, mm, D, BD)
        acc = tl.dot(wd, tl.load(k_ptr + rows[:, None] * D + od[None, :], mask=mrow, other=0.0).to(DT),
                     input_precision=PREC)
        acc += tl.dot(xr, tl.load(ub + st, mask=ms, other=0.0).to(DT), input_precision=PREC)
        acc += tl.dot(xi, tl.load(ub + M * D + st, mask=ms, other=0.0).to(DT), input_precision=PREC)
        tl.store(dq_ptr + rows[:, None] * D + od[None, :], acc.to(dq_ptr.dtype.element_ty), mask=mrow)


@triton.jit
def _grad_rev(out_ptr, x_ptr, z_ptr, wt, yr, yi, sb, ub, rows, ok, om, mm, M, D: tl.constexpr, C: tl.constexpr,
              BD: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr):
    """Gradient of the state's token vectors z: W^T x + Re(conj(b lam^(L-1-j)) S) with S the reverse state at the
    chunk end, tiled over the feature dim. Also returns Z S^T [C, BM] and sum_d S conj(U_c) [BM] (re, im) for the
    parameter gradients."""
    DT = x_ptr.dtype.element_ty
    zsr = tl.zeros([C, BM], dtype=tl.float32)
    zsi = tl.zeros([C, BM], dtype=tl.float32)
    sur = tl.zeros([BM], dtype=tl.float32)
    sui = tl.zeros([BM], dtype=tl.float32)
    for d0 in tl.static_range(0, D, BD):
        od, md, mrow, ms, st = _feature_tile(d0, ok, om, mm, D, BD)
        s_r = tl.load(sb + st, mask=ms, other=0.0).to(tl.float32)
        s_i = tl.load(sb + M * D + st, mask=ms, other=0.0).to(tl.float32)
        acc = tl.dot(wt, tl.load(x_ptr + rows[:, None] * D + od[None, :], mask=mrow, other=0.0).to(DT),
                     input_precision=PREC)
        acc += tl.dot(yr, s_r.to(DT), input_precision=PREC)
        acc += tl.dot(yi, s_i.to(DT), input_precision=PREC)
        tl.store(out_ptr + rows[:, None] * D + od[None, :], acc.to(out_ptr.dtype.element_ty), mask=mrow)
        zt = tl.load(z_ptr + rows[:, None] * D + od[None, :], mask=mrow, other=0.0).to(DT)
        stt = om[None, :] * D + od[:, None]
        mst = md[:, None] & mm[None, :]
        zsr += tl.dot(zt, tl.load(sb + stt, mask=mst, other=0.0).to(DT), input_precision=PREC)
        zsi += tl.dot(zt, tl.load(sb + M * D + stt, mask=mst, other=0.0).to(DT), input_precision=PREC)
        u_r = tl.load(ub + st, mask=ms, other=0.0).to(tl.float32)
        u_i = tl.load(ub + M * D + st, mask=ms, other=0.0).to(tl.float32)
        sur += tl.sum(s_r * u_r + s_i * u_i, 1)
        sui += tl.sum(s_i * u_r - s_r * u_i, 1)
    return zsr, zsi, sur, sui


@triton.jit
def _bwd_part_kernel(q_ptr, k_ptr, v_ptr, do_ptr, a_ptr, da_ptr, ub_ptr, gb_ptr, rub_ptr, rgb_ptr, b_ptr, pw_ptr,
                     dq_ptr, dk_ptr, dv_ptr, part_ptr, T, NC, H, M, K: tl.constexpr, V: tl.constexpr,
                     C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                     PART: tl.constexpr):
    """One gradient per launch: dq (PART 1), dk (2) or dv (4); the dk and dv launches each write their (additive)
    share of the state parameter-gradient partials. One kernel for all three held every tile at once and spilled:
    the three launches took 8.3 ms of backward against 10.5 ms (H200, T = 2K, M = 32,
    f1e3960:tools/results/interdomain-2026-11-30-6fcc793.md). The dk / dv launches spill (138 B); taking the state sums
    <S, U_c> in a loop of their own spilled more (154 B) and ran slower, 1.41 against 1.33 ms
    (interdomain-sweep-plans.md)."""
    # its own preamble, not _chunk_program's: the chunk length L comes first, as in the build measured on the H200
    ic, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    DT = q_ptr.dtype.element_ty
    oc = tl.arange(0, C)
    L = tl.minimum(T - ic * C, C)
    ok = oc < L
    rows = (i_b * T + ic * C + oc) * H + i_h
    om = tl.arange(0, BM)
    mm = om < M
    pw = pw_ptr + i_h * (C + 1) * 2 * M
    br = tl.load(b_ptr + (i_h * M + om) * 2, mask=mm, other=0.0)
    bi = tl.load(b_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)
    cs = (i_bh * NC + ic) * 2 * M
    ub = ub_ptr + cs * K
    gb = gb_ptr + cs * V
    if PART == 1:
        gr, gi, _, _ = _load_coef(da_ptr, rows, ok, oc, om, mm, M)
        # (b lam^n)^T as [BM, C]
        ptr_, pti = lam_pow(pw, oc[None, :], om[:, None], mm[:, None], M)
        ptr_, pti = cmul(br[:, None], bi[:, None], ptr_, pti)
        wd = _w_matrix(gr, gi, ptr_, pti, oc, DT, PREC).to(DT)
        # inter-chunk coefficients: da conj(lam^(j+1)) against U_c
        sr, si = lam_pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
        xr, xi = cmul(gr, gi, sr, -si)
        _grad_dq(dq_ptr=dq_ptr, k_ptr=k_ptr, wd=wd, xr=xr.to(DT), xi=xi.to(DT), ub=ub, rows=rows, ok=ok, om=om, mm=mm,
                 M=M, D=K, BD=BK, PREC=PREC)
    else:
        # b lam^n as [C, BM]; b lam^(L-1-j) against the reverse states; dk takes da (W_da^T q), dv a (W^T dO)
        pr_, pi_ = lam_pow(pw, oc[:, None], om[None, :], mm[None, :], M)
        pr_, pi_ = cmul(br[None, :], bi[None, :], pr_, pi_)
        er, ei = lam_pow(pw, tl.maximum(L - 1 - oc, 0)[:, None], om[None, :], ok[:, None] & mm[None, :], M)
        yr, yi = cmul(br[None, :], bi[None, :], er, ei)
        if PART == 2:
            _, _, ctr, cti = _load_coef(da_ptr, rows, ok, oc, om, mm, M)
            wt = _w_matrix_t(pr_, pi_, ctr, cti, oc, DT, PREC).to(DT)
            zsr, zsi, sur, sui = _grad_rev(out_ptr=dk_ptr, x_ptr=q_ptr, z_ptr=k_ptr, wt=wt, yr=yr.to(DT), yi=yi.to(DT),
                                           sb=rub_ptr + cs * K, ub=ub, rows=rows, ok=ok, om=om, mm=mm, M=M, D=K, C=C,
                                           BD=BK, BM=BM, PREC=PREC)
        else:
            _, _, ctr, cti = _load_coef(a_ptr, rows, ok, oc, om, mm, M)
            wt = _w_matrix_t(pr_, pi_, ctr, cti, oc, DT, PREC).to(DT)
            zsr, zsi, sur, sui = _grad_rev(out_ptr=dv_ptr, x_ptr=do_ptr, z_ptr=v_ptr, wt=wt, yr=yr.to(DT), yi=yi.to(DT),
                                           sb=rgb_ptr + cs * V, ub=gb, rows=rows, ok=ok, om=om, mm=mm, M=M, D=V, C=C,
                                           BD=BV, BM=BM, PREC=PREC)
        _state_partials(part_ptr=part_ptr, zsr=zsr, zsi=zsi, sur=sur, sui=sui, er=er, ei=ei, br=br, bi=bi, pw=pw, L=L,
                        oc=oc, om=om, mm=mm, i_bh=i_bh, NC=NC, ic=ic, M=M)


@triton.jit
def _state_partials(part_ptr, zsr, zsi, sur, sui, er, ei, br, bi, pw, L, oc, om, mm, i_bh, NC, ic, M):
    """db: sum_t conj(lam^(L-1-j)) z_t . S;  d(log lam): conj(b) sum_t (L-1-j) conj(lam^(L-1-j)) z_t . S
    (reverse state x intra-chunk state) + L conj(lam^L) <S, X_c> (reverse state x chunk-start state); linear in
    the Z S^T and <S, X_c> sums, so the dk and dv shares add up."""
    cr = er * zsr + ei * zsi
    ci = er * zsi - ei * zsr
    dbr = tl.sum(cr, 0)
    dbi = tl.sum(ci, 0)
    wl = (L - 1 - oc).to(tl.float32)[:, None]
    hr = tl.sum(wl * cr, 0)
    hi = tl.sum(wl * ci, 0)
    lr = br * hr + bi * hi
    li = br * hi - bi * hr
    nr, ni = lam_pow(pw, L, om, mm, M)
    lf = L.to(tl.float32)
    lr += lf * (nr * sur + ni * sui)
    li += lf * (nr * sui - ni * sur)
    pp = part_ptr + (i_bh * NC + ic) * 4 * M + om
    tl.store(pp, dbr, mask=mm)
    tl.store(pp + M, dbi, mask=mm)
    tl.store(pp + 2 * M, lr, mask=mm)
    tl.store(pp + 3 * M, li, mask=mm)



def tiles(q, v, b, plan: InterdomainPlan = DEFAULT_PLAN) -> dict:
    """Mode and feature tiles (and the dot precision) of the readout kernels for these shapes."""
    lo_m, lo_d = (16, 16) if interpreting() else plan.gpu_min_tile
    return dict(K=q.shape[-1], V=v.shape[-1], BM=next_pow2(b.shape[1], lo_m),
                BK=min(next_pow2(q.shape[-1], lo_d), 64), BV=min(next_pow2(v.shape[-1], lo_d), 64),
                PREC=dot_precision(q, "interdomain"))


def _grid_and_dims(q, b, C):
    B, T, H, _ = q.shape
    NC = triton.cdiv(T, C)
    return (NC, B * H), dict(T=T, NC=NC, H=H, M=b.shape[1], C=C)


def readout_fwd(q, k, v, ub, gb, b, pw, o, C, p=None, plan: InterdomainPlan = DEFAULT_PLAN):
    """Writes o from the chunk-start states ub, gb (with a readout P when p is given); returns the launched kernel
    (Triton's handle: n_regs, n_spills)."""
    grid, dims = _grid_and_dims(q, b, C)
    sizes = tiles(q, v, b, plan)
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, ub_ptr=ub, gb_ptr=gb, b_ptr=b, pw_ptr=pw, o_ptr=o, **dims, **sizes,
                num_warps=plan.warps("fwd"))
    if p is None:
        return _fwd_kernel[grid](**args, STACK=sizes["BM"] < plan.fwd_stack_below)
    return _fwd_mixed_kernel[grid](**args, p_ptr=p, LOW=plan.mix_in_input_dtype)


def readout_bwd_a(q, k, v, do, ub, gb, b, pw, C, *, a, da, part, p=None, araw=None, dar=None,
                  plan: InterdomainPlan = DEFAULT_PLAN):
    """Writes a, da and the intra-chunk parameter partials (with a readout P also araw, dar); returns the launched
    kernel."""
    grid, dims = _grid_and_dims(q, b, C)
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, ub_ptr=ub, gb_ptr=gb, b_ptr=b, pw_ptr=pw, a_ptr=a, da_ptr=da,
                part_ptr=part, **dims, **tiles(q, v, b, plan), num_warps=plan.warps("bwd_a"))
    if p is None:
        return _bwd_a_kernel[grid](**args)
    return _bwd_a_mixed_kernel[grid](**args, p_ptr=p, araw_ptr=araw, dar_ptr=dar, LOW=plan.mix_in_input_dtype)


GRAD_PARTS = {"dq": 1, "dk": 2, "dv": 4}


def readout_grad(which, q, k, v, do, b, pw, C, *, a, da, ub, gb, rub, rgb, dq, dk, dv, part,
                 plan: InterdomainPlan = DEFAULT_PLAN):
    """One of dq, dk, dv (`which`), the dk and dv launches with their share of the state parameter partials in
    part; returns the launched kernel."""
    grid, dims = _grid_and_dims(q, b, C)
    return _bwd_part_kernel[grid](q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, a_ptr=a, da_ptr=da, ub_ptr=ub, gb_ptr=gb,
                                  rub_ptr=rub, rgb_ptr=rgb, b_ptr=b, pw_ptr=pw, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv,
                                  part_ptr=part, **dims, **tiles(q, v, b, plan), PART=GRAD_PARTS[which],
                                  num_warps=plan.warps(f"bwd_{which}"))
