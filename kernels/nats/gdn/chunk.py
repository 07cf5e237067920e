"""Triton chunk kernels (forward and backward) for chunk-selected Gated DeltaNet.

The algorithm is flash-linear-attention's chunked Gated DeltaNet (WY representation, chunks of 64 tokens) with
one change: after chunk c the state is S_{c+1} = a_c S_c + m_c * K~_c^T V'_c (m_c = keep), where
a_c = e^{G_L} when the chunk is kept or `decay_dropped`, else 1. Every token's output still uses its own chunk's
pseudo-update. Only chunk-start states are written; the backward recomputes w, u, the states and v' from the
saved (I + A)^{-1}. This file: the state kernels (chunk-start states forward, their gradients backward), the output
and gradient kernels, the host functions, the custom ops and the public op; wy.py the per-chunk WY representation;
tiles.py the shared loads, stores and tile widths.

Transposed operands are always loaded through strided pointers, never made with `tl.trans` of a `tl.dot` result:
Triton 3.4-3.6 on Hopper miscompiles that pattern (flash-linear-attention issue 640).
"""
import contextlib
import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from megahybrid_kernels._triton import absent, dot_precision, interpreting, next_pow2, present, use_torch_path
from megahybrid_kernels.nats.checks import check_keep_values, check_log_decay
from megahybrid_kernels.nats.gdn.tiles import BT, _chunk_bk, _chunk_scalars, _ld, _ld_t, _ld_vec, _loop_bv, _st, _tuned
from megahybrid_kernels.nats.gdn.torch_chunk import torch_chunk_selected_gdn
from megahybrid_kernels.nats.gdn.wy import _bwd_wy_kernel, _recompute_wu, _wy_fwd

