"""Chunkwise Interdomain Attention in Triton: chunk-wide products (see README.md, "Chunkwise algorithm").

Per (chunk of C tokens, batch row, head) every product is [C, .]-shaped. Intra-chunk decays are never factored:
sums of the form sum_{s<=t} A[t, s] lam^(t-s) are taken over the lag n = t - s, whose coefficient lam^n (n >= 0)
is exact in range, by shearing the [C, C] matrix with tl.gather (D[t, n] = A[t, t - n]) and multiplying by the
[C, 2M] table of lam^n; the o-side builds W'[t, n] = sum_m Re(a_t conj(b lam^n)) as a product and shears it back
(W[t, s] = W'[t, t - s]). Kernels:
  _powers_kernel   lam^n, n = 0..C, per head (fp64 math, fp32 table): the only decay table, built on the device
  _scan_kernel     chunk-boundary states of X_t = lam X_{t-1} + c_t z_t (forward), or of the adjoint in reverse,
                   over all chunks or over one segment of them (long sequences)
  _carry_kernel    a segmented scan's segment start states from the segments' end states
  _fwd_kernel      o from (q, k, U_c) and (v, Gamma_c)
  _bwd_a_kernel    a and da per token, plus the intra-chunk parts of d(log lam) and db
  _bwd_part_kernel dq, dk or dv (one launch each), the dk and dv launches with their shares of the state parts of
                   d(log lam) and db
With mode tiles narrower than 64 the forward takes its products over the modes on interleaved [., 2 BM] operands.
"""

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _cmul(ar, ai, br, bi):
    return ar * br - ai * bi, ar * bi + ai * br


@triton.jit
def _pow(pw, n, om, mm, M):
    """lam^n (re, im) from one head's [C + 1, 2, M] table; n and om broadcast against each other."""
    p = pw + n * 2 * M + om
    return tl.load(p, mask=mm, other=0.0), tl.load(p + M, mask=mm, other=0.0)


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
def _powers_kernel(decay_ptr, pw_ptr, M, C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr):
    i_h = tl.program_id(0)
    n = tl.arange(0, NP)
    om = tl.arange(0, BM)
    mm = om < M
    al = tl.load(decay_ptr + (i_h * M + om) * 2, mask=mm, other=0.0).to(tl.float64)
    th = tl.load(decay_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0).to(tl.float64)
    nf = n.to(tl.float64)[:, None]
    mag = tl.exp(nf * al[None, :])
    p = pw_ptr + i_h * (C + 1) * 2 * M + n[:, None] * 2 * M + om[None, :]
    mk = (n[:, None] <= C) & mm[None, :]
    tl.store(p, (mag * tl.cos(nf * th[None, :])).to(tl.float32), mask=mk)
    tl.store(p + M, (mag * tl.sin(nf * th[None, :])).to(tl.float32), mask=mk)


@triton.jit
def _store_state(xb_ptr, xr, xi, i_bh, NC, ic, om, od, mm, md, M, D):
    st = om[:, None] * D + od[None, :]
    mmd = mm[:, None] & md[None, :]
    pb = xb_ptr + (i_bh * NC + ic) * 2 * M * D
    tl.store(pb + st, xr.to(xb_ptr.dtype.element_ty), mask=mmd)
    tl.store(pb + M * D + st, xi.to(xb_ptr.dtype.element_ty), mask=mmd)


@triton.jit
def _scan_step(ic, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm, md, T, NC, H, D, M,
               C: tl.constexpr, PER_TOKEN: tl.constexpr, REV: tl.constexpr, PREC: tl.constexpr,
               STORE: tl.constexpr):
    """Chunk ic: stores the state before it (STORE) and returns the state after it."""
    DT = z_ptr.dtype.element_ty
    if STORE:
        _store_state(xb_ptr, xr, xi, i_bh, NC, ic, om, od, mm, md, M, D)
    L = tl.minimum(T - ic * C, C)
    ok = oc < L
    row = (i_b * T + ic * C + oc) * H + i_h
    zt = tl.load(z_ptr + row[:, None] * D + od[None, :], mask=ok[:, None] & md[None, :], other=0.0).to(DT)
    if REV:
        e = oc + 1
    else:
        e = tl.maximum(L - 1 - oc, 0)
    mk = mm[:, None] & ok[None, :]
    er, ei = _pow(pw, tl.minimum(e, C)[None, :], om[:, None], mk, M)
    if REV:
        ei = -ei
    if PER_TOKEN:
        pc = c_ptr + row[None, :] * 2 * M + om[:, None]
        cr = tl.load(pc, mask=mk, other=0.0).to(tl.float32)
        ci = tl.load(pc + M, mask=mk, other=0.0).to(tl.float32)
        er, ei = _cmul(er, ei, cr, ci)
    else:
        er, ei = _cmul(er, ei, cbr, cbi)
    lr, li = _pow(pw, L, om, mm, M)
    if REV:
        li = -li
    xr, xi = _cmul(lr[:, None], li[:, None], xr, xi)
    xr += tl.dot(er.to(DT), zt, input_precision=PREC)
    xi += tl.dot(ei.to(DT), zt, input_precision=PREC)
    return xr, xi


@triton.jit
def _full_tables(cbr, cbi, pw, om, oc, mm, M, C: tl.constexpr, PER_TOKEN: tl.constexpr, REV: tl.constexpr):
    """Decay tables shared by every full chunk: E [BM, C] = b lam^(C-1-j) (forward; without b when coefficients
    are per token) or conj(lam)^(j+1) (reverse, per token), and lam^C [BM] (conjugated in reverse)."""
    if REV:
        e = oc + 1
    else:
        e = C - 1 - oc
    er, ei = _pow(pw, e[None, :], om[:, None], mm[:, None], M)
    if REV:
        ei = -ei
    if not PER_TOKEN:
        er, ei = _cmul(er, ei, cbr, cbi)
    lr, li = _pow(pw, C, om, mm, M)
    if REV:
        li = -li
    return er, ei, lr, li


