"""Chunkwise-parallel Interdomain Attention in Triton: forward and backward (see README.md for the algebra).

Three kernels, each used several times with different operands:
  scan      chunk-boundary states of X_t = lam X_{t-1} + c_t z_t   (c_t = 1, b, or a per-token complex coefficient)
  readout_a y_{m,t} = x_t . X_t[m] from b-free states (+ b, the initial-state readout, the d/d(log lam) readout)
  readout_o y_t = sum_m Re(r_{m,t} conj(X_t[m]))  (o, dq; time-reversed for dk, dv)
Per-token states never reach HBM: inside a chunk, programs walk sub-blocks of S = 16 tokens keeping the state
in registers; within a sub-block lam^(i-j) is factored around a reference token of each row's quad of 4.
"""
import os

import torch
import triton
import triton.language as tl

SUB = 16
QUAD = 4
ALPHA_MIN = -20.0

# coefficient kinds of the scan kernel (host ints; the kernels compare against the constexpr copies)
ONES, CONST_B, PER_TOKEN = 0, 1, 2
_CONST_B, _PER_TOKEN = tl.constexpr(CONST_B), tl.constexpr(PER_TOKEN)
# warps per program of each kernel: all-4 measured fastest on H200 (fwd+bwd 26.6 ms vs 34.5 ms for 4/8/4 and
# 47.9 ms for 8/8/8 at B*T = 65,536, T = 8K, M = 32; tools/results/interdomain-2026-11-30.md)
NUM_WARPS = {"scan": 4, "readout_a": 4, "readout_o": 4}


@triton.jit
def _cmul(ar, ai, br, bi):
    return ar * br - ai * bi, ar * bi + ai * br


@triton.jit
def _re_conj(ar, ai, br, bi):
    return ar * br + ai * bi


@triton.jit
def _im_conj(ar, ai, br, bi):
    return ai * br - ar * bi


@triton.jit
def _scan_step(ic, xr, xi, dr, di, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, db_ptr, i_b, i_h, i_bh, om, od, oc, mm, md, mmd,
               st, T, NC, H, D, M, C: tl.constexpr, PB: tl.constexpr,
               COEF: tl.constexpr, DERIV: tl.constexpr, REV: tl.constexpr, INIT_SHIFT: tl.constexpr,
               PREC: tl.constexpr):
    DT = z_ptr.dtype.element_ty
    pb = xb_ptr + (i_bh * NC + ic) * 2 * M * D
    tl.store(pb + st, xr, mask=mmd)
    tl.store(pb + M * D + st, xi, mask=mmd)
    if DERIV:
        pd = db_ptr + (i_bh * NC + ic) * 2 * M * D
        tl.store(pd + st, dr, mask=mmd)
        tl.store(pd + M * D + st, di, mask=mmd)
    tau = ic * C + oc
    ok = tau < T
    L = tl.minimum(T - ic * C, C)
    if REV:
        t = T - 1 - tau
    else:
        t = tau
    row = (i_b * T + t) * H + i_h
    zt = tl.load(z_ptr + row[:, None] * D + od[None, :], mask=ok[:, None] & md[None, :], other=0.0).to(DT)
    e = tl.maximum(L - 1 - oc, 0)
    pe = pw + e[None, :] * 2 * PB + om[:, None]
    mk = mm[:, None] & ok[None, :]
    er = tl.load(pe, mask=mk, other=0.0)
    ei = tl.load(pe + PB, mask=mk, other=0.0)
    if COEF == _CONST_B:
        er, ei = _cmul(er, ei, cbr, cbi)
    if COEF == _PER_TOKEN:
        pc = c_ptr + row[None, :] * 2 * M + om[:, None]
        er, ei = _cmul(er, ei, tl.load(pc, mask=mk, other=0.0), tl.load(pc + M, mask=mk, other=0.0))
    ur = tl.dot(er.to(DT), zt, input_precision=PREC)
    ui = tl.dot(ei.to(DT), zt, input_precision=PREC)
    # with INIT_SHIFT the initial state joins at token 0 undecayed (a final-state gradient in reverse)
    if INIT_SHIFT:
        nl = L - (ic == 0).to(tl.int32)
    else:
        nl = L
    lr = tl.load(pw + nl * 2 * PB + om, mask=mm, other=0.0)[:, None]
    li = tl.load(pw + nl * 2 * PB + PB + om, mask=mm, other=0.0)[:, None]
    if DERIV:
        w = e.to(tl.float32)[None, :]
        vr = tl.dot((w * er).to(DT), zt, input_precision=PREC)
        vi = tl.dot((w * ei).to(DT), zt, input_precision=PREC)
        sr, si = _cmul(lr, li, xr, xi)
        gr, gi = _cmul(lr, li, dr, di)
        dr = gr + nl.to(tl.float32) * sr + vr
        di = gi + nl.to(tl.float32) * si + vi
    xr, xi = _cmul(lr, li, xr, xi)
    xr += ur
    xi += ui
    return xr, xi, dr, di


