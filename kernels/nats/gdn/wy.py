"""The WY representation of each 64-token chunk (flash-linear-attention's `wy_fast.py` role): the chunk-local
cumsum G of g and Ai = (I + A)^{-1}, w and u recomputed from them, and their backward.

Transposed operands are loaded through strided pointers, never made with `tl.trans` of a `tl.dot` result (chunk.py
says why)."""
import torch
import triton
import triton.language as tl

from megahybrid_kernels._triton import dot_precision
from megahybrid_kernels.nats.gdn.tiles import BT, _chunk_bk, _ld, _ld_t, _ld_vec, _loop_bv, _st, _tuned


@triton.jit
def _gate_block(A, Gi, Gj, beta_i, mi, mj, DIAG: tl.constexpr):
    """beta_i * A_ij * e^{G_i - G_j} on valid rows/cols (strictly lower part when DIAG)."""
    o = tl.arange(0, 16)
    valid = mi[:, None] & mj[None, :]
    if DIAG:
        valid = valid & (o[:, None] > o[None, :])
    return tl.where(valid, A * tl.exp(Gi[:, None] - Gj[None, :]), 0.0) * beta_i[:, None]


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """The 16 x 16 fp32 block product of the inverse (tf32 where the inputs are half: dot_precision)."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _inv_unit_lower16(A):
    """(I + A)^{-1} for strictly lower 16x16 A, by forward substitution on the rows of Y = inverse - I."""
    o = tl.arange(0, 16)
    Y = -A
    for i in range(2, 16):
        a = tl.sum(tl.where((o == i)[:, None], -A, 0.0), 0)
        a = a + tl.sum(a[:, None] * Y, 0)
        Y = tl.where((o == i)[:, None], a[None, :], Y)
    return Y + tl.where(o[:, None] == o[None, :], 1.0, 0.0)


@_tuned(['H', 'K'], [(2, 2), (4, 2)])
@triton.jit
def _kkt_inv_kernel(k, g, beta, G, Ai, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """Chunk-local cumsum G of g and Ai = (I + A)^{-1}, A_ij = beta_i k_i.k_j e^{G_i - G_j} (i > j); grid (NT, B*H)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    k += (bos * H + i_h) * K
    g += bos * H + i_h
    beta += bos * H + i_h
    G += bos * H + i_h
    Ai += (bos * H + i_h) * 64
    o = tl.arange(0, 16)
    r0, r1, r2, r3 = i_t * 64 + o, i_t * 64 + 16 + o, i_t * 64 + 32 + o, i_t * 64 + 48 + o
    m0, m1, m2, m3 = r0 < T, r1 < T, r2 < T, r3 < T
    g0, g1, g2, g3 = _ld_vec(g, r0, T, H), _ld_vec(g, r1, T, H), _ld_vec(g, r2, T, H), _ld_vec(g, r3, T, H)
    G0 = tl.cumsum(g0, 0)
    G1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    G2 = tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)
    G3 = tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)
    tl.store(G + r0 * H, G0, mask=m0)
    tl.store(G + r1 * H, G1, mask=m1)
    tl.store(G + r2 * H, G2, mask=m2)
    tl.store(G + r3 * H, G3, mask=m3)

    A00 = tl.zeros([16, 16], tl.float32)
    A10, A11 = tl.zeros([16, 16], tl.float32), tl.zeros([16, 16], tl.float32)
    A20, A21, A22 = tl.zeros([16, 16], tl.float32), tl.zeros([16, 16], tl.float32), tl.zeros([16, 16], tl.float32)
    A30, A31 = tl.zeros([16, 16], tl.float32), tl.zeros([16, 16], tl.float32)
    A32, A33 = tl.zeros([16, 16], tl.float32), tl.zeros([16, 16], tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c = i_k * BK + tl.arange(0, BK)
        k0, k1, k2, k3 = _ld(k, r0, c, T, K, H * K), _ld(k, r1, c, T, K, H * K), _ld(k, r2, c, T, K, H * K), \
            _ld(k, r3, c, T, K, H * K)
        k0t, k1t, k2t = _ld_t(k, r0, c, T, K, H * K), _ld_t(k, r1, c, T, K, H * K), _ld_t(k, r2, c, T, K, H * K)
        k3t = _ld_t(k, r3, c, T, K, H * K)
        A00 += tl.dot(k0, k0t, input_precision=PREC)
        A10 += tl.dot(k1, k0t, input_precision=PREC)
        A11 += tl.dot(k1, k1t, input_precision=PREC)
        A20 += tl.dot(k2, k0t, input_precision=PREC)
        A21 += tl.dot(k2, k1t, input_precision=PREC)
        A22 += tl.dot(k2, k2t, input_precision=PREC)
        A30 += tl.dot(k3, k0t, input_precision=PREC)
        A31 += tl.dot(k3, k1t, input_precision=PREC)
        A32 += tl.dot(k3, k2t, input_precision=PREC)
        A33 += tl.dot(k3, k3t, input_precision=PREC)
    b0, b1, b2, b3 = _ld_vec(beta, r0, T, H), _ld_vec(beta, r1, T, H), _ld_vec(beta, r2, T, H), \
        _ld_vec(beta, r3, T, H)
    A00 = _gate_block(A00, G0, G0, b0, m0, m0, True)
    A11 = _gate_block(A11, G1, G1, b1, m1, m1, True)
    A22 = _gate_block(A22, G2, G2, b2, m2, m2, True)
    A33 = _gate_block(A33, G3, G3, b3, m3, m3, True)
    A10 = _gate_block(A10, G1, G0, b1, m1, m0, False)
    A20 = _gate_block(A20, G2, G0, b2, m2, m0, False)
    A21 = _gate_block(A21, G2, G1, b2, m2, m1, False)
    A30 = _gate_block(A30, G3, G0, b3, m3, m0, False)
    A31 = _gate_block(A31, G3, G1, b3, m3, m1, False)
    A32 = _gate_block(A32, G3, G2, b3, m3, m2, False)

    X00, X11 = _inv_unit_lower16(A00), _inv_unit_lower16(A11)
    X22, X33 = _inv_unit_lower16(A22), _inv_unit_lower16(A33)
    # block forward substitution: X_ij = -X_ii sum_{j <= l < i} A_il X_lj
    X10 = -_mm(X11, _mm(A10, X00, PREC), PREC)
    X21 = -_mm(X22, _mm(A21, X11, PREC), PREC)
    X20 = -_mm(X22, _mm(A20, X00, PREC) + _mm(A21, X10, PREC), PREC)
    X32 = -_mm(X33, _mm(A32, X22, PREC), PREC)
    X31 = -_mm(X33, _mm(A31, X11, PREC) + _mm(A32, X21, PREC), PREC)
    X30 = -_mm(X33, _mm(A30, X00, PREC) + _mm(A31, X10, PREC) + _mm(A32, X20, PREC), PREC)
    zero = tl.zeros([16, 16], tl.float32)
    s = H * 64
    _st(Ai, r0, o, T, 16, s, X00)
    _st(Ai, r0, 16 + o, T, 64, s, zero)
    _st(Ai, r0, 32 + o, T, 64, s, zero)
    _st(Ai, r0, 48 + o, T, 64, s, zero)
    _st(Ai, r1, o, T, 64, s, X10)
    _st(Ai, r1, 16 + o, T, 64, s, X11)
    _st(Ai, r1, 32 + o, T, 64, s, zero)
    _st(Ai, r1, 48 + o, T, 64, s, zero)
    _st(Ai, r2, o, T, 64, s, X20)
    _st(Ai, r2, 16 + o, T, 64, s, X21)
    _st(Ai, r2, 32 + o, T, 64, s, X22)
    _st(Ai, r2, 48 + o, T, 64, s, zero)
    _st(Ai, r3, o, T, 64, s, X30)
    _st(Ai, r3, 16 + o, T, 64, s, X31)
    _st(Ai, r3, 32 + o, T, 64, s, X32)
    _st(Ai, r3, 48 + o, T, 64, s, X33)


@_tuned(['H', 'K', 'V'], [(4, 2), (8, 2)])
@triton.jit
def _wu_kernel(k, v, beta, G, Ai, w, u, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """w = Ai (beta e^G k), u = Ai (beta v) for one chunk; grid (NT, B*H)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    r = i_t * 64 + tl.arange(0, 64)
    b_A = _ld(Ai + (bos * H + i_h) * 64, r, tl.arange(0, 64), T, 64, H * 64)
    b_beta = _ld_vec(beta + bos * H + i_h, r, T, H)
    b_eg = tl.exp(_ld_vec(G + bos * H + i_h, r, T, H))
    for i_k in range(tl.cdiv(K, BK)):
        c = i_k * BK + tl.arange(0, BK)
        b_k = _ld(k + (bos * H + i_h) * K, r, c, T, K, H * K)
        b_kb = (b_k * (b_beta * b_eg)[:, None]).to(b_k.dtype)
        _st(w + (bos * H + i_h) * K, r, c, T, K, H * K, tl.dot(b_A.to(b_k.dtype), b_kb, input_precision=PREC))
    for i_v in range(tl.cdiv(V, BV)):
        c = i_v * BV + tl.arange(0, BV)
        b_v = _ld(v + (bos * H + i_h) * V, r, c, T, V, H * V)
        b_vb = (b_v * b_beta[:, None]).to(b_v.dtype)
        _st(u + (bos * H + i_h) * V, r, c, T, V, H * V, tl.dot(b_A.to(b_v.dtype), b_vb, input_precision=PREC))


@_tuned(['H', 'K', 'V'], [(4, 2), (8, 1), (8, 2)])
@triton.jit
def _bwd_wy_kernel(k, v, beta, G, Ai, dw, du, dk_in, dG_in, dk, dv, dbeta, dg, T, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Back through w = Ai (beta e^G k), u = Ai (beta v) and Ai = (I + A)^{-1}; adds dk_in, dG_in and turns the
    cumulative-gate gradient into dg by a reverse cumsum; grid (NT, B*H)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    r, cr = i_t * 64 + tl.arange(0, 64), tl.arange(0, 64)
    valid = r < T
    Ai += (bos * H + i_h) * 64
    b_A = _ld(Ai, r, cr, T, 64, H * 64)
    b_At = _ld_t(Ai, r, cr, T, 64, H * 64)
    b_beta = _ld_vec(beta + bos * H + i_h, r, T, H)
    b_G = _ld_vec(G + bos * H + i_h, r, T, H)
    b_eg = tl.where(valid, tl.exp(b_G), 0.0)
    b_dbeta = tl.zeros([64], tl.float32)
    b_dG = _ld_vec(dG_in + bos * H + i_h, r, T, H)
    b_dT = tl.zeros([64, 64], tl.float32)
    b_dTt = tl.zeros([64, 64], tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        b_v = _ld(v + (bos * H + i_h) * V, r, cv, T, V, H * V)
        b_vt = _ld_t(v + (bos * H + i_h) * V, r, cv, T, V, H * V)
        b_du = _ld(du + (bos * H + i_h) * V, r, cv, T, V, H * V).to(b_v.dtype)
        b_dut = _ld_t(du + (bos * H + i_h) * V, r, cv, T, V, H * V).to(b_v.dtype)
        b_dvb = tl.dot(b_At.to(b_v.dtype), b_du, input_precision=PREC)
        _st(dv + (bos * H + i_h) * V, r, cv, T, V, H * V, b_dvb * b_beta[:, None])
        b_dbeta += tl.sum(b_dvb * b_v.to(tl.float32), 1)
        b_dT += tl.dot(b_du, (b_vt * b_beta[None, :]).to(b_v.dtype), input_precision=PREC)
        b_dTt += tl.dot((b_v * b_beta[:, None]).to(b_v.dtype), b_dut, input_precision=PREC)
    b_kk = tl.zeros([64, 64], tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c = i_k * BK + tl.arange(0, BK)
        b_k = _ld(k + (bos * H + i_h) * K, r, c, T, K, H * K)
        b_kt = _ld_t(k + (bos * H + i_h) * K, r, c, T, K, H * K)
        b_dw = _ld(dw + (bos * H + i_h) * K, r, c, T, K, H * K).to(b_k.dtype)
        b_dwt = _ld_t(dw + (bos * H + i_h) * K, r, c, T, K, H * K).to(b_k.dtype)
        b_kb = b_k * (b_beta * b_eg)[:, None]
        b_dkb = tl.dot(b_At.to(b_k.dtype), b_dw, input_precision=PREC)
        b_dbeta += tl.sum(b_dkb * b_k.to(tl.float32), 1) * b_eg
        b_dG += tl.sum(b_dkb * b_kb, 1)
        b_dT += tl.dot(b_dw, (b_kt * (b_beta * b_eg)[None, :]).to(b_k.dtype), input_precision=PREC)
        b_dTt += tl.dot(b_kb.to(b_k.dtype), b_dwt, input_precision=PREC)
        b_kk += tl.dot(b_k, b_kt, input_precision=PREC)
    # dA = -Ai^T dAi Ai^T and its transpose -Ai dAi^T Ai, both computed directly
    lower = (r[:, None] > r[None, :]) & valid[:, None] & valid[None, :]
    upper = (r[:, None] < r[None, :]) & valid[:, None] & valid[None, :]
    b_dA = -tl.dot(tl.dot(b_At, b_dT, input_precision=PREC), b_At, input_precision=PREC)
    b_dA = tl.where(lower, b_dA * tl.exp(b_G[:, None] - b_G[None, :]), 0.0)
    b_dAt = -tl.dot(tl.dot(b_A, b_dTt, input_precision=PREC), b_A, input_precision=PREC)
    b_dAt = tl.where(upper, b_dAt * tl.exp(b_G[None, :] - b_G[:, None]), 0.0)
    b_x = b_dA * b_kk
    b_dbeta += tl.sum(b_x, 1)
    b_dG += b_beta * tl.sum(b_x, 1) - tl.sum(b_x * b_beta[:, None], 0)
    for i_k in range(tl.cdiv(K, BK)):
        c = i_k * BK + tl.arange(0, BK)
        b_k = _ld(k + (bos * H + i_h) * K, r, c, T, K, H * K)
        b_dw = _ld(dw + (bos * H + i_h) * K, r, c, T, K, H * K).to(b_k.dtype)
        b_dk = _ld(dk_in + (bos * H + i_h) * K, r, c, T, K, H * K).to(tl.float32)
        b_dk += tl.dot(b_At.to(b_k.dtype), b_dw, input_precision=PREC) * (b_beta * b_eg)[:, None]
        b_dk += tl.dot(b_dA.to(b_k.dtype), b_k, input_precision=PREC) * b_beta[:, None]
        b_dk += tl.dot(b_dAt.to(b_k.dtype), (b_k * b_beta[:, None]).to(b_k.dtype), input_precision=PREC)
        _st(dk + (bos * H + i_h) * K, r, c, T, K, H * K, b_dk)
    tl.store(dbeta + bos * H + i_h + r * H, b_dbeta.to(dbeta.dtype.element_ty), mask=valid)
    b_dg = tl.cumsum(b_dG, 0, reverse=True)
    tl.store(dg + bos * H + i_h + r * H, b_dg.to(dg.dtype.element_ty), mask=valid)


def _wy_fwd(k, v, g, beta):
    """G (chunk-local cumsum of g, fp32) and Ai = (I + A)^{-1} per chunk, `[B, T, H]` and `[B, T, H, 64]`."""
    B, T, H, K = k.shape
    NT = triton.cdiv(T, BT)
    G = torch.empty(B, T, H, device=k.device, dtype=torch.float32)
    Ai = torch.empty(B, T, H, BT, device=k.device, dtype=torch.float32)
    _kkt_inv_kernel[(NT, B * H)](k, g, beta, G, Ai, T, H=H, K=K, BK=_chunk_bk(K, k.device),
                                 PREC=dot_precision(k, "gdn"))
    return G, Ai


def _recompute_wu(k, v, beta, G, Ai):
    B, T, H, K = k.shape
    V = v.shape[-1]
    w, u = torch.empty_like(k), torch.empty_like(v)
    _wu_kernel[(triton.cdiv(T, BT), B * H)](k, v, beta, G, Ai, w, u, T, H=H, K=K, V=V, BK=_chunk_bk(K, k.device),
                                            BV=_loop_bv(V, k.dtype), PREC=dot_precision(k, "gdn"))
    return w, u
