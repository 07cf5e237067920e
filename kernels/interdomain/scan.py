"""State scans of the chunked Interdomain op: chunk-boundary states of X_t = lam X_{t-1} + coef_t z_t, forward or
as the adjoint in reverse, and the decay power table they and the readout kernels read.

Kernels:
  _powers_kernel   lam^n, n = 0..C, per head (fp64 math, fp32 table): the only decay table, built on the device
  _scan_kernel     chunk-boundary states of X_t = lam X_{t-1} + c_t z_t (forward), or of the adjoint in reverse,
                   over all chunks or over one segment of them (long sequences)
  _carry_kernel    a segmented scan's segment start states from the segments' end states

Names (per program one (batch, head) row, one [BM, BD] state tile; complex values as (re, im) pairs `*r`, `*i`):
  z [B, T, H, D]       the token vectors a scan accumulates: k (state U) and v (Gamma) forward; q and dO reverse
  c [B, T, H, 2, M]    per-token coefficients (the backward's da and a; PER_TOKEN); otherwise b for every token
  b [H, M, 2]          input coefficient per mode; cbr, cbi: this tile's b as [BM, 1]
  decay [H, M, 2]      (log|lam|, arg lam) per mode; lam = exp(log|lam| + i arg lam)
  pw [H, C + 1, 2, M]  lam^n for n = 0..C (re, im planes); `pw` in a kernel is one head's [C + 1, 2, M] table
  x0, xb, xf           start state [B, H, 2, M, D] (or per segment [B, H, NS, 2, M, D]); the states before each
                       chunk [B, H, NC, 2, M, D] in z's dtype; the state after each segment [B, H, NS, 2, M, D] fp32
  xr, xi               the running state tile [BM, BD] fp32
  er, ei / fr, fi      decay weights of one chunk's tokens, [BM, C] (fr, fi: hoisted, shared by all full chunks)
  lr, li               lam^L [BM], the carry over a chunk (or segment) of L tokens; conjugated in reverse
  zt / cr, ci          the next chunk's features [C, BD] and per-token coefficients [BM, C], loaded one chunk ahead
  T, C, NC, NS, SEG    tokens, chunk size, chunks, segments, chunks per segment; L: tokens of a chunk or segment
  om, od, oc / mm, md  mode, feature and in-chunk token offsets of the tile / their masks; mmd, st: [BM, BD] mask and
                       state offsets
  i_b, i_h, i_bh, i_s  batch row, head, b * H + h, segment; ic: chunk index; c_lo, c_hi: this segment's chunks
  REV, PER_TOKEN       reverse (adjoint) scan; per-token coefficients c instead of b
  HOIST, STORE         hoisted full-chunk tables (InterdomainPlan.hoist_*); store the boundary states xb
  PREC, INTERPRET      tl.dot input precision; running in Triton's interpreter (while loops for runtime bounds)
"""

import torch
import triton
import triton.language as tl

from megahybrid_kernels._triton import dot_precision, interpreting, next_pow2

from .utils import DEFAULT_PLAN, InterdomainPlan, cmul, lam_pow