@triton.jit
def _scan_kernel(z_ptr, c_ptr, b_ptr, pw_ptr, x0_ptr, xb_ptr, xf_ptr, db_ptr, df_ptr, T, NC,
                 H, D, M, C: tl.constexpr, BM: tl.constexpr,
                 BD: tl.constexpr, PB: tl.constexpr, COEF: tl.constexpr, HAS_INIT: tl.constexpr,
                 DERIV: tl.constexpr, REV: tl.constexpr, INIT_SHIFT: tl.constexpr, PREC: tl.constexpr,
                 INTERPRET: tl.constexpr):
    i_bh, i_d, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    om = i_m * BM + tl.arange(0, BM)
    od = i_d * BD + tl.arange(0, BD)
    oc = tl.arange(0, C)
    mm, md = om < M, od < D
    mmd = mm[:, None] & md[None, :]
    st = om[:, None] * D + od[None, :]
    DT = z_ptr.dtype.element_ty
    pw = pw_ptr + i_h * (C + 1) * 2 * PB
    xr = tl.zeros([BM, BD], dtype=tl.float32)
    xi = tl.zeros([BM, BD], dtype=tl.float32)
    if HAS_INIT:
        p0 = x0_ptr + i_bh * 2 * M * D
        xr = tl.load(p0 + st, mask=mmd, other=0.0)
        xi = tl.load(p0 + M * D + st, mask=mmd, other=0.0)
    dr = tl.zeros([BM, BD], dtype=tl.float32)
    di = tl.zeros([BM, BD], dtype=tl.float32)
    cbr = tl.load(b_ptr + (i_h * M + om) * 2, mask=mm, other=0.0)[:, None]
    cbi = tl.load(b_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)[:, None]
    # the interpreter (numpy >= 2.4) cannot take a runtime range() bound; compiled code keeps the pipelined for loop
    if INTERPRET:
        ic = 0
        while ic < NC:
            xr, xi, dr, di = _scan_step(ic, xr, xi, dr, di, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, db_ptr, i_b, i_h, i_bh,
                                        om, od, oc, mm, md, mmd, st, T, NC, H, D, M, C, PB, COEF, DERIV, REV,
                                        INIT_SHIFT, PREC)
            ic += 1
    else:
        for ic in range(NC):
            xr, xi, dr, di = _scan_step(ic, xr, xi, dr, di, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, db_ptr, i_b, i_h, i_bh,
                                        om, od, oc, mm, md, mmd, st, T, NC, H, D, M, C, PB, COEF, DERIV, REV,
                                        INIT_SHIFT, PREC)
    pf = xf_ptr + i_bh * 2 * M * D
    tl.store(pf + st, xr, mask=mmd)
    tl.store(pf + M * D + st, xi, mask=mmd)
    if DERIV:
        pf = df_ptr + i_bh * 2 * M * D
        tl.store(pf + st, dr, mask=mmd)
        tl.store(pf + M * D + st, di, mask=mmd)