@triton.jit
def _load_c(c_ptr, ic, i_b, i_h, om, oc, mm, T, H, M, C: tl.constexpr):
    """Per-token coefficients of chunk ic as [BM, C] fp32 (re, im); rows past T read as 0 (T < C)."""
    row = (i_b * T + ic * C + oc) * H + i_h
    pc = c_ptr + row[None, :] * 2 * M + om[:, None]
    mk = mm[:, None] & (ic * C + oc < T)[None, :]
    return tl.load(pc, mask=mk, other=0.0).to(tl.float32), tl.load(pc + M, mask=mk, other=0.0).to(tl.float32)


@triton.jit
def _load_z(z_ptr, ic, i_b, i_h, od, oc, md, T, H, D, C: tl.constexpr):
    """Features of chunk ic as a [C, BD] tile in z's dtype; rows past T read as 0 (T < C)."""
    row = (i_b * T + ic * C + oc) * H + i_h
    return tl.load(z_ptr + row[:, None] * D + od[None, :], mask=(ic * C + oc < T)[:, None] & md[None, :], other=0.0)


@triton.jit
def _scan_full_step(j, xr, xi, fr, fi, lr, li, zt, cr, ci, z_ptr, c_ptr, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm,
                    md, T, NC, H, D, M, c_lo, f_hi, C: tl.constexpr, PER_TOKEN: tl.constexpr, REV: tl.constexpr,
                    PREC: tl.constexpr, STORE: tl.constexpr):
    """Step j over the full chunks c_lo..f_hi-1 (backward with REV) with the hoisted tables. zt and (cr, ci) are
    this chunk's features and per-token coefficients, loaded one chunk ahead (the compiler's pipeliner leaves this
    loop alone) so that their latency overlaps the previous chunk's products; returns the next chunk's."""
    DT = z_ptr.dtype.element_ty
    if REV:
        ic = f_hi - 1 - j
        nxt = tl.maximum(ic - 1, c_lo)
    else:
        ic = c_lo + j
        nxt = tl.minimum(ic + 1, f_hi - 1)
    if STORE:
        _store_state(xb_ptr, xr, xi, i_bh, NC, ic, om, od, mm, md, M, D)
    zc = zt.to(DT)
    zt = _load_z(z_ptr, nxt, i_b, i_h, od, oc, md, T, H, D, C)
    er, ei = fr, fi
    if PER_TOKEN:
        er, ei = _cmul(fr, fi, cr, ci)
        cr, ci = _load_c(c_ptr, nxt, i_b, i_h, om, oc, mm, T, H, M, C)
    xr, xi = _cmul(lr[:, None], li[:, None], xr, xi)
    xr += tl.dot(er.to(DT), zc, input_precision=PREC)
    xi += tl.dot(ei.to(DT), zc, input_precision=PREC)
    return xr, xi, zt, cr, ci