@triton.jit
def _fwd_h_program(k, w, u, G, keep, h, v_new, h0, ht, T, NT, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY_DROPPED: tl.constexpr,
                   USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """Sequential inter-chunk recurrence with the commit mask; writes chunk-start states and v'; grid (NV, B*H)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    v_new += (bos * H + i_h) * V
    G += bos * H + i_h
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    b_h = tl.zeros([BK, BV], tl.float32)
    if USE_H0:
        b_h += _ld(h0 + i_bh.to(tl.int64) * K * V, ck, cv, K, V, V).to(tl.float32)
    for i_t in tl.range(NT):
        _st(h + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V, ck, cv, K, V, V, b_h)
        r = i_t * 64 + tl.arange(0, 64)
        b_w = _ld(w, r, ck, T, K, H * K)
        b_vn = _ld(u, r, cv, T, V, H * V).to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)
        _st(v_new, r, cv, T, V, H * V, b_vn)
        m, g_last, a = _chunk_scalars(G, keep, i_t * 64, T, i_bh.to(tl.int64) * NT + i_t, H, DECAY_DROPPED)
        b_h *= a
        if m != 0:
            b_G = _ld_vec(G, r, T, H)
            b_vd = b_vn * tl.where(r < T, m * tl.exp(g_last - b_G), 0.0)[:, None]
            b_h += tl.dot(_ld_t(k, r, ck, T, K, H * K), b_vd.to(b_w.dtype), input_precision=PREC)
    if STORE_HT:
        _st(ht + i_bh.to(tl.int64) * K * V, ck, cv, K, V, V, b_h)


# The two sequential kernels come in two builds. NT >= 2 chunks: NT a constant (the builds the GPU tests verify).
# A single chunk (a short prompt, the open chunk of a decoding prefill): NT a runtime bound, because with NT = 1
# constant Triton folds the loop away and lowers its products another way (2 warp-group dots against 3 in the
# TTGIR), and that build faulted on the H200 at K = 32, V = 64, fp32 (issue #14); kept a loop it is the NT >= 2
# program. The interpreter runs the constant build for every NT: it cannot loop to a runtime bound (it holds
# scalar arguments as 1-element arrays); tl.range, not range, takes a constant passed on to a helper there.
@_tuned(['H', 'K', 'V', 'BV'], [(4, 1), (4, 2), (8, 2)])
@triton.jit
def _fwd_h_kernel(k, w, u, G, keep, h, v_new, h0, ht, T, NT: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY_DROPPED: tl.constexpr,
                  USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    _fwd_h_program(k, w, u, G, keep, h, v_new, h0, ht, T, NT, H, K, V, BK, BV, DECAY_DROPPED, USE_H0, STORE_HT, PREC)


@_tuned(['H', 'K', 'V', 'BV'], [(4, 1), (4, 2), (8, 2)])
@triton.jit(do_not_specialize=["NT"])
def _fwd_h_one_chunk_kernel(k, w, u, G, keep, h, v_new, h0, ht, T, NT, H: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY_DROPPED: tl.constexpr,
                            USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    _fwd_h_program(k, w, u, G, keep, h, v_new, h0, ht, T, NT, H, K, V, BK, BV, DECAY_DROPPED, USE_H0, STORE_HT, PREC)


@_tuned(['H', 'K', 'V'], [(4, 2), (8, 2)])
@triton.jit
def _fwd_o_kernel(q, k, v_new, h, G, o, scale, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """o = scale (e^G q S_c + causal(q k^T e^{G_i - G_j}) v'); grid (NV, NT, B*H)."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    r, cv = i_t * 64 + tl.arange(0, 64), i_v * BV + tl.arange(0, BV)
    h += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V
    b_o = tl.zeros([64, BV], tl.float32)
    b_s = tl.zeros([64, 64], tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c = i_k * BK + tl.arange(0, BK)
        b_q = _ld(q + (bos * H + i_h) * K, r, c, T, K, H * K)
        b_o += tl.dot(b_q, _ld(h, c, cv, K, V, V).to(b_q.dtype), input_precision=PREC)
        b_s += tl.dot(b_q, _ld_t(k + (bos * H + i_h) * K, r, c, T, K, H * K), input_precision=PREC)
    b_G = _ld_vec(G + bos * H + i_h, r, T, H)
    # rows past T too: their G loads as 0, so e^{G_i - G_j} is inf there and 0 * inf = NaN would leak into sums
    causal = (r[:, None] >= r[None, :]) & (r < T)[None, :] & (r < T)[:, None]
    b_s = tl.where(causal, b_s * tl.exp(b_G[:, None] - b_G[None, :]), 0.0)
    b_vn = _ld(v_new + (bos * H + i_h) * V, r, cv, T, V, H * V)
    b_o = b_o * tl.exp(b_G)[:, None] + tl.dot(b_s.to(b_vn.dtype), b_vn, input_precision=PREC)
    _st(o + (bos * H + i_h) * V, r, cv, T, V, H * V, b_o * scale)


@_tuned(['H', 'K', 'V'], [(4, 2), (8, 2)])
@triton.jit
def _bwd_dv_local_kernel(q, k, G, do, dv, scale, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """dv'_j from the intra-chunk outputs: scale sum_{i >= j} (k_j.q_i) e^{G_i - G_j} do_i; grid (NT, B*H)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    r = i_t * 64 + tl.arange(0, 64)
    b_s = tl.zeros([64, 64], tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c = i_k * BK + tl.arange(0, BK)
        b_k = _ld(k + (bos * H + i_h) * K, r, c, T, K, H * K)
        b_s += tl.dot(b_k, _ld_t(q + (bos * H + i_h) * K, r, c, T, K, H * K), input_precision=PREC)
    b_G = _ld_vec(G + bos * H + i_h, r, T, H)
    anti = (r[:, None] <= r[None, :]) & (r < T)[None, :]
    b_s = tl.where(anti, b_s * tl.exp(b_G[None, :] - b_G[:, None]), 0.0) * scale
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        b_do = _ld(do + (bos * H + i_h) * V, r, cv, T, V, H * V)
        _st(dv + (bos * H + i_h) * V, r, cv, T, V, H * V, tl.dot(b_s.to(b_do.dtype), b_do, input_precision=PREC))


@triton.jit
def _bwd_dh_program(q, k, w, G, keep, do, dv_local, dv2, dh, dh0, dht, scale, T, NT,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    DECAY_DROPPED: tl.constexpr, USE_DH0: tl.constexpr, USE_DHT: tl.constexpr, PREC: tl.constexpr):
    """Reverse recurrence of dS_{c+1} (stored per chunk) and the total dv'; grid (NV, B*H)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    do += (bos * H + i_h) * V
    dv_local += (bos * H + i_h) * V
    dv2 += (bos * H + i_h) * V
    G += bos * H + i_h
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    b_dh = tl.zeros([BK, BV], tl.float32)
    if USE_DHT:
        b_dh += _ld(dht + i_bh.to(tl.int64) * K * V, ck, cv, K, V, V).to(tl.float32)
    for i_s in tl.range(NT):
        i_t = NT - 1 - i_s
        _st(dh + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V, ck, cv, K, V, V, b_dh)
        r = i_t * 64 + tl.arange(0, 64)
        m, g_last, a = _chunk_scalars(G, keep, i_t * 64, T, i_bh.to(tl.int64) * NT + i_t, H, DECAY_DROPPED)
        b_G = _ld_vec(G, r, T, H)
        b_dv = _ld(dv_local, r, cv, T, V, H * V)
        b_k = _ld(k, r, ck, T, K, H * K)
        if m != 0:
            b_kd = b_k * tl.where(r < T, m * tl.exp(g_last - b_G), 0.0)[:, None]
            b_dv += tl.dot(b_kd.to(b_k.dtype), b_dh.to(b_k.dtype), input_precision=PREC)
        _st(dv2, r, cv, T, V, H * V, b_dv)
        b_qt = _ld_t(q, r, ck, T, K, H * K)
        b_qt = (b_qt * (scale * tl.exp(b_G))[None, :]).to(b_k.dtype)
        b_do = _ld(do, r, cv, T, V, H * V)
        b_wt = _ld_t(w, r, ck, T, K, H * K)
        b_dh = (a * b_dh + tl.dot(b_qt, b_do.to(b_k.dtype), input_precision=PREC)
                - tl.dot(b_wt, b_dv.to(b_k.dtype), input_precision=PREC))
    if USE_DH0:
        _st(dh0 + i_bh.to(tl.int64) * K * V, ck, cv, K, V, V, b_dh)


@_tuned(['H', 'K', 'V', 'BV'], [(4, 1), (4, 2), (8, 1)])
@triton.jit
def _bwd_dh_kernel(q, k, w, G, keep, do, dv_local, dv2, dh, dh0, dht, scale, T, NT: tl.constexpr,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   DECAY_DROPPED: tl.constexpr, USE_DH0: tl.constexpr, USE_DHT: tl.constexpr, PREC: tl.constexpr):
    _bwd_dh_program(q, k, w, G, keep, do, dv_local, dv2, dh, dh0, dht, scale, T, NT, H, K, V, BK, BV,
                    DECAY_DROPPED, USE_DH0, USE_DHT, PREC)


@_tuned(['H', 'K', 'V', 'BV'], [(4, 1), (4, 2), (8, 1)])
@triton.jit(do_not_specialize=["NT"])
def _bwd_dh_one_chunk_kernel(q, k, w, G, keep, do, dv_local, dv2, dh, dh0, dht, scale, T, NT,
                             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             DECAY_DROPPED: tl.constexpr, USE_DH0: tl.constexpr, USE_DHT: tl.constexpr,
                             PREC: tl.constexpr):
    _bwd_dh_program(q, k, w, G, keep, do, dv_local, dv2, dh, dh0, dht, scale, T, NT, H, K, V, BK, BV,
                    DECAY_DROPPED, USE_DH0, USE_DHT, PREC)


@_tuned(['H', 'K', 'V'], [(4, 2), (8, 1), (8, 2)])
@triton.jit
def _bwd_dqkwg_kernel(q, k, v_new, h, dh, do, dv2, G, keep, dq, dk, dw, dG, dkeep, scale, T, NT, B,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      DECAY_DROPPED: tl.constexpr, PREC: tl.constexpr):
    """dq, dk (state and intra parts), dw, the gate gradient dG and dkeep of one chunk and K block.

    grid (NK, NT, B*H); dG and dkeep are per-K-block partial sums.
    """
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    r, c = i_t * 64 + tl.arange(0, 64), i_k * BK + tl.arange(0, BK)
    h += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V
    dh += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V
    b_dqs = tl.zeros([64, BK], tl.float32)
    b_dks = tl.zeros([64, BK], tl.float32)
    b_dws = tl.zeros([64, BK], tl.float32)
    b_dp = tl.zeros([64, 64], tl.float32)
    b_dpt = tl.zeros([64, 64], tl.float32)
    b_hdh = tl.zeros([BK], tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        b_vn = _ld(v_new + (bos * H + i_h) * V, r, cv, T, V, H * V)
        b_vnt = _ld_t(v_new + (bos * H + i_h) * V, r, cv, T, V, H * V)
        b_do = _ld(do + (bos * H + i_h) * V, r, cv, T, V, H * V)
        b_dot = _ld_t(do + (bos * H + i_h) * V, r, cv, T, V, H * V)
        b_dv = _ld(dv2 + (bos * H + i_h) * V, r, cv, T, V, H * V).to(b_vn.dtype)
        b_ht = _ld_t(h, c, cv, K, V, V)
        b_dht = _ld_t(dh, c, cv, K, V, V)
        b_dqs += tl.dot(b_do, b_ht.to(b_do.dtype), input_precision=PREC)
        b_dks += tl.dot(b_vn, b_dht.to(b_vn.dtype), input_precision=PREC)
        b_dws += tl.dot(b_dv, b_ht.to(b_vn.dtype), input_precision=PREC)
        b_dp += tl.dot(b_do, b_vnt.to(b_do.dtype), input_precision=PREC)
        b_dpt += tl.dot(b_vn, b_dot.to(b_vn.dtype), input_precision=PREC)
        b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), 0)

    b_q = _ld(q + (bos * H + i_h) * K, r, c, T, K, H * K)
    b_k = _ld(k + (bos * H + i_h) * K, r, c, T, K, H * K)
    b_G = _ld_vec(G + bos * H + i_h, r, T, H)
    m, g_last, a = _chunk_scalars(G + bos * H + i_h, keep, i_t * 64, T, i_bh.to(tl.int64) * NT + i_t, H,
                                 DECAY_DROPPED)
    decay = tl.exp(g_last)
    valid = r < T
    causal = (r[:, None] >= r[None, :]) & valid[None, :] & valid[:, None]  # rows past T: see _fwd_o_kernel
    b_dp = tl.where(causal, b_dp * tl.exp(b_G[:, None] - b_G[None, :]), 0.0) * scale
    anti = (r[:, None] <= r[None, :]) & valid[None, :]
    b_dpt = tl.where(anti, b_dpt * tl.exp(b_G[None, :] - b_G[:, None]), 0.0) * scale
    b_dqs = b_dqs * (scale * tl.exp(b_G))[:, None]
    b_dq = b_dqs + tl.dot(b_dp.to(b_k.dtype), b_k, input_precision=PREC)
    b_kd = b_k.to(tl.float32) * tl.where(valid, tl.exp(g_last - b_G), 0.0)[:, None]
    b_dk = (m * tl.where(valid, tl.exp(g_last - b_G), 0.0)[:, None] * b_dks
            + tl.dot(b_dpt.to(b_q.dtype), b_q, input_precision=PREC))
    # gate gradient: state read, write decay, intra-chunk scores (row minus column sums)
    b_qk = tl.dot(b_q, _ld_t(k + (bos * H + i_h) * K, r, c, T, K, H * K), input_precision=PREC)
    b_l = b_dp * b_qk
    kd_dks = tl.sum(b_kd * b_dks, 1)
    b_dg = tl.sum(b_dqs * b_q.to(tl.float32), 1) - m * kd_dks + tl.sum(b_l, 1) - tl.sum(b_l, 0)
    hdh = tl.sum(b_hdh, 0)
    d_last = hdh * (m * decay + (1.0 - m) * (decay if DECAY_DROPPED else 0.0)) + m * tl.sum(kd_dks, 0)
    i_last = tl.minimum(i_t * 64 + 64, T) - 1
    b_dg = tl.where(r == i_last, b_dg + d_last, b_dg)

    _st(dq + (bos * H + i_h) * K, r, c, T, K, H * K, b_dq)
    _st(dk + (bos * H + i_h) * K, r, c, T, K, H * K, b_dk)
    _st(dw + (bos * H + i_h) * K, r, c, T, K, H * K, -b_dws)
    tl.store(dG + i_k * B * T * H + bos * H + i_h + r * H, b_dg, mask=valid)
    base = decay if DECAY_DROPPED else 1.0
    tl.store(dkeep + i_k * B * H * NT + i_bh.to(tl.int64) * NT + i_t, tl.sum(kd_dks, 0) + (decay - base) * hdh)


def _bv(n_programs: int, V: int, device: torch.device) -> int:
    """V tile of the sequential kernels: 32, or 16 when B*H*V/32 would leave most SMs idle."""
    if device.type != "cuda":
        return min(32, next_pow2(V))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return 16 if n_programs * triton.cdiv(V, 32) < 2 * sms else min(32, next_pow2(V))


def _state_bk(K: int, device: torch.device) -> int:
    """K tile (the whole K) of the sequential kernels' state [BK, BV]; rows >= K are masked to zero.

    On the GPU at least 128: with K = 64 (a [64, BV] state, both products 64 x 64 by 64 x BV) Triton 3.6 on the H200
    faulted with an illegal address in _fwd_h_kernel (issue 14), while the same kernels with the 128-row tile of K = 128
    run and match the reference; padding K = 64 to that tile reuses the verified shapes (the padded half of the state
    stays zero and its products add zeros). The interpreter keeps the next power of two.
    """
    return next_pow2(K) if device.type != "cuda" else max(128, next_pow2(K))


def _fwd_h(k, w, u, G, keep, initial_state, output_final_state, decay_dropped):
    """Chunk-start states h `[B, NT, H, K, V]`, v' `[B, T, H, V]` and the final state (fp32 or None)."""
    B, T, H, K = k.shape
    V, NT = u.shape[-1], triton.cdiv(T, BT)
    h = k.new_empty(B, NT, H, K, V)
    v_new = torch.empty_like(u)
    ht = k.new_empty(B, H, K, V, dtype=torch.float32) if output_final_state else None
    BV = _bv(B * H, V, k.device)
    kernel = _fwd_h_kernel if NT > 1 or interpreting() else _fwd_h_one_chunk_kernel
    kernel[(triton.cdiv(V, BV), B * H)](
        k, w, u, G, keep, h, v_new, initial_state, ht, T, NT, H=H, K=K, V=V, BK=_state_bk(K, k.device), BV=BV,
        DECAY_DROPPED=decay_dropped, USE_H0=initial_state is not None, STORE_HT=output_final_state,
        PREC=dot_precision(k, "gdn"))
    return h, v_new, ht


def chunk_selected_gdn_fwd(q, k, v, g, beta, keep, scale, initial_state, output_final_state, decay_dropped):
    """Forward host function; returns o `[B, T, H, V]`, the final state and (G, Ai) for the backward."""
    B, T, H, K = q.shape
    V, NT = v.shape[-1], triton.cdiv(T, BT)
    G, Ai = _wy_fwd(k, v, g, beta)
    w, u = _recompute_wu(k, v, beta, G, Ai)
    h, v_new, ht = _fwd_h(k, w, u, G, keep, initial_state, output_final_state, decay_dropped)
    o = torch.empty_like(v)
    BV = _loop_bv(V, q.dtype)
    _fwd_o_kernel[(triton.cdiv(V, BV), NT, B * H)](q, k, v_new, h, G, o, scale, T, NT, H=H, K=K, V=V,
                                                    BK=_chunk_bk(K, q.device), BV=BV, PREC=dot_precision(q, "gdn"))
    return o, ht, G, Ai


def chunk_selected_gdn_bwd(q, k, v, beta, keep, G, Ai, scale, initial_state, do, dht, decay_dropped,
                           dkeep_dropped):
    """Backward host function: recomputes w, u, h, v' and returns dq, dk, dv, dg, dbeta, dkeep, dh0."""
    B, T, H, K = q.shape
    V, NT = v.shape[-1], triton.cdiv(T, BT)
    BK, BV, prec = _chunk_bk(K, q.device), _loop_bv(V, q.dtype), dot_precision(q, "gdn")
    w, u = _recompute_wu(k, v, beta, G, Ai)
    h, v_new, _ = _fwd_h(k, w, u, G, keep, initial_state, False, decay_dropped)
    do = do.contiguous()
    dv_local = torch.empty(B, T, H, V, device=q.device, dtype=torch.float32)
    _bwd_dv_local_kernel[(NT, B * H)](q, k, G, do, dv_local, scale, T, H=H, K=K, V=V, BK=BK, BV=BV, PREC=prec)

    dh = q.new_empty(B, NT, H, K, V)
    dv2 = torch.empty_like(dv_local)
    dh0 = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) if initial_state is not None else None
    BVs = _bv(B * H, V, q.device)
    kernel = _bwd_dh_kernel if NT > 1 or interpreting() else _bwd_dh_one_chunk_kernel
    kernel[(triton.cdiv(V, BVs), B * H)](
        q, k, w, G, keep, do, dv_local, dv2, dh, dh0, dht, scale, T, NT, H=H, K=K, V=V, BK=_state_bk(K, q.device),
        BV=BVs, DECAY_DROPPED=decay_dropped, USE_DH0=dh0 is not None, USE_DHT=dht is not None, PREC=prec)

    NK = triton.cdiv(K, BK)
    dq, dk1 = torch.empty_like(q), torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    dw = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    dG = torch.empty(NK, B, T, H, device=q.device, dtype=torch.float32)
    dkeep = torch.empty(NK, B, H, NT, device=q.device, dtype=torch.float32)
    _bwd_dqkwg_kernel[(NK, NT, B * H)](q, k, v_new, h, dh, do, dv2, G, keep, dq, dk1, dw, dG, dkeep, scale, T,
                                       NT, B, H=H, K=K, V=V, BK=BK, BV=BV, DECAY_DROPPED=decay_dropped, PREC=prec)
    dG, dkeep = dG.sum(0), dkeep.sum(0)
    if not dkeep_dropped:
        dkeep = dkeep * (keep != 0)

    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dbeta = torch.empty(B, T, H, device=q.device, dtype=beta.dtype)
    dg = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    _bwd_wy_kernel[(NT, B * H)](k, v, beta, G, Ai, dw, dv2, dk1, dG, dk, dv, dbeta, dg, T, H=H, K=K, V=V, BK=BK,
                                BV=BV, PREC=prec)
    return dq, dk, dv, dg, dbeta, dkeep.to(keep.dtype), dh0


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# The op enters autograd and torch.compile as two custom ops, so a compiled model keeps each NAtS layer in one
# graph with the op an opaque node in it (torch.compiler.disable broke the graph once per frame on the stack).
# Tensors a case has not (h0, the final state and its gradient) travel as empty tensors.
@torch.library.custom_op("megahybrid::selected_gdn_fwd", mutates_args=())
def selected_gdn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        keep: torch.Tensor, scale: float, h0: torch.Tensor | None, output_final_state: bool,
                        decay_dropped: bool, dkeep_dropped: bool, check_values: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o, the final state (empty unless asked) and the backward's G, Ai (dkeep_dropped: for the backward)."""
    if check_values:
        check_keep_values(keep, "chunk_selected_gdn")
        check_log_decay(g, "chunk_selected_gdn")
    with _refuse_unbuildable(q, v):
        o, ht, G, Ai = chunk_selected_gdn_fwd(q, k, v, g, beta, keep, scale, h0, output_final_state, decay_dropped)
    return o, absent(q) if ht is None else ht, G, Ai


@selected_gdn_fwd_op.register_fake
def _(q, k, v, g, beta, keep, scale, h0, output_final_state, decay_dropped, dkeep_dropped, check_values=True):
    B, T, H, K = q.shape
    f32 = dict(dtype=torch.float32)
    ht = q.new_empty(B, H, K, v.shape[-1], **f32) if output_final_state else absent(q)
    return torch.empty_like(v), ht, q.new_empty(B, T, H, **f32), q.new_empty(B, T, H, BT, **f32)


@torch.library.custom_op("megahybrid::selected_gdn_bwd", mutates_args=())
def selected_gdn_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, keep: torch.Tensor,
                        G: torch.Tensor, Ai: torch.Tensor, scale: float, h0: torch.Tensor | None, do: torch.Tensor,
                        dht: torch.Tensor | None, decay_dropped: bool, dkeep_dropped: bool) -> list[torch.Tensor]:
    """dq, dk, dv, dg (fp32), dbeta, dkeep, dh0 (empty without h0)."""
    with _refuse_unbuildable(q, v):
        grads = chunk_selected_gdn_bwd(q, k, v, beta, keep, G, Ai, scale, h0, do, dht, decay_dropped, dkeep_dropped)
    dh0 = grads[-1]
    return [*grads[:-1], absent(q) if dh0 is None else dh0.to(h0.dtype)]


@selected_gdn_bwd_op.register_fake
def _(q, k, v, beta, keep, G, Ai, scale, h0, do, dht, decay_dropped, dkeep_dropped):
    B, T, H, _ = q.shape
    dh0 = torch.empty_like(h0) if h0 is not None else absent(q)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(B, T, H, dtype=torch.float32),
            torch.empty_like(beta), torch.empty_like(keep), dh0]


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, keep, scale, h0, _, decay_dropped, dkeep_dropped, *_ = inputs
    ctx.save_for_backward(q, k, v, beta, keep, output[2], output[3], h0)
    ctx.scale, ctx.decay_dropped, ctx.dkeep_dropped, ctx.g_dtype = scale, decay_dropped, dkeep_dropped, g.dtype