@triton.jit
def _readout_a_kernel(x_ptr, z_ptr, xb_ptr, db_ptr, x0_ptr, b_ptr, pw_ptr, cpw_ptr, rr_ptr, cr_ptr, rrd_ptr, crd_ptr,
                      y_ptr, yb_ptr, yl_ptr, pa_ptr, part_ptr, T, NC,
                      H, D, M, C: tl.constexpr, S: tl.constexpr,
                      BM: tl.constexpr, BD: tl.constexpr, PB: tl.constexpr, HAS_INIT: tl.constexpr,
                      DERIV: tl.constexpr, PARTNER: tl.constexpr, PREC: tl.constexpr):
    # PARTNER: yb_ptr / yl_ptr hold the other path's (a, a_hat, a_ell) = (y, yb, yl) of y_ptr's layout; instead of
    # storing this path's a_hat and a_ell, accumulate sum_t y conj(partner_hat) + partner conj(y_hat) (db) and the
    # same with the log-lambda derivatives into part_ptr [B*H, NC, 4, M]
    ic, i_m, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NQ: tl.constexpr = S // 4
    om = i_m * BM + tl.arange(0, BM)
    od = tl.arange(0, BD)
    os = tl.arange(0, S)
    mm, md = om < M, od < D
    mt = md[:, None] & mm[None, :]
    stt = om[None, :] * D + od[:, None]
    DT = x_ptr.dtype.element_ty
    pw = pw_ptr + i_h * (C + 1) * 2 * PB
    pb = xb_ptr + (i_bh * NC + ic) * 2 * M * D
    xr = tl.load(pb + stt, mask=mt, other=0.0).to(tl.float32)
    xi = tl.load(pb + M * D + stt, mask=mt, other=0.0).to(tl.float32)
    dr = tl.zeros([BD, BM], dtype=tl.float32)
    di = tl.zeros([BD, BM], dtype=tl.float32)
    if DERIV:
        pd = db_ptr + (i_bh * NC + ic) * 2 * M * D
        dr = tl.load(pd + stt, mask=mt, other=0.0).to(tl.float32)
        di = tl.load(pd + M * D + stt, mask=mt, other=0.0).to(tl.float32)
    if HAS_INIT:
        p0 = x0_ptr + i_bh * 2 * M * D
        x0r = tl.load(p0 + stt, mask=mt, other=0.0).to(DT)
        x0i = tl.load(p0 + M * D + stt, mask=mt, other=0.0).to(DT)
        pc0 = cpw_ptr + (i_h * NC + ic) * 2 * PB + om
        c0r = tl.load(pc0, mask=mm, other=0.0)[None, :]
        c0i = tl.load(pc0 + PB, mask=mm, other=0.0)[None, :]
    br = tl.load(b_ptr + (i_h * M + om) * 2, mask=mm, other=0.0)[None, :]
    bi = tl.load(b_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)[None, :]
    tab = os[:, None] * 2 * PB + om[None, :]
    rrr = tl.load(rr_ptr + i_h * S * 2 * PB + tab)
    rri = tl.load(rr_ptr + i_h * S * 2 * PB + PB + tab)
    ln_r = tl.load(pw + 2 * PB + tab)
    ln_i = tl.load(pw + 3 * PB + tab)
    causal = os[None, :] <= os[:, None]
    sbr = tl.zeros([BM], dtype=tl.float32)
    sbi = tl.zeros([BM], dtype=tl.float32)
    slr = tl.zeros([BM], dtype=tl.float32)
    sli = tl.zeros([BM], dtype=tl.float32)
    for s in range(C // S):
        t0 = ic * C + s * S
        if t0 < T:
            t = t0 + os
            ok = t < T
            row = (i_b * T + t) * H + i_h
            xs = tl.load(x_ptr + row[:, None] * D + od[None, :], mask=ok[:, None] & md[None, :], other=0.0).to(DT)
            zt = tl.load(z_ptr + row[None, :] * D + od[:, None], mask=md[:, None] & ok[None, :], other=0.0).to(DT)
            pr = tl.dot(xs, xr.to(DT), input_precision=PREC)
            pi = tl.dot(xs, xi.to(DT), input_precision=PREC)
            yr, yi = _cmul(pr, pi, ln_r, ln_i)
            if DERIV:
                qr = tl.dot(xs, dr.to(DT), input_precision=PREC)
                qi = tl.dot(xs, di.to(DT), input_precision=PREC)
                zr, zi = _cmul(qr, qi, ln_r, ln_i)
                nn = (os + 1).to(tl.float32)[:, None]
                zr += nn * yr
                zi += nn * yi
            att = tl.dot(xs, zt, input_precision=PREC)
            att = tl.where(causal & ok[None, :], att, 0.0).to(DT)
            ir = tl.zeros([S, BM], dtype=tl.float32)
            ii = tl.zeros([S, BM], dtype=tl.float32)
            jr = tl.zeros([S, BM], dtype=tl.float32)
            ji = tl.zeros([S, BM], dtype=tl.float32)
            for q in tl.static_range(NQ):
                sel = (os // 4 == q)[:, None]
                pq = cr_ptr + (i_h * NQ + q) * S * 2 * PB + tab
                ir += tl.where(sel, tl.dot(att, tl.load(pq).to(DT), input_precision=PREC), 0.0)
                ii += tl.where(sel, tl.dot(att, tl.load(pq + PB).to(DT), input_precision=PREC), 0.0)
                if DERIV:
                    pq = crd_ptr + (i_h * NQ + q) * S * 2 * PB + tab
                    jr += tl.where(sel, tl.dot(att, tl.load(pq).to(DT), input_precision=PREC), 0.0)
                    ji += tl.where(sel, tl.dot(att, tl.load(pq + PB).to(DT), input_precision=PREC), 0.0)
            hr, hi = _cmul(rrr, rri, ir, ii)
            yr += hr
            yi += hi
            ar, ai = _cmul(br, bi, yr, yi)
            if DERIV:
                gr, gi = _cmul(rrr, rri, jr, ji)
                zr += gr
                zi += gi
                pq = rrd_ptr + i_h * S * 2 * PB + tab
                gr, gi = _cmul(tl.load(pq), tl.load(pq + PB), ir, ii)
                zr += gr
                zi += gi
                lr_, li_ = _cmul(br, bi, zr, zi)
            if HAS_INIT:
                er = tl.dot(xs, x0r, input_precision=PREC)
                ei = tl.dot(xs, x0i, input_precision=PREC)
                pq = pw + (s * S + 1) * 2 * PB + tab
                fr, fi = _cmul(c0r, c0i, tl.load(pq), tl.load(pq + PB))
                er, ei = _cmul(er, ei, fr, fi)
                ar += er
                ai += ei
                if DERIV:
                    tt = (t + 1).to(tl.float32)[:, None]
                    lr_ += tt * er
                    li_ += tt * ei
            out = row[:, None] * 2 * M + om[None, :]
            mo = ok[:, None] & mm[None, :]
            tl.store(y_ptr + out, ar, mask=mo)
            tl.store(y_ptr + out + M, ai, mask=mo)
            if PARTNER:
                par = tl.load(pa_ptr + out, mask=mo, other=0.0)
                pai = tl.load(pa_ptr + out + M, mask=mo, other=0.0)
                pbr = tl.load(yb_ptr + out, mask=mo, other=0.0)
                pbi = tl.load(yb_ptr + out + M, mask=mo, other=0.0)
                sbr += tl.sum(_re_conj(ar, ai, pbr, pbi) + _re_conj(par, pai, yr, yi), 0)
                sbi += tl.sum(_im_conj(ar, ai, pbr, pbi) + _im_conj(par, pai, yr, yi), 0)
                plr = tl.load(yl_ptr + out, mask=mo, other=0.0)
                pli = tl.load(yl_ptr + out + M, mask=mo, other=0.0)
                slr += tl.sum(_re_conj(ar, ai, plr, pli) + _re_conj(par, pai, lr_, li_), 0)
                sli += tl.sum(_im_conj(ar, ai, plr, pli) + _im_conj(par, pai, lr_, li_), 0)
            elif DERIV:
                tl.store(yb_ptr + out, yr, mask=mo)
                tl.store(yb_ptr + out + M, yi, mask=mo)
                tl.store(yl_ptr + out, lr_, mask=mo)
                tl.store(yl_ptr + out + M, li_, mask=mo)
            if s < C // S - 1:  # no state update after the chunk's last sub-block
                pq = pw + (S - 1 - os)[:, None] * 2 * PB + om[None, :]
                ur = tl.load(pq)
                ui = tl.load(pq + PB)
                sr = tl.load(pw + S * 2 * PB + om)[None, :]
                si = tl.load(pw + S * 2 * PB + PB + om)[None, :]
                if DERIV:
                    w = (S - 1 - os).to(tl.float32)[:, None]
                    sdr, sdi = _cmul(sr, si, dr, di)
                    sxr, sxi = _cmul(sr, si, xr, xi)
                    dr = sdr + S * sxr + tl.dot(zt, (w * ur).to(DT), input_precision=PREC)
                    di = sdi + S * sxi + tl.dot(zt, (w * ui).to(DT), input_precision=PREC)
                xr, xi = _cmul(sr, si, xr, xi)
                xr += tl.dot(zt, ur.to(DT), input_precision=PREC)
                xi += tl.dot(zt, ui.to(DT), input_precision=PREC)
    if PARTNER:
        pp = part_ptr + (i_bh * NC + ic) * 4 * M + om
        tl.store(pp, sbr, mask=mm)
        tl.store(pp + M, sbi, mask=mm)
        tl.store(pp + 2 * M, slr, mask=mm)
        tl.store(pp + 3 * M, sli, mask=mm)


@triton.jit
def _readout_o_kernel(r_ptr, c_ptr, z_ptr, xb_ptr, b_ptr, pw_ptr, rr_ptr, cr_ptr, y_ptr, T, NC,
                      H, D, M, C: tl.constexpr, S: tl.constexpr,
                      BM: tl.constexpr, BD: tl.constexpr, PB: tl.constexpr, R_CONST: tl.constexpr,
                      C_CONST: tl.constexpr, REV: tl.constexpr, INIT_SHIFT: tl.constexpr, PREC: tl.constexpr):
    ic, i_d, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NQ: tl.constexpr = S // 4
    om = tl.arange(0, BM)
    od = i_d * BD + tl.arange(0, BD)
    os = tl.arange(0, S)
    mm, md = om < M, od < D
    mmd = mm[:, None] & md[None, :]
    st = om[:, None] * D + od[None, :]
    DT = z_ptr.dtype.element_ty
    pw = pw_ptr + i_h * (C + 1) * 2 * PB
    pb = xb_ptr + (i_bh * NC + ic) * 2 * M * D
    xr = tl.load(pb + st, mask=mmd, other=0.0).to(tl.float32)
    xi = tl.load(pb + M * D + st, mask=mmd, other=0.0).to(tl.float32)
    br = tl.load(b_ptr + (i_h * M + om) * 2, mask=mm, other=0.0)
    bi = tl.load(b_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0)
    tab = os[:, None] * 2 * PB + om[None, :]
    tabt = os[None, :] * 2 * PB + om[:, None]
    rrr = tl.load(rr_ptr + i_h * S * 2 * PB + tab)
    rri = tl.load(rr_ptr + i_h * S * 2 * PB + PB + tab)
    causal = os[None, :] <= os[:, None]
    sh = 0
    if INIT_SHIFT:
        sh = (ic == 0).to(tl.int32)
    for s in range(C // S):
        t0 = ic * C + s * S
        n0 = 1 - sh * (s == 0)
        ln_r = tl.load(pw + n0 * 2 * PB + tab)
        ln_i = tl.load(pw + n0 * 2 * PB + PB + tab)
        if t0 < T:
            tau = t0 + os
            ok = tau < T
            if REV:
                t = T - 1 - tau
            else:
                t = tau
            row = (i_b * T + t) * H + i_h
            zs = tl.load(z_ptr + row[:, None] * D + od[None, :], mask=ok[:, None] & md[None, :], other=0.0).to(DT)
            if R_CONST:
                rr = tl.zeros([S, BM], dtype=tl.float32) + br[None, :]
                ri = tl.zeros([S, BM], dtype=tl.float32) + bi[None, :]
            else:
                prw = r_ptr + row[:, None] * 2 * M + om[None, :]
                mo = ok[:, None] & mm[None, :]
                rr = tl.load(prw, mask=mo, other=0.0)
                ri = tl.load(prw + M, mask=mo, other=0.0)
            if C_CONST:
                ctr = tl.zeros([BM, S], dtype=tl.float32) + br[:, None]
                cti = tl.zeros([BM, S], dtype=tl.float32) + bi[:, None]
            else:
                pcw = c_ptr + row[None, :] * 2 * M + om[:, None]
                mk = mm[:, None] & ok[None, :]
                ctr = tl.load(pcw, mask=mk, other=0.0)
                cti = tl.load(pcw + M, mask=mk, other=0.0)
            # inter: sum_m Re(r conj(lam^n) conj(X))
            gr, gi = _cmul(rr, ri, ln_r, -ln_i)
            acc = tl.dot(gr.to(DT), xr.to(DT), input_precision=PREC)
            acc += tl.dot(gi.to(DT), xi.to(DT), input_precision=PREC)
            # intra: W_ij = sum_m Re(r_i conj(rowR_i) conj(c_j colR_j))
            gr, gi = _cmul(rr, ri, rrr, -rri)
            gr = gr.to(DT)
            gi = gi.to(DT)
            w = tl.zeros([S, S], dtype=tl.float32)
            for q in tl.static_range(NQ):
                pq = cr_ptr + (i_h * NQ + q) * S * 2 * PB + tabt
                kr, ki = _cmul(ctr, cti, tl.load(pq), tl.load(pq + PB))
                wq = tl.dot(gr, kr.to(DT), input_precision=PREC)
                wq += tl.dot(gi, ki.to(DT), input_precision=PREC)
                w += tl.where((os // 4 == q)[:, None], wq, 0.0)
            w = tl.where(causal & ok[None, :], w, 0.0)
            acc += tl.dot(w.to(DT), zs, input_precision=PREC)
            tl.store(y_ptr + row[:, None] * D + od[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=ok[:, None] & md[None, :])
            if s < C // S - 1:  # no state update after the chunk's last sub-block
                pq = pw + (S - 1 - os)[None, :] * 2 * PB + om[:, None]
                er, ei = _cmul(tl.load(pq), tl.load(pq + PB), ctr, cti)
                sr = tl.load(pw + (S - 1 + n0) * 2 * PB + om)[:, None]
                si = tl.load(pw + (S - 1 + n0) * 2 * PB + PB + om)[:, None]
                xr, xi = _cmul(sr, si, xr, xi)
                xr += tl.dot(er.to(DT), zs, input_precision=PREC)
                xi += tl.dot(ei.to(DT), zs, input_precision=PREC)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _prec(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


class Tables:
    """Per-head powers of lam (fp64 on the host, stored fp32 as [H, n, 2, PB] re/im planes, zero-padded modes)."""

    def __init__(self, decay: torch.Tensor, T: int, C: int, rev: bool):
        H, M = decay.shape[:2]
        self.M, self.PB = M, _next_pow2(M)
        alpha = decay[..., 0].double()
        theta = -decay[..., 1].double() if rev else decay[..., 1].double()
        ell = torch.complex(alpha, theta)
        ell_c = torch.complex(alpha.clamp(min=ALPHA_MIN), theta)
        dev = decay.device
        n = torch.arange(C + 1, device=dev, dtype=torch.float64)
        self.pw = self._planes(torch.exp(n[None, :, None] * ell[:, None, :]))
        nc = torch.arange(triton.cdiv(T, C), device=dev, dtype=torch.float64) * C
        self.cpw = self._planes(torch.exp(nc[None, :, None] * ell[:, None, :]))
        i = torch.arange(SUB, device=dev)
        off = (i - (i // QUAD) * QUAD - QUAD // 2).double()  # row i minus its quad's reference token
        row = torch.exp(off[None, :, None] * ell_c[:, None, :])
        self.rowR, self.rowRd = self._planes(row), self._planes(off[None, :, None] * row)
        rho = torch.arange(SUB // QUAD, device=dev)[:, None] * QUAD + QUAD // 2
        e = (rho - i[None, :]).double()  # reference minus column j, [NQ, S]
        keep = (i[None, :] < rho + QUAD // 2)[None, :, :, None]
        col = torch.where(keep, torch.exp(e[None, :, :, None] * ell_c[:, None, None, :]), 0)
        self.colR = self._planes(col.flatten(1, 2))
        self.colRd = self._planes((e[None, :, :, None] * col).flatten(1, 2))

    def _planes(self, z: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*z.shape[:2], 2, self.PB, dtype=torch.float32, device=z.device)
        out[:, :, 0, : self.M] = z.real
        out[:, :, 1, : self.M] = z.imag
        return out


def scan_fwd(z, b, tabs, C, coef=ONES, c=None, x0=None, deriv=False, rev=False, init_shift=False):
    """Chunk-boundary states of X_t = lam X_{t-1} + coef_t z_t (time-reversed with rev, tabs built with conj lam).

    z: [B, T, H, D]; c: [B, T, H, 2, M] fp32 when coef is PER_TOKEN; x0: [B, H, 2, M, D] fp32 or None.
    Returns states before each chunk [B, H, NC, 2, M, D] in z's dtype, the final state [B, H, 2, M, D] fp32
    (and the d/d(log lam) versions when deriv).
    """
    B, T, H, D = z.shape
    M, NC = tabs.M, triton.cdiv(T, C)
    # boundary states feed tensor-core dots in z's dtype anyway, so a 16-bit copy loses nothing and halves traffic
    xb = z.new_empty(B, H, NC, 2, M, D, dtype=z.dtype)
    xf = z.new_empty(B, H, 2, M, D, dtype=torch.float32)
    db = z.new_empty(B, H, NC, 2, M, D, dtype=z.dtype) if deriv else xb
    df = z.new_empty(B, H, 2, M, D, dtype=torch.float32) if deriv else xf
    BM = min(tabs.PB, 32)
    BD = min(_next_pow2(D), 64)
    if B * H * triton.cdiv(D, BD) * triton.cdiv(M, BM) < 264:
        # few (b, h) rows (long sequences): smaller tiles give the sequential chunk loop more SMs
        BM, BD = 16, min(BD, 32)
    grid = (B * H, triton.cdiv(D, BD), triton.cdiv(M, BM))
    _scan_kernel[grid](z, c if c is not None else z, b, tabs.pw, x0 if x0 is not None else z, xb, xf, db, df,
                       T, NC, H=H, D=D, M=M, C=C, BM=BM, BD=BD, PB=tabs.PB, COEF=coef, HAS_INIT=x0 is not None,
                       DERIV=deriv, REV=rev, INIT_SHIFT=init_shift, PREC=_prec(z),
                       INTERPRET=_interpret(), num_warps=NUM_WARPS["scan"])
    return (xb, xf, db, df) if deriv else (xb, xf)


def readout_a(x, z, xb, b, tabs, C, x0=None, db=None, partner=None):
    """a_{m,t} = x_t . (lam^(t+1) X0 + b Xhat_t)[m] from b-free states xb of (z, coefficient 1).

    Returns a [B, T, H, 2, M] fp32. With db (derivative states) also a_hat = x . Xhat and d a / d(log lam);
    with partner = the other path's (a, a_hat, a_ell) as well, instead of those two the parameter-gradient
    partial sums [B*H, NC, 4, M] = (db re, db im, dlog-lambda re, dlog-lambda im) per chunk.
    """
    B, T, H, D = x.shape
    M, NC = tabs.M, triton.cdiv(T, C)
    deriv = db is not None
    y = x.new_empty(B, T, H, 2, M, dtype=torch.float32)
    if partner is not None:
        pa, yb, yl = partner
        part = x.new_empty(B * H, NC, 4, M, dtype=torch.float32)
    else:
        yb = x.new_empty(B, T, H, 2, M, dtype=torch.float32) if deriv else y
        yl = x.new_empty(B, T, H, 2, M, dtype=torch.float32) if deriv else y
        pa = part = y
    BM = min(tabs.PB, 16 if deriv else 32)
    grid = (NC, triton.cdiv(M, BM), B * H)
    _readout_a_kernel[grid](x, z, xb, db if deriv else xb, x0 if x0 is not None else xb, b, tabs.pw, tabs.cpw,
                            tabs.rowR, tabs.colR, tabs.rowRd, tabs.colRd, y, yb, yl, pa, part, T, NC,
                            H=H, D=D, M=M, C=C, S=SUB, BM=BM, BD=_next_pow2(D), PB=tabs.PB,
                            HAS_INIT=x0 is not None, DERIV=deriv, PARTNER=partner is not None, PREC=_prec(x),
                            num_warps=NUM_WARPS["readout_a"])
    if partner is not None:
        return y, part
    return (y, yb, yl) if deriv else y


def readout_o(z, xb, b, tabs, C, r=None, c=None, rev=False, out_dtype=None, init_shift=False):
    """y_t = sum_m Re(r_t conj(X_t[m])) with X the per-token state of (z, coefficient c); None means b.

    r, c: [B, T, H, 2, M] fp32 or None; xb: states from scan_fwd with the same coefficient. Returns [B, T, H, D].
    """
    B, T, H, D = z.shape
    M, NC = tabs.M, triton.cdiv(T, C)
    y = z.new_empty(B, T, H, D, dtype=out_dtype or z.dtype)
    BD = min(_next_pow2(D), 64)
    grid = (NC, triton.cdiv(D, BD), B * H)
    _readout_o_kernel[grid](r if r is not None else z, c if c is not None else z, z, xb, b, tabs.pw, tabs.rowR,
                            tabs.colR, y, T, NC, H=H, D=D, M=M, C=C, S=SUB, BM=tabs.PB, BD=BD, PB=tabs.PB,
                            R_CONST=r is None, C_CONST=c is None, REV=rev, INIT_SHIFT=init_shift, PREC=_prec(z),
                            num_warps=NUM_WARPS["readout_o"])
    return y


def _cplx(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.complex(x.select(dim, 0), x.select(dim, 1))


def _pairs(z: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.stack((z.real, z.imag), dim)


def _lam_pow(decay: torch.Tensor, n: int) -> torch.Tensor:
    """lam^n as complex128 [H, M, 1] (broadcasts over the feature dim of [B, H, M, D] states)."""
    return torch.exp(n * torch.complex(decay[..., 0].double(), decay[..., 1].double()))[..., None]


def interdomain_fwd(q, k, v, decay, b, u0=None, g0=None, chunk_size=64):
    """Forward. u0/g0: [B, H, 2, M, K/V] fp32 or None. Returns o [B, T, H, V], final U and G [B, H, 2, M, *]."""
    T = q.shape[1]
    tabs = Tables(decay, T, chunk_size, rev=False)
    ub, uf = scan_fwd(k, b, tabs, chunk_size)
    a = readout_a(q, k, ub, b, tabs, chunk_size, x0=u0)
    gb, gf = scan_fwd(v, b, tabs, chunk_size, coef=CONST_B, x0=g0)
    o = readout_o(v, gb, b, tabs, chunk_size, r=a)
    return o, _final(uf, u0, decay, b, T), gf


def _final(xf, x0, decay, b, T):
    """lam^T X0 + b Xhat_final for b-free, init-free final states."""
    bc = _cplx(b.double(), -1)[..., None]
    z = bc * _cplx(xf.double(), 2)
    if x0 is not None:
        z = z + _lam_pow(decay, T) * _cplx(x0.double(), 2)
    return _pairs(z, 2).float()


def interdomain_bwd(q, k, v, decay, b, u0, g0, do, duf, dgf, chunk_size=64):
    """Backward: returns dq, dk, dv, ddecay, db, du0, dg0 (du0/dg0 None when the initial state was None)."""
    B, T, H, K = q.shape
    C = chunk_size
    fwd = Tables(decay, T, C, rev=False)
    rev = Tables(decay, T, C, rev=True)
    ub, uf, udb, udf = scan_fwd(k, b, fwd, C, deriv=True)
    a, a_hat, a_ell = readout_a(q, k, ub, b, fwd, C, x0=u0, db=udb)
    gb, gf, gdb, gdf = scan_fwd(v, b, fwd, C, deriv=True)
    da, part = readout_a(do, v, gb, b, fwd, C, x0=g0, db=gdb, partner=(a, a_hat, a_ell))
    del a_hat, a_ell
    ddecay, dbb = _param_grads(part, decay, b, T, (duf, uf, udf, u0), (dgf, gf, gdf, g0))
    sb, _ = scan_fwd(k, b, fwd, C, coef=CONST_B, x0=u0)
    dq = readout_o(k, sb, b, fwd, C, r=da, out_dtype=q.dtype)
    rb, rf = scan_fwd(q, b, rev, C, coef=PER_TOKEN, c=da, x0=duf, rev=True, init_shift=True)
    dk = readout_o(q, rb, b, rev, C, c=da, rev=True, out_dtype=k.dtype, init_shift=duf is not None)
    hb, hf = scan_fwd(do, b, rev, C, coef=PER_TOKEN, c=a, x0=dgf, rev=True, init_shift=True)
    dv = readout_o(do, hb, b, rev, C, c=a, rev=True, out_dtype=v.dtype, init_shift=dgf is not None)
    du0 = _step_back(rf, decay) if u0 is not None else None
    dg0 = _step_back(hf, decay) if g0 is not None else None
    return dq, dk, dv, ddecay, dbb, du0, dg0


def _step_back(xf, decay):
    """conj(lam) * X: the gradient of the state before token 0 from the reverse state at token 0."""
    return _pairs(_lam_pow(decay, 1).conj() * _cplx(xf.double(), 2), 2).float()


def _param_grads(part, decay, b, T, ustate, gstate):
    """d decay = (Re, Im) of dL/d(log lam); db = dL/db; both as real pairs [H, M, 2] (see README)."""
    H = decay.shape[0]
    sums = part.double().view(-1, H, part.shape[1], 4, part.shape[3]).sum((0, 2))  # [H, 4, M]
    dbc = torch.complex(sums[:, 0], sums[:, 1])
    dell = torch.complex(sums[:, 2], sums[:, 3])
    bc = _cplx(b.double(), -1)[..., None]
    for dxf, xf, xdf, x0 in (ustate, gstate):
        if dxf is None:
            continue
        g = _cplx(dxf.double(), 2)
        dbc = dbc + (g * _cplx(xf.double(), 2).conj()).sum((0, 3))
        dfin = bc * _cplx(xdf.double(), 2)
        if x0 is not None:
            dfin = dfin + T * _lam_pow(decay, T) * _cplx(x0.double(), 2)
        dell = dell + (g * dfin.conj()).sum((0, 3))
    return _pairs(dell, -1).float(), _pairs(dbc, -1).float()


class InterdomainFunction(torch.autograd.Function):
    """Autograd wrapper over a host module's `interdomain_fwd` / `interdomain_bwd` (this file's v1 kernels or
    chunk_v2's): the forward keeps only the inputs; the backward recomputes chunk states."""

    @staticmethod
    def forward(ctx, q, k, v, decay, b, u0, g0, chunk_size, host):
        o, uf, gf = host.interdomain_fwd(q, k, v, decay, b, u0, g0, chunk_size)
        ctx.save_for_backward(q, k, v, decay, b, u0, g0)
        ctx.chunk_size, ctx.host = chunk_size, host
        return o, uf, gf

    @staticmethod
    def backward(ctx, do, duf, dgf):
        q, k, v, decay, b, u0, g0 = ctx.saved_tensors
        grads = ctx.host.interdomain_bwd(q, k, v, decay, b, u0, g0, do.contiguous(), _opt(duf), _opt(dgf),
                                         ctx.chunk_size)
        return (*grads, None, None)


def _opt(t):
    return None if t is None else t.contiguous().float()