@triton.jit
def _scan_hoisted(xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm, md, T, NC, H, D, M,
                  c_lo, c_hi, C: tl.constexpr, PER_TOKEN: tl.constexpr, REV: tl.constexpr, PREC: tl.constexpr,
                  STORE: tl.constexpr, INTERPRET: tl.constexpr):
    """Chunks c_lo..c_hi-1 with the decay tables of full chunks computed once; a partial chunk (T % C tokens, the
    last in time: first in reverse) takes the general step."""
    f_hi = tl.minimum(c_hi, T // C)  # full chunks of this range: c_lo..f_hi-1
    fr, fi, lr, li = _full_tables(cbr, cbi, pw, om, oc, mm, M, C, PER_TOKEN, REV)
    if REV:
        if f_hi < c_hi:
            xr, xi = _scan_step(c_hi - 1, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm,
                                md, T, NC, H, D, M, C, PER_TOKEN, REV, PREC, STORE)
        first = tl.maximum(f_hi - 1, c_lo)
    else:
        first = c_lo
    zt = _load_z(z_ptr, first, i_b, i_h, od, oc, md, T, H, D, C)
    cr, ci = fr, fi
    if PER_TOKEN:
        cr, ci = _load_c(c_ptr, first, i_b, i_h, om, oc, mm, T, H, M, C)
    if INTERPRET:
        j = 0
        while j < f_hi - c_lo:
            xr, xi, zt, cr, ci = _scan_full_step(j, xr, xi, fr, fi, lr, li, zt, cr, ci, z_ptr, c_ptr, xb_ptr, i_b,
                                                 i_h, i_bh, om, od, oc, mm, md, T, NC, H, D, M, c_lo, f_hi, C,
                                                 PER_TOKEN, REV, PREC, STORE)
            j += 1
    else:
        for j in range(f_hi - c_lo):
            xr, xi, zt, cr, ci = _scan_full_step(j, xr, xi, fr, fi, lr, li, zt, cr, ci, z_ptr, c_ptr, xb_ptr, i_b,
                                                 i_h, i_bh, om, od, oc, mm, md, T, NC, H, D, M, c_lo, f_hi, C,
                                                 PER_TOKEN, REV, PREC, STORE)
    if not REV:
        if f_hi < c_hi:
            xr, xi = _scan_step(c_hi - 1, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm,
                                md, T, NC, H, D, M, C, PER_TOKEN, REV, PREC, STORE)
    return xr, xi


@triton.jit
def _scan_plain_step(it, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm, md, T, NC, H, D,
                     M, c_lo, c_hi, C: tl.constexpr, PER_TOKEN: tl.constexpr, REV: tl.constexpr, PREC: tl.constexpr,
                     STORE: tl.constexpr):
    if REV:
        ic = c_hi - 1 - it
    else:
        ic = c_lo + it
    return _scan_step(ic, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm, md, T, NC, H, D,
                      M, C, PER_TOKEN, REV, PREC, STORE)


@triton.jit
def _scan_kernel(z_ptr, c_ptr, b_ptr, pw_ptr, x0_ptr, xb_ptr, xf_ptr, T, NC, H, D, M, NS, SEG, C: tl.constexpr,
                 BM: tl.constexpr, BD: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_INIT: tl.constexpr,
                 REV: tl.constexpr, PREC: tl.constexpr, HOIST: tl.constexpr, STORE: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """One (b, h) row, one [BM, BD] state tile, one segment of SEG chunks (NS segments per row): from the
    segment's start state x0 (or zero) through its chunks, storing the state before each (STORE), and the state
    after the segment in xf. x0 and xf are [B, H, NS, 2, M, D] fp32."""
    i_p, i_d, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_bh, i_s = i_p // NS, i_p % NS
    i_b, i_h = i_bh // H, i_bh % H
    c_lo = i_s * SEG
    c_hi = tl.minimum(c_lo + SEG, NC)
    om = i_m * BM + tl.arange(0, BM)
    od = i_d * BD + tl.arange(0, BD)
    oc = tl.arange(0, C)
    mm, md = om < M, od < D
    mmd = mm[:, None] & md[None, :]
    st = om[:, None] * D + od[None, :]
    pw = pw_ptr + i_h * (C + 1) * 2 * M
    xr = tl.zeros([BM, BD], dtype=tl.float32)
    xi = tl.zeros([BM, BD], dtype=tl.float32)
    if HAS_INIT:
        p0 = x0_ptr + i_p * 2 * M * D
        xr = tl.load(p0 + st, mask=mmd, other=0.0)
        xi = tl.load(p0 + M * D + st, mask=mmd, other=0.0)
    cbr = tl.load(b_ptr + (i_h * M + om) * 2, mask=mm, other=0.0)[:, None]
    cbi = tl.load(b_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)[:, None]
    if HOIST:
        xr, xi = _scan_hoisted(xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm, md, T, NC,
                               H, D, M, c_lo, c_hi, C, PER_TOKEN, REV, PREC, STORE, INTERPRET)
    # the interpreter (numpy >= 2.4) cannot take a runtime range() bound; compiled code keeps the for loop
    elif INTERPRET:
        it = 0
        while it < c_hi - c_lo:
            xr, xi = _scan_plain_step(it, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm,
                                      md, T, NC, H, D, M, c_lo, c_hi, C, PER_TOKEN, REV, PREC, STORE)
            it += 1
    else:
        for it in range(c_hi - c_lo):
            xr, xi = _scan_plain_step(it, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm,
                                      md, T, NC, H, D, M, c_lo, c_hi, C, PER_TOKEN, REV, PREC, STORE)
    pf = xf_ptr + i_p * 2 * M * D
    tl.store(pf + st, xr, mask=mmd)
    tl.store(pf + M * D + st, xi, mask=mmd)


@triton.jit
def _carry_kernel(end_ptr, x0_ptr, start_ptr, last_ptr, decay_ptr, T, H, D, M, NS, L, BM: tl.constexpr,
                  BD: tl.constexpr, HAS_INIT: tl.constexpr, REV: tl.constexpr, INTERPRET: tl.constexpr):
    """Start states of a segmented scan and its last state, from each segment's end state taken from zero.

    end, start: [B, H, NS, 2, M, D] fp32; segment s covers tokens [s L, min((s + 1) L, T)). Walking the segments in
    the scan's direction from x0, the state entering a segment is stored, then carried over it by lam^length
    (conj(lam) in reverse; fp64 powers) and its end state added."""
    i_bh, i_d, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    om = i_m * BM + tl.arange(0, BM)
    od = i_d * BD + tl.arange(0, BD)
    mm, md = om < M, od < D
    mmd = mm[:, None] & md[None, :]
    st = om[:, None] * D + od[None, :]
    al = tl.load(decay_ptr + (i_h * M + om) * 2, mask=mm, other=0.0).to(tl.float64)
    th = tl.load(decay_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0).to(tl.float64)
    if REV:
        th = -th
    n_last = (T - (NS - 1) * L).to(tl.float64)
    fr, fi = tl.exp(L * al) * tl.cos(L * th), tl.exp(L * al) * tl.sin(L * th)
    lr, li = tl.exp(n_last * al) * tl.cos(n_last * th), tl.exp(n_last * al) * tl.sin(n_last * th)
    xr = tl.zeros([BM, BD], dtype=tl.float32)
    xi = tl.zeros([BM, BD], dtype=tl.float32)
    if HAS_INIT:
        xr = tl.load(x0_ptr + i_bh * 2 * M * D + st, mask=mmd, other=0.0)
        xi = tl.load(x0_ptr + i_bh * 2 * M * D + M * D + st, mask=mmd, other=0.0)
    # the interpreter (numpy >= 2.4) cannot take a runtime range() bound
    if INTERPRET:
        j = 0
        while j < NS:
            xr, xi = _carry_step(j, xr, xi, end_ptr, start_ptr, fr, fi, lr, li, i_bh, NS, st, mmd, M, D, REV)
            j += 1
    else:
        for j in range(NS):
            xr, xi = _carry_step(j, xr, xi, end_ptr, start_ptr, fr, fi, lr, li, i_bh, NS, st, mmd, M, D, REV)
    tl.store(last_ptr + i_bh * 2 * M * D + st, xr, mask=mmd)
    tl.store(last_ptr + i_bh * 2 * M * D + M * D + st, xi, mask=mmd)


@triton.jit
def _carry_step(j, xr, xi, end_ptr, start_ptr, fr, fi, lr, li, i_bh, NS, st, mmd, M, D, REV: tl.constexpr):
    if REV:
        s = NS - 1 - j
    else:
        s = j
    p = (i_bh * NS + s) * 2 * M * D + st
    tl.store(start_ptr + p, xr, mask=mmd)
    tl.store(start_ptr + p + M * D, xi, mask=mmd)
    last = s == NS - 1
    pr = tl.where(last, lr, fr).to(tl.float32)[:, None]
    pi = tl.where(last, li, fi).to(tl.float32)[:, None]
    xr, xi = _cmul(pr, pi, xr, xi)
    return xr + tl.load(end_ptr + p, mask=mmd, other=0.0), xi + tl.load(end_ptr + p + M * D, mask=mmd, other=0.0)


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
        lr, li = _pow(pw, oc[:, None], om[None, :], mm[None, :], M)
        hr = tl.dot(sheared, lr.to(DT), input_precision=PREC)
        hi = tl.dot(sheared, li.to(DT), input_precision=PREC)
    sr, si = _pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
    pr, pi = _cmul(sr, si, pr, pi)
    ar, ai = _cmul(br, bi, hr, hi)
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
    ar, ai, _, _, _ = _readout_a(q_ptr, k_ptr, ub, pw, br[None, :], bi[None, :], rows, ok, oc, om, mm, M, K, C, BK,
                                 BM, PREC, STACK)
    if STACK:
        gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
        _fwd_o_stacked(v_ptr, o_ptr, gb, b_ptr, pw, ar, ai, rows, ok, oc, om, mm, i_h, M, V, C, BM, BV, PREC)
    else:
        ptr_, pti = _pow(pw, oc[None, :], om[:, None], mm[:, None], M)
        ptr_, pti = _cmul(br[:, None], bi[:, None], ptr_, pti)
        w = _w_matrix(ar, ai, ptr_, pti, oc, DT, PREC).to(DT)
        sr, si = _pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
        xr, xi = _cmul(ar, ai, sr, -si)
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
                      BV: tl.constexpr, PREC: tl.constexpr):
    """_fwd_kernel with the readout P [H, M, M, 2] (re, im): o reads a P instead of a (README.md, "Full readout");
    on stacked operands at every mode tile."""
    ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi = _chunk_program(b_ptr, pw_ptr, T, H, M, C, BM)
    ub = ub_ptr + (i_bh * NC + ic) * 2 * M * K
    ar, ai, _, _, _ = _readout_a(q_ptr, k_ptr, ub, pw, br[None, :], bi[None, :], rows, ok, oc, om, mm, M, K, C, BK,
                                 BM, PREC, True)
    ar, ai = _mix_modes(ar, ai, p_ptr, i_h, om, mm, M, PREC, False)
    gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
    _fwd_o_stacked(v_ptr, o_ptr, gb, b_ptr, pw, ar, ai, rows, ok, oc, om, mm, i_h, M, V, C, BM, BV, PREC)


@triton.jit
def _mix_modes(xr, xi, p_ptr, i_h, om, mm, M, PREC: tl.constexpr, ADJOINT: tl.constexpr):
    """x P (ADJOINT: x P^H) for per-token rows x [C, BM] (re, im, fp32) and the head's P [M, M] (re, im)."""
    mp = mm[:, None] & mm[None, :]
    if ADJOINT:
        pp = p_ptr + ((i_h * M + om[None, :]) * M + om[:, None]) * 2
        pr, pi = tl.load(pp, mask=mp, other=0.0), -tl.load(pp + 1, mask=mp, other=0.0)
    else:
        pp = p_ptr + ((i_h * M + om[:, None]) * M + om[None, :]) * 2
        pr, pi = tl.load(pp, mask=mp, other=0.0), tl.load(pp + 1, mask=mp, other=0.0)
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
    lr, li = _pow(pw, n, m2, mk, M)
    return tl.where(p2 == 0, br2 * lr - bi2 * li, br2 * li + bi2 * lr)


@triton.jit
def _fwd_o_stacked(v_ptr, o_ptr, gb, b_ptr, pw, ar, ai, rows, ok, oc, om, mm, i_h, M, V: tl.constexpr,
                   C: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """o = W V + Re((a conj lam^(j+1)) conj Gamma_c) with the products over the modes on interleaved [., 2 BM]
    operands (STACK)."""
    DT = v_ptr.dtype.element_ty
    m2, p2, mk2, br2, bi2 = _b_modes2(b_ptr, i_h, M, BM)
    pt2 = _bpow2(pw, oc[None, :], m2[:, None], p2[:, None], br2[:, None], bi2[:, None], mk2[:, None], M)
    w = _shear_lower(tl.dot(_join2(ar, ai, C, BM).to(DT), pt2.to(DT), input_precision=PREC), oc).to(DT)
    sr, si = _pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
    xr, xi = _cmul(ar, ai, sr, -si)
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
    _bwd_a(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, b_ptr, a_ptr, da_ptr,
           T, NC, H, M, K, V, C, BM, BK, BV, PREC, False)


@triton.jit
def _bwd_a_mixed_kernel(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, p_ptr,
                        araw_ptr, dar_ptr, T, NC, H, M, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """_bwd_a_kernel with the readout P: also stores the unmixed a and d(a P) (araw, dar) for dP on the host."""
    _bwd_a(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, p_ptr, araw_ptr,
           dar_ptr, T, NC, H, M, K, V, C, BM, BK, BV, PREC, True)


@triton.jit
def _bwd_a(q_ptr, k_ptr, v_ptr, do_ptr, ub_ptr, gb_ptr, b_ptr, pw_ptr, a_ptr, da_ptr, part_ptr, p_ptr, araw_ptr,
           dar_ptr, T, NC, H, M, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
           BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, MIXED: tl.constexpr):
    """a and da per token plus the intra-chunk parameter partials. MIXED (a readout P, o = Re(a P conj Gamma)): the
    dO side's readout is d(a P); the q side takes da = d(a P) P^H and the Gamma side a P, so a_ptr gets a P and
    da_ptr da, and the scans and gradient launches after this one run unchanged."""
    ic, i_bh, i_h, oc, ok, rows, om, mm, pw, br, bi = _chunk_program(b_ptr, pw_ptr, T, H, M, C, BM)
    DT = q_ptr.dtype.element_ty
    br = br[None, :]
    bi = bi[None, :]
    ub = ub_ptr + (i_bh * NC + ic) * 2 * M * K
    gb = gb_ptr + (i_bh * NC + ic) * 2 * M * V
    ar, ai, par, pai, shq = _readout_a(q_ptr, k_ptr, ub, pw, br, bi, rows, ok, oc, om, mm, M, K, C, BK, BM, PREC)
    gr, gi, pgr, pgi, shd = _readout_a(do_ptr, v_ptr, gb, pw, br, bi, rows, ok, oc, om, mm, M, V, C, BV, BM, PREC)
    out = rows[:, None] * 2 * M + om[None, :]
    mo = ok[:, None] & mm[None, :]
    if MIXED:
        tl.store(araw_ptr + out, ar, mask=mo)
        tl.store(araw_ptr + out + M, ai, mask=mo)
        tl.store(dar_ptr + out, gr, mask=mo)
        tl.store(dar_ptr + out + M, gi, mask=mo)
        ar, ai = _mix_modes(ar, ai, p_ptr, i_h, om, mm, M, PREC, False)
        gr, gi = _mix_modes(gr, gi, p_ptr, i_h, om, mm, M, PREC, True)
    tl.store(a_ptr + out, ar.to(a_ptr.dtype.element_ty), mask=mo)
    tl.store(a_ptr + out + M, ai.to(a_ptr.dtype.element_ty), mask=mo)
    tl.store(da_ptr + out, gr.to(da_ptr.dtype.element_ty), mask=mo)
    tl.store(da_ptr + out + M, gi.to(da_ptr.dtype.element_ty), mask=mo)
    # d(log lam), intra-chunk x inter-chunk: sum_t (j+1) [da conj(a_inter) + a conj(da_inter)]
    wj = (oc + 1).to(tl.float32)[:, None]
    lr = tl.sum(wj * (gr * par + gi * pai + ar * pgr + ai * pgi), 0)
    li = tl.sum(wj * (gi * par - gr * pai + ai * pgr - ar * pgi), 0)
    # (storing the dO side's four [C, M] tiles and reading them back after the q side cut the spills from 292 to
    # 184 B but saved only 0.03 of 2.47 ms for a [B, T, H, 2, M] scratch buffer: interdomain-sweep-plans-2026-11-30)
    # lag sums c[n, m] = sum_t A[t, t-n] da_t + Ag[t, t-n] a_t (A = Q K^T, Ag = dO V^T): D^T da + Dg^T a with the
    # sheared D, Dg of the readouts. Transposing them (a gather result, not a dot result: the Hopper miscompile of
    # flash-linear-attention issue 640 is tl.trans of a tl.dot) replaced a second, transposed Q K^T and dO V^T
    # product: bwd_a 2.56 against 3.66 ms on the H200 (interdomain-sweep-2026-11-30.md), spills 310 against 488 B
    sh = tl.trans(shq)
    shg = tl.trans(shd)
    cr = tl.dot(sh, gr.to(DT), input_precision=PREC) + tl.dot(shg, ar.to(DT), input_precision=PREC)
    ci = tl.dot(sh, gi.to(DT), input_precision=PREC) + tl.dot(shg, ai.to(DT), input_precision=PREC)
    nr, ni = _pow(pw, oc[:, None], om[None, :], mm[None, :], M)
    dbr = tl.sum(nr * cr + ni * ci, 0)
    dbi = tl.sum(nr * ci - ni * cr, 0)
    qr, qi = _cmul(br, bi, nr, ni)
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
    tools/results/interdomain-2026-11-30-6fcc793.md). The dk / dv launches spill (138 B); taking the state sums
    <S, U_c> in a loop of their own spilled more (154 B) and ran slower, 1.41 against 1.33 ms
    (interdomain-sweep-plans-2026-11-30.md)."""
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
        ptr_, pti = _pow(pw, oc[None, :], om[:, None], mm[:, None], M)
        ptr_, pti = _cmul(br[:, None], bi[:, None], ptr_, pti)
        wd = _w_matrix(gr, gi, ptr_, pti, oc, DT, PREC).to(DT)
        # inter-chunk coefficients: da conj(lam^(j+1)) against U_c
        sr, si = _pow(pw, oc[:, None] + 1, om[None, :], mm[None, :], M)
        xr, xi = _cmul(gr, gi, sr, -si)
        _grad_dq(dq_ptr, k_ptr, wd, xr.to(DT), xi.to(DT), ub, rows, ok, om, mm, M, K, BK, PREC)
    else:
        # b lam^n as [C, BM]; b lam^(L-1-j) against the reverse states; dk takes da (W_da^T q), dv a (W^T dO)
        pr_, pi_ = _pow(pw, oc[:, None], om[None, :], mm[None, :], M)
        pr_, pi_ = _cmul(br[None, :], bi[None, :], pr_, pi_)
        er, ei = _pow(pw, tl.maximum(L - 1 - oc, 0)[:, None], om[None, :], ok[:, None] & mm[None, :], M)
        yr, yi = _cmul(br[None, :], bi[None, :], er, ei)
        if PART == 2:
            _, _, ctr, cti = _load_coef(da_ptr, rows, ok, oc, om, mm, M)
            wt = _w_matrix_t(pr_, pi_, ctr, cti, oc, DT, PREC).to(DT)
            zsr, zsi, sur, sui = _grad_rev(dk_ptr, q_ptr, k_ptr, wt, yr.to(DT), yi.to(DT), rub_ptr + cs * K, ub,
                                           rows, ok, om, mm, M, K, C, BK, BM, PREC)
        else:
            _, _, ctr, cti = _load_coef(a_ptr, rows, ok, oc, om, mm, M)
            wt = _w_matrix_t(pr_, pi_, ctr, cti, oc, DT, PREC).to(DT)
            zsr, zsi, sur, sui = _grad_rev(dv_ptr, do_ptr, v_ptr, wt, yr.to(DT), yi.to(DT), rgb_ptr + cs * V, gb,
                                           rows, ok, om, mm, M, V, C, BV, BM, PREC)
        _state_partials(part_ptr, zsr, zsi, sur, sui, er, ei, br, bi, pw, L, oc, om, mm, i_bh, NC, ic, M)


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
    nr, ni = _pow(pw, L, om, mm, M)
    lf = L.to(tl.float32)
    lr += lf * (nr * sur + ni * sui)
    li += lf * (nr * sui - ni * sur)
    pp = part_ptr + (i_bh * NC + ic) * 4 * M + om
    tl.store(pp, dbr, mask=mm)
    tl.store(pp + M, dbi, mask=mm)
    tl.store(pp + 2 * M, lr, mask=mm)
    tl.store(pp + 3 * M, li, mask=mm)


# 4 warps everywhere: 8 warps measured slower for the whole op (17.1 vs 14.3 ms at 8K, interdomain-v2-2026-11-30.md)
# and for every kernel alone (interdomain-sweep-2026-11-30.md: fwd 1.92 vs 1.13 ms, bwd_a 4.77 vs 2.56, dq / dk / dv
# 1.14 / 1.91 / 1.91 vs 0.62 / 1.32 / 1.32); capping registers at 128 or 168 per thread spilled more (22.4, 18.1 ms)
NUM_WARPS = {"scan": 4, "fwd": 4, "bwd_a": 4, "bwd_dq": 4, "bwd_dk": 4, "bwd_dv": 4}
# scans with the full-chunk decay tables hoisted out of the chunk loop and the next chunk's features (and per-token
# coefficients) loaded one chunk ahead. Measured on the H200 (ms per scan, M = 32, T = 2K / 64K unsegmented):
# per-token reverse 0.315 / 1.437 plain, 0.260 / 0.931 hoisted; constant-b forward 0.239 / 0.686 plain, 0.194 /
# 0.838 hoisted: hoisting lost only on 1024-chunk loops, which segmented scans (below) no longer run.
SCAN_HOIST = {"const": True, "per_token": True}
# Smallest (mode, feature) tiles of the readout kernels on the GPU. Triton 3.6 on sm_90 builds the dq, dk and dv
# kernels with 32-wide feature tiles wrongly (tools/results/interdomain-tile-probe-2026-11-30.md: relative RMS
# 1.2-4.7 against 64-wide tiles; illegal addresses in earlier builds), so features pad (masked) to 64. 32-mode tiles
# run correctly in every kernel but the plain forward (relative RMS 3.6; an illegal address on Triton 3.5.1) and
# save registers at M = 32: bwd_a 0.023 against 0.032 ms, dk 0.016 / 0.022, dv 0.016 / 0.022, dq 0.013 / 0.013 in
# the probe; full-size numbers in kernels/interdomain/README.md.
GPU_MIN_TILE = (32, 64)
# The forward with a mode tile narrower than this takes its products over the modes on operands of 2 BM interleaved
# real / imaginary columns (_readout_a STACK, _fwd_o_stacked), which builds correctly at BM = 32 and ran faster than
# the plain forward padded to 64 modes (0.017 against 0.019 ms); at 64 modes the plain one is faster (0.019 against
# 0.021 ms stacked). Stacked bwd_a / dq ran no faster than plain 32-mode tiles (0.025 / 0.012 ms) and the stacked
# dk / dv did not build on the GPU, so the backward has no stacked form.
FWD_STACK_BELOW = 64
# Scans over fewer than SCAN_SEGMENT_BELOW (b, h, state tile) rows and more than SCAN_SEGMENT_ABOVE chunks run in
# segments of SCAN_SEGMENT chunks (0: never). Measured on the H200 at B*T = 64K, H = 16, D = 128, M = 32: one const /
# per-token reverse scan at 64K tokens per row 0.81 / 0.86 ms unsegmented, 0.36 / 0.47 in segments of 32 (0.20 for
# the backward's const scans from the forward's starts); at 8K unsegmented with narrower tiles 0.26 / 0.37 against
# 0.33 / 0.45 (interdomain-scan-sweep-2026-11-30.md). The whole op forward+backward, segmenting above 64 / 128 / 256
# / 512 chunks: 8K 6.39 / 6.22 / 6.22 / 6.22 ms, 16K 6.40 / 6.40 / 6.77 / 6.78, 32K 6.43 / 6.43 / 6.43 / 7.30.
SCAN_SEGMENT, SCAN_SEGMENT_BELOW, SCAN_SEGMENT_ABOVE = 32, 512, 128
# a scan's (mode, feature) state tile per program, before narrowing for few rows
SCAN_TILE = (32, 64)
# The readout kernels (_fwd_mixed_kernel, _bwd_a_mixed_kernel) are checked under the interpreter only: until the
# GPU tests pass on the H200, a readout on the GPU runs the torch path (torch_chunk.py) instead
READOUT_ON_GPU = False


def powers(decay: torch.Tensor, C: int) -> torch.Tensor:
    """lam^n for n = 0..C as [H, C + 1, 2, M] fp32 (re, im planes), computed on the device in fp64."""
    H, M = decay.shape[:2]
    pw = decay.new_empty(H, C + 1, 2, M)
    _powers_kernel[(H,)](decay, pw, M, C=C, NP=_next_pow2(C + 1), BM=_next_pow2(M))
    return pw


def _scan_plan(B, H, D, M, NC):
    """Chunks per segment (NC: unsegmented) and the (mode, feature) state tile of one scan."""
    BM, BD = min(_next_pow2(M), SCAN_TILE[0]), min(_next_pow2(D), SCAN_TILE[1])
    rows = lambda: B * H * triton.cdiv(D, BD) * triton.cdiv(M, BM)  # noqa: E731
    if rows() >= SCAN_SEGMENT_BELOW:
        return NC, BM, BD
    if SCAN_SEGMENT and NC > SCAN_SEGMENT_ABOVE:
        return min(SCAN_SEGMENT, NC), BM, BD
    # few rows and chunks: narrower tiles spread the sequential chunk loop over more SMs (16 x 16 was slower still:
    # one scan at T = 64K unsegmented, 1.01 ms against 0.69 ms at 16 x 32)
    BM = min(BM, 16)
    if rows() < SCAN_SEGMENT_BELOW:
        BD = min(BD, 32)
    return NC, BM, BD


def scan(z, b, pw, decay, C, c=None, x0=None, rev=False, starts=None):
    """Chunk-boundary states of X_t = lam X_{t-1} + coef_t z_t (coef = b, or c [B, T, H, 2, M] per token).

    rev: the adjoint S_{c-1} = conj(lam)^L S_c + sum_j conj(lam)^(j+1) c_j z_j over the same chunks, from the last
    chunk back. x0: [B, H, 2, M, D] fp32 or None. Returns the states [B, H, NC, 2, M, D] in z's dtype (before each
    chunk in the scan's direction), the last one [B, H, 2, M, D] fp32 (None when `starts` was given) and the
    segments' start states [B, H, NS, 2, M, D] fp32 (None unsegmented).

    With few (b, h) rows (long sequences) the chunk loop is latency-bound on a few SMs, so the sequence is cut into
    segments of SCAN_SEGMENT chunks that run side by side: a first pass takes each segment's end state from zero
    (no stores), _carry_kernel carries them across segments, and a second pass stores the boundaries. `starts`,
    from an earlier scan of the same z, b and x0 (the backward recomputing the forward's states), skips the first
    pass and the carry."""
    B, T, H, D = z.shape
    M, NC = b.shape[1], triton.cdiv(T, C)
    seg, BM, BD = _scan_plan(B, H, D, M, NC)
    NS = triton.cdiv(NC, seg)
    xb = z.new_empty(B, H, NC, 2, M, D)
    xf = z.new_empty(B, H, NS, 2, M, D, dtype=torch.float32)
    grid = (B * H * NS, triton.cdiv(D, BD), triton.cdiv(M, BM))

    def run(start, store):
        _scan_kernel[grid](z, c if c is not None else z, b, pw, start if start is not None else z, xb, xf, T, NC,
                           H, D, M, NS, seg, C=C, BM=BM, BD=BD, PER_TOKEN=c is not None, HAS_INIT=start is not None,
                           REV=rev, PREC=_prec(z), HOIST=SCAN_HOIST["per_token" if c is not None else "const"],
                           STORE=store, INTERPRET=_interpret(), num_warps=NUM_WARPS["scan"])

    if NS == 1:
        run(x0, True)
        return xb, xf[:, :, 0], None
    if starts is not None:
        if starts.shape != xf.shape:
            raise RuntimeError(f"scan: segment starts {tuple(starts.shape)} do not fit this scan's {tuple(xf.shape)}")
        run(starts, True)
        return xb, None, starts
    run(None, False)
    starts = torch.empty_like(xf)
    last = z.new_empty(B, H, 2, M, D, dtype=torch.float32)
    _carry_kernel[(B * H, triton.cdiv(D, BD), triton.cdiv(M, BM))](
        xf, x0 if x0 is not None else xf, starts, last, decay, T, H, D, M, NS, seg * C, BM=BM, BD=BD,
        HAS_INIT=x0 is not None, REV=rev, INTERPRET=_interpret(), num_warps=NUM_WARPS["scan"])
    run(starts, True)
    return xb, last, starts


def _sizes(q, v, b):
    """Mode and feature tiles of the readout kernels for these shapes."""
    lo_m, lo_d = (16, 16) if _interpret() else GPU_MIN_TILE
    return dict(K=q.shape[-1], V=v.shape[-1], BM=_next_pow2(b.shape[1], lo_m),
                BK=min(_next_pow2(q.shape[-1], lo_d), 64), BV=min(_next_pow2(v.shape[-1], lo_d), 64), PREC=_prec(q))


def interdomain_fwd(q, k, v, decay, b, u0=None, g0=None, chunk_size=64, p=None):
    """Forward. q, k [B, T, H, K], v [B, T, H, V]; u0/g0 [B, H, 2, M, K/V] fp32 or None; p: the readout's
    P = C^T conj(C) as [H, M, M, 2] fp32, or None (identity).

    Returns o [B, T, H, V], the final U, G [B, H, 2, M, K/V] fp32 and the U and G scans' segment start states (None
    unsegmented; small: one state per SCAN_SEGMENT chunks) for the backward."""
    B, T, H, _ = q.shape
    C, M, NC = chunk_size, b.shape[1], triton.cdiv(T, chunk_size)
    pw = powers(decay, C)
    ub, uf, su = scan(k, b, pw, decay, C, x0=u0)
    gb, gf, sg = scan(v, b, pw, decay, C, x0=g0)
    o = torch.empty_like(v)
    sizes = _sizes(q, v, b)
    if p is None:
        _fwd_kernel[(NC, B * H)](q, k, v, ub, gb, b, pw, o, T, NC, H, M, C=C, **sizes,
                                 STACK=sizes["BM"] < FWD_STACK_BELOW, num_warps=NUM_WARPS["fwd"])
    else:
        _fwd_mixed_kernel[(NC, B * H)](q, k, v, ub, gb, b, pw, p, o, T, NC, H, M, C=C, **sizes,
                                       num_warps=NUM_WARPS["fwd"])
    return o, uf, gf, (su, sg)


def interdomain_bwd(q, k, v, decay, b, u0, g0, do, duf, dgf, chunk_size=64, starts=(None, None), p=None):
    """Backward: dq, dk, dv, ddecay, db, du0, dg0 (du0/dg0 None when there was no initial state), dp (None without
    a readout). starts: the forward's segment start states (interdomain_fwd), so that recomputing its states takes
    one pass over k and v."""
    B, T, H, _ = q.shape
    C, M, NC = chunk_size, b.shape[1], triton.cdiv(T, chunk_size)
    pw = powers(decay, C)
    ub, _, _ = scan(k, b, pw, decay, C, x0=u0, starts=starts[0])
    gb, _, _ = scan(v, b, pw, decay, C, x0=g0, starts=starts[1])
    # a and da feed bf16 products and scan coefficients only, so a 16-bit copy of bf16 runs loses nothing
    cdt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    a = q.new_empty(B, T, H, 2, M, dtype=cdt)
    da = q.new_empty(B, T, H, 2, M, dtype=cdt)
    part_a = q.new_empty(B, H, NC, 4, M, dtype=torch.float32)
    sizes = _sizes(q, v, b)
    dp = None
    if p is None:
        _bwd_a_kernel[(NC, B * H)](q, k, v, do, ub, gb, b, pw, a, da, part_a, T, NC, H, M, C=C, **sizes,
                                   num_warps=NUM_WARPS["bwd_a"])
    else:
        araw, dar = torch.empty_like(a, dtype=torch.float32), torch.empty_like(a, dtype=torch.float32)
        _bwd_a_mixed_kernel[(NC, B * H)](q, k, v, do, ub, gb, b, pw, a, da, part_a, p, araw, dar, T, NC, H, M, C=C,
                                         **sizes, num_warps=NUM_WARPS["bwd_a"])
        # dP[m, n] = sum over tokens of conj(a_m) d(a P)_n
        cplx = lambda x: torch.complex(x[..., 0, :], x[..., 1, :])  # noqa: E731
        dp = torch.view_as_real(torch.einsum("bthm,bthn->hmn", cplx(araw).conj(), cplx(dar)))
    rub, du0, _ = scan(q, b, pw, decay, C, c=da, x0=duf, rev=True)
    rgb, dg0, _ = scan(do, b, pw, decay, C, c=a, x0=dgf, rev=True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    part_m = q.new_empty(2, B, H, NC, 4, M, dtype=torch.float32)  # the dk and dv shares; dq writes none
    for part, slot, key in ((1, 0, "bwd_dq"), (2, 0, "bwd_dk"), (4, 1, "bwd_dv")):
        _bwd_part_kernel[(NC, B * H)](q, k, v, do, a, da, ub, gb, rub, rgb, b, pw, dq, dk, dv, part_m[slot], T, NC,
                                      H, M, C=C, **sizes, PART=part, num_warps=NUM_WARPS[key])
    sums = (part_a.double() + part_m.double().sum(0)).sum((0, 2))  # [H, 4, M]
    ddecay = torch.stack((sums[:, 2], sums[:, 3]), -1).float()
    dbb = torch.stack((sums[:, 0], sums[:, 1]), -1).float()
    return dq, dk, dv, ddecay, dbb, du0 if u0 is not None else None, dg0 if g0 is not None else None, dp


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _prec(t: torch.Tensor) -> str:
    # fp32 on the GPU: 3xTF32 keeps ~1e-6 relative error on tensor cores; full-FMA "ieee" dots take minutes to build
    if t.dtype != torch.float32:
        return "tf32"
    return "ieee" if _interpret() else "tf32x3"


class InterdomainFunction(torch.autograd.Function):
    """The forward keeps the inputs and, for long sequences, its scans' segment start states; the backward
    recomputes the chunk-boundary states from them."""

    @staticmethod
    def forward(ctx, q, k, v, decay, b, u0, g0, chunk_size, p=None):
        o, uf, gf, starts = interdomain_fwd(q, k, v, decay, b, u0, g0, chunk_size, p)
        ctx.save_for_backward(q, k, v, decay, b, u0, g0, p, *starts)
        ctx.chunk_size = chunk_size
        return o, uf, gf

    @staticmethod
    def backward(ctx, do, duf, dgf):
        q, k, v, decay, b, u0, g0, p, su, sg = ctx.saved_tensors
        *grads, dp = interdomain_bwd(q, k, v, decay, b, u0, g0, do.contiguous(), _opt(duf), _opt(dgf),
                                     ctx.chunk_size, (su, sg), p)
        return (*grads, None, dp)


def _opt(t):
    return None if t is None else t.contiguous().float()