@triton.jit
def _powers_kernel(decay_ptr, pw_ptr, M, C: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    # one program per (head, block of BN powers): one program per head (12 programs at 12 x 64) took 0.27 ms of a
    # 7.4 ms fwd+bwd on the H200 for a 33K-entry table, blocks of 8 powers take 0.006 ms (interdomain-paper.md)
    i_h, i_n = tl.program_id(0), tl.program_id(1)
    n = i_n * BN + tl.arange(0, BN)
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
        _store_state(xb_ptr=xb_ptr, xr=xr, xi=xi, i_bh=i_bh, NC=NC, ic=ic, om=om, od=od, mm=mm, md=md, M=M, D=D)
    L = tl.minimum(T - ic * C, C)
    ok = oc < L
    row = (i_b * T + ic * C + oc) * H + i_h
    zt = tl.load(z_ptr + row[:, None] * D + od[None, :], mask=ok[:, None] & md[None, :], other=0.0).to(DT)
    if REV:
        e = oc + 1
    else:
        e = tl.maximum(L - 1 - oc, 0)
    mk = mm[:, None] & ok[None, :]
    er, ei = lam_pow(pw, tl.minimum(e, C)[None, :], om[:, None], mk, M)
    if REV:
        ei = -ei
    if PER_TOKEN:
        pc = c_ptr + row[None, :] * 2 * M + om[:, None]
        cr = tl.load(pc, mask=mk, other=0.0).to(tl.float32)
        ci = tl.load(pc + M, mask=mk, other=0.0).to(tl.float32)
        er, ei = cmul(er, ei, cr, ci)
    else:
        er, ei = cmul(er, ei, cbr, cbi)
    lr, li = lam_pow(pw, L, om, mm, M)
    if REV:
        li = -li
    xr, xi = cmul(lr[:, None], li[:, None], xr, xi)
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
    er, ei = lam_pow(pw, e[None, :], om[:, None], mm[:, None], M)
    if REV:
        ei = -ei
    if not PER_TOKEN:
        er, ei = cmul(er, ei, cbr, cbi)
    lr, li = lam_pow(pw, C, om, mm, M)
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
        _store_state(xb_ptr=xb_ptr, xr=xr, xi=xi, i_bh=i_bh, NC=NC, ic=ic, om=om, od=od, mm=mm, md=md, M=M, D=D)
    zc = zt.to(DT)
    zt = _load_z(z_ptr=z_ptr, ic=nxt, i_b=i_b, i_h=i_h, od=od, oc=oc, md=md, T=T, H=H, D=D, C=C)
    er, ei = fr, fi
    if PER_TOKEN:
        er, ei = cmul(fr, fi, cr, ci)
        cr, ci = _load_c(c_ptr=c_ptr, ic=nxt, i_b=i_b, i_h=i_h, om=om, oc=oc, mm=mm, T=T, H=H, M=M, C=C)
    xr, xi = cmul(lr[:, None], li[:, None], xr, xi)
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
    fr, fi, lr, li = _full_tables(cbr=cbr, cbi=cbi, pw=pw, om=om, oc=oc, mm=mm, M=M, C=C, PER_TOKEN=PER_TOKEN, REV=REV)
    if REV:
        if f_hi < c_hi:
            xr, xi = _scan_step(ic=c_hi - 1, xr=xr, xi=xi, cbr=cbr, cbi=cbi, z_ptr=z_ptr, c_ptr=c_ptr, pw=pw,
                                xb_ptr=xb_ptr, i_b=i_b, i_h=i_h, i_bh=i_bh, om=om, od=od, oc=oc, mm=mm, md=md, T=T,
                                NC=NC, H=H, D=D, M=M, C=C, PER_TOKEN=PER_TOKEN, REV=REV, PREC=PREC, STORE=STORE)
        first = tl.maximum(f_hi - 1, c_lo)
    else:
        first = c_lo
    zt = _load_z(z_ptr=z_ptr, ic=first, i_b=i_b, i_h=i_h, od=od, oc=oc, md=md, T=T, H=H, D=D, C=C)
    cr, ci = fr, fi
    if PER_TOKEN:
        cr, ci = _load_c(c_ptr=c_ptr, ic=first, i_b=i_b, i_h=i_h, om=om, oc=oc, mm=mm, T=T, H=H, M=M, C=C)
    if INTERPRET:
        j = 0
        while j < f_hi - c_lo:
            xr, xi, zt, cr, ci = _scan_full_step(j=j, xr=xr, xi=xi, fr=fr, fi=fi, lr=lr, li=li, zt=zt, cr=cr, ci=ci,
                                                 z_ptr=z_ptr, c_ptr=c_ptr, xb_ptr=xb_ptr, i_b=i_b, i_h=i_h, i_bh=i_bh,
                                                 om=om, od=od, oc=oc, mm=mm, md=md, T=T, NC=NC, H=H, D=D, M=M,
                                                 c_lo=c_lo, f_hi=f_hi, C=C, PER_TOKEN=PER_TOKEN, REV=REV, PREC=PREC,
                                                 STORE=STORE)
            j += 1
    else:
        for j in range(f_hi - c_lo):
            xr, xi, zt, cr, ci = _scan_full_step(j=j, xr=xr, xi=xi, fr=fr, fi=fi, lr=lr, li=li, zt=zt, cr=cr, ci=ci,
                                                 z_ptr=z_ptr, c_ptr=c_ptr, xb_ptr=xb_ptr, i_b=i_b, i_h=i_h, i_bh=i_bh,
                                                 om=om, od=od, oc=oc, mm=mm, md=md, T=T, NC=NC, H=H, D=D, M=M,
                                                 c_lo=c_lo, f_hi=f_hi, C=C, PER_TOKEN=PER_TOKEN, REV=REV, PREC=PREC,
                                                 STORE=STORE)
    if not REV:
        if f_hi < c_hi:
            xr, xi = _scan_step(ic=c_hi - 1, xr=xr, xi=xi, cbr=cbr, cbi=cbi, z_ptr=z_ptr, c_ptr=c_ptr, pw=pw,
                                xb_ptr=xb_ptr, i_b=i_b, i_h=i_h, i_bh=i_bh, om=om, od=od, oc=oc, mm=mm, md=md, T=T,
                                NC=NC, H=H, D=D, M=M, C=C, PER_TOKEN=PER_TOKEN, REV=REV, PREC=PREC, STORE=STORE)
    return xr, xi


@triton.jit
def _scan_plain_step(it, xr, xi, cbr, cbi, z_ptr, c_ptr, pw, xb_ptr, i_b, i_h, i_bh, om, od, oc, mm, md, T, NC, H, D,
                     M, c_lo, c_hi, C: tl.constexpr, PER_TOKEN: tl.constexpr, REV: tl.constexpr, PREC: tl.constexpr,
                     STORE: tl.constexpr):
    if REV:
        ic = c_hi - 1 - it
    else:
        ic = c_lo + it
    return _scan_step(ic=ic, xr=xr, xi=xi, cbr=cbr, cbi=cbi, z_ptr=z_ptr, c_ptr=c_ptr, pw=pw, xb_ptr=xb_ptr, i_b=i_b,
                      i_h=i_h, i_bh=i_bh, om=om, od=od, oc=oc, mm=mm, md=md, T=T, NC=NC, H=H, D=D, M=M, C=C,
                      PER_TOKEN=PER_TOKEN, REV=REV, PREC=PREC, STORE=STORE)


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
        xr, xi = _scan_hoisted(xr=xr, xi=xi, cbr=cbr, cbi=cbi, z_ptr=z_ptr, c_ptr=c_ptr, pw=pw, xb_ptr=xb_ptr, i_b=i_b,
                               i_h=i_h, i_bh=i_bh, om=om, od=od, oc=oc, mm=mm, md=md, T=T, NC=NC, H=H, D=D, M=M,
                               c_lo=c_lo, c_hi=c_hi, C=C, PER_TOKEN=PER_TOKEN, REV=REV, PREC=PREC, STORE=STORE,
                               INTERPRET=INTERPRET)
    # the interpreter (numpy >= 2.4) cannot take a runtime range() bound; compiled code keeps the for loop
    elif INTERPRET:
        it = 0
        while it < c_hi - c_lo:
            xr, xi = _scan_plain_step(it=it, xr=xr, xi=xi, cbr=cbr, cbi=cbi, z_ptr=z_ptr, c_ptr=c_ptr, pw=pw,
                                      xb_ptr=xb_ptr, i_b=i_b, i_h=i_h, i_bh=i_bh, om=om, od=od, oc=oc, mm=mm, md=md,
                                      T=T, NC=NC, H=H, D=D, M=M, c_lo=c_lo, c_hi=c_hi, C=C, PER_TOKEN=PER_TOKEN,
                                      REV=REV, PREC=PREC, STORE=STORE)
            it += 1
    else:
        for it in range(c_hi - c_lo):
            xr, xi = _scan_plain_step(it=it, xr=xr, xi=xi, cbr=cbr, cbi=cbi, z_ptr=z_ptr, c_ptr=c_ptr, pw=pw,
                                      xb_ptr=xb_ptr, i_b=i_b, i_h=i_h, i_bh=i_bh, om=om, od=od, oc=oc, mm=mm, md=md,
                                      T=T, NC=NC, H=H, D=D, M=M, c_lo=c_lo, c_hi=c_hi, C=C, PER_TOKEN=PER_TOKEN,
                                      REV=REV, PREC=PREC, STORE=STORE)
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
            xr, xi = _carry_step(j=j, xr=xr, xi=xi, end_ptr=end_ptr, start_ptr=start_ptr, fr=fr, fi=fi, lr=lr, li=li,
                                 i_bh=i_bh, NS=NS, st=st, mmd=mmd, M=M, D=D, REV=REV)
            j += 1
    else:
        for j in range(NS):
            xr, xi = _carry_step(j=j, xr=xr, xi=xi, end_ptr=end_ptr, start_ptr=start_ptr, fr=fr, fi=fi, lr=lr, li=li,
                                 i_bh=i_bh, NS=NS, st=st, mmd=mmd, M=M, D=D, REV=REV)
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
    xr, xi = cmul(pr, pi, xr, xi)
    return xr + tl.load(end_ptr + p, mask=mmd, other=0.0), xi + tl.load(end_ptr + p + M * D, mask=mmd, other=0.0)


def powers(decay: torch.Tensor, C: int) -> torch.Tensor:
    """lam^n for n = 0..C as [H, C + 1, 2, M] fp32 (re, im planes), computed on the device in fp64."""
    H, M = decay.shape[:2]
    pw = decay.new_empty(H, C + 1, 2, M)
    BN = 8
    _powers_kernel[(H, triton.cdiv(C + 1, BN))](decay_ptr=decay, pw_ptr=pw, M=M, C=C, BN=BN, BM=next_pow2(M))
    return pw


def scan_layout(B, H, D, M, NC, plan: InterdomainPlan = DEFAULT_PLAN):
    """Chunks per segment (NC: unsegmented) and the (mode, feature) state tile of one scan."""
    BM, BD = min(next_pow2(M), plan.scan_tile[0]), min(next_pow2(D), plan.scan_tile[1])
    rows = lambda: B * H * triton.cdiv(D, BD) * triton.cdiv(M, BM)  # noqa: E731
    if rows() >= plan.scan_segment_below:
        return NC, BM, BD
    if plan.scan_segment and NC > plan.scan_segment_above:
        return min(plan.scan_segment, NC), BM, BD
    # few rows and chunks: narrower tiles spread the sequential chunk loop over more SMs (16 x 16 was slower still:
    # one scan at T = 64K unsegmented, 1.01 ms against 0.69 ms at 16 x 32)
    BM = min(BM, 16)
    if rows() < plan.scan_segment_below:
        BD = min(BD, 32)
    return NC, BM, BD


def scan(z, b, pw, decay, C, c=None, x0=None, rev=False, starts=None, plan: InterdomainPlan = DEFAULT_PLAN):
    """Chunk-boundary states of X_t = lam X_{t-1} + coef_t z_t (coef = b, or c [B, T, H, 2, M] per token).

    rev: the adjoint S_{c-1} = conj(lam)^L S_c + sum_j conj(lam)^(j+1) c_j z_j over the same chunks, from the last
    chunk back. x0: [B, H, 2, M, D] fp32 or None. Returns the states [B, H, NC, 2, M, D] in z's dtype (before each
    chunk in the scan's direction), the last one [B, H, 2, M, D] fp32 (None when `starts` was given) and the
    segments' start states [B, H, NS, 2, M, D] fp32 (None unsegmented).

    With few (b, h) rows (long sequences) the chunk loop is latency-bound on a few SMs, so the sequence is cut into
    segments of plan.scan_segment chunks that run side by side: a first pass takes each segment's end state from
    zero (no stores), _carry_kernel carries them across segments, and a second pass stores the boundaries.
    `starts`, from an earlier scan of the same z, b and x0 (the backward recomputing the forward's states), skips
    the first pass and the carry."""
    B, T, H, D = z.shape
    M, NC = b.shape[1], triton.cdiv(T, C)
    seg, BM, BD = scan_layout(B, H, D, M, NC, plan)
    NS = triton.cdiv(NC, seg)
    xb = z.new_empty(B, H, NC, 2, M, D)
    xf = z.new_empty(B, H, NS, 2, M, D, dtype=torch.float32)
    grid = (B * H * NS, triton.cdiv(D, BD), triton.cdiv(M, BM))
    hoist = plan.hoist_per_token if c is not None else plan.hoist_const

    def run(start, store):
        _scan_kernel[grid](z_ptr=z, c_ptr=c if c is not None else z, b_ptr=b, pw_ptr=pw,
                           x0_ptr=start if start is not None else z, xb_ptr=xb, xf_ptr=xf, T=T, NC=NC, H=H, D=D,
                           M=M, NS=NS, SEG=seg, C=C, BM=BM, BD=BD, PER_TOKEN=c is not None,
                           HAS_INIT=start is not None, REV=rev, PREC=dot_precision(z, "interdomain"), HOIST=hoist,
                           STORE=store, INTERPRET=interpreting(), num_warps=plan.warps("scan"))

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
        end_ptr=xf, x0_ptr=x0 if x0 is not None else xf, start_ptr=starts, last_ptr=last, decay_ptr=decay, T=T, H=H,
        D=D, M=M, NS=NS, L=seg * C, BM=BM, BD=BD, HAS_INIT=x0 is not None, REV=rev, INTERPRET=interpreting(),
        num_warps=plan.warps("scan"))
    run(starts, True)
    return xb, last, starts