def _backward(ctx, do, dht, _dG, _dAi):
    q, k, v, beta, keep, G, Ai, h0 = ctx.saved_tensors
    # contiguous: a gradient arriving from ht.sum() is an expanded (stride 0) tensor, which the kernel read past
    dht = present(dht)
    dht = dht.contiguous() if dht is not None else None
    dq, dk, dv, dg, dbeta, dkeep, dh0 = selected_gdn_bwd_op(q, k, v, beta, keep, G, Ai, ctx.scale, h0,
                                                            do.contiguous(), dht, ctx.decay_dropped,
                                                            ctx.dkeep_dropped)
    return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, dkeep, None, dh0 if h0 is not None else None, None, None, None, None


selected_gdn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@contextlib.contextmanager
def _refuse_unbuildable(q, v):
    """A head size whose kernels need more shared memory than the GPU has becomes a one-line ValueError."""
    try:
        yield
    except OutOfResources as e:
        raise ValueError(f"chunk_selected_gdn: K={q.shape[-1]}, V={v.shape[-1]} in {q.dtype} does not fit this GPU "
                         f"({str(e).splitlines()[0]}); use bf16 or smaller heads") from None


@torch.compiler.disable
def _torch_path(q, k, v, g, beta, keep, scale, initial_state, decay_dropped, dkeep_dropped, check_values):
    """The torch path (autograd), eager inside a compiled model as before (CPU only)."""
    if check_values:
        check_keep_values(keep, "chunk_selected_gdn")
        check_log_decay(g, "chunk_selected_gdn")
    return torch_chunk_selected_gdn(q, k, v, g, beta, keep, scale, initial_state, decay_dropped, dkeep_dropped)


def chunk_selected_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    keep: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    decay_dropped: bool = True,
    dkeep_dropped: bool = False,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet whose state keeps a chunk's write only where `keep` = 1 (semantics: kernels/nats/README.md).

    Args:
        q, k: `[B, T, H, K]`, K <= 256; L2-normalized by the caller unless `use_qk_l2norm`.
        v: `[B, T, H, V]`.
        g: `[B, T, H]` log decay (<= 0, else ValueError); beta: `[B, T, H]`.
        keep: `[B, H, ceil(T / 64)]` float in {0, 1} (else ValueError): commit chunk c's write into the state (1) or
            roll it back (0). Checking the values of a new g or keep tensor costs one host sync on a GPU.
        scale: output scale, default `K ** -0.5`.
        initial_state: `[B, H, K, V]` (fp32 recommended) or None.
        output_final_state: also return the final state `[B, H, K, V]` in fp32.
        chunk_size: must be 64 (the selection granularity and the kernels' chunk).
        decay_dropped: a rolled-back chunk still applies its decays to the state (reference default).
        dkeep_dropped: give the straight-through gradient of `keep` also where keep = 0 (default: zero there).
        check_values: check g's and keep's values; a caller whose g <= 0 and keep in {0, 1} hold by construction
            (the NAtS and GDN layers) passes False and saves the host syncs.

    Returns:
        o `[B, T, H, V]` in v's dtype and the final state (or None). CPU tensors run `torch_chunk.py` (autograd)
        unless TRITON_INTERPRET=1 asks for the Triton kernels.
    """
    _check(q, k, v, g, beta, keep, initial_state, chunk_size)  # shapes here; g's and keep's values inside the op
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_torch_path(q):
        o, ht = _torch_path(q, k, v, g, beta, keep, scale, initial_state, decay_dropped, dkeep_dropped, check_values)
        return o, (ht if output_final_state else None)
    args = [x.contiguous() for x in (q, k, v, g, beta, keep)]
    h0 = initial_state.contiguous() if initial_state is not None else None
    o, ht, _, _ = selected_gdn_fwd_op(*args, scale, h0, output_final_state, decay_dropped, dkeep_dropped,
                                      check_values)
    return o, (ht if output_final_state else None)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _check(q, k, v, g, beta, keep, initial_state, chunk_size):
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64 (got {chunk_size}); the selection and kernels use 64-token chunks")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"g and beta must be [B, T, H] = {(B, T, H)}; got {tuple(g.shape)} and {tuple(beta.shape)}")
    if keep.shape != (B, H, math.ceil(T / chunk_size)):
        raise ValueError(f"keep must be [B, H, ceil(T/64)] = {(B, H, math.ceil(T / chunk_size))}; got "
                         f"{tuple(keep.shape)}")
    if K > 256 or T == 0:
        raise ValueError(f"need 1 <= T and K <= 256; got T={T}, K={K}")
    tensors = [q, k, v, g, beta, keep] + ([initial_state] if initial_state is not None else [])
    if any(t.dtype not in _FLOATS for t in tensors) or len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError("q, k, v must share one float dtype (fp32/bf16/fp16) and g, beta, keep must be float")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted({str(t.device) for t in tensors})}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}; got "
                         f"{tuple(initial_state.shape)}")
