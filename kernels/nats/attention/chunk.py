"""Triton kernels for attention over selected chunks: FlashAttention-2 forward and backward with block skipping.

A query chunk i visits only the kept chunks before it (a per-(b, h) list of kept chunk indices built with torch
ops, no host sync) plus its own chunk under a causal mask, so the cost scales with the kept fraction. The
backward recomputes P from the saved log-sum-exp and accumulates the keep gradient, Σ dS over the scores of
a kept chunk's keys seen from later chunks, in the same pass that builds dK and dV.
"""
import math

import torch
import triton
import triton.language as tl

from megahybrid_kernels.nats.attention.torch_chunk import torch_chunk_selected_attention
from megahybrid_kernels._triton import dot_precision, interpreting, launch_fitting_stages, next_pow2, use_torch_path
from megahybrid_kernels.nats.checks import check_keep_values

LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptr, rows, m_rows, stride_t, D: tl.constexpr, BD: tl.constexpr, TRANS: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    # A [rows, D] tile, or its transpose [D, rows] read through transposed pointers when TRANS. Masks are only
    # built where needed (padded head dim, a partial last chunk) so full tiles load unmasked.
    o_d = tl.arange(0, BD)
    if TRANS:
        ptrs = ptr + rows[None, :] * stride_t + o_d[:, None]
        mask = (o_d[:, None] < D) & m_rows[None, :] if MASK_ROWS else (o_d[:, None] < D)
    else:
        ptrs = ptr + rows[:, None] * stride_t + o_d[None, :]
        mask = m_rows[:, None] & (o_d[None, :] < D) if MASK_ROWS else (o_d[None, :] < D)
    if MASK_ROWS or BD != D:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _near_mask(o_t, c, kept_c, T, BT: tl.constexpr):
    # Visibility of the keys of chunk c (one of the program's own query chunks) from query rows o_t: causal
    # inside the query's own chunk, whole chunk from later chunks of the program when c is kept.
    o_s = c * BT + tl.arange(0, BT)
    c_t = o_t // BT
    # kept_c is 0 or 1: (c_t - c) * kept_c > 0 means "later chunk and c kept".
    vis = ((c_t[:, None] == c) & (o_t[:, None] >= o_s[None, :])) | ((c_t[:, None] - c) * kept_c > 0)
    return vis & (o_s[None, :] < T)


@triton.jit
def _softmax_step(b_q, b_kt, b_v, b_m, b_l, b_o, qk_scale, b_mask, PREC: tl.constexpr, MASKED: tl.constexpr):
    b_s = tl.dot(b_q, b_kt, input_precision=PREC) * qk_scale
    if MASKED:
        b_s = tl.where(b_mask, b_s, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    if MASKED:
        # A row may have seen no key yet (its own chunk comes later in the program); keep exp2 away from NaN.
        b_mn = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_r = tl.exp2(b_m - b_mn)
    b_p = tl.exp2(b_s - b_mn[:, None])
    b_l = b_l * b_r + tl.sum(b_p, 1)
    b_o = b_o * b_r[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
    return b_mn, b_l, b_o


@triton.jit
def _far_rows(far_idx, j, n, BT: tl.constexpr, KB: tl.constexpr, MASKED: tl.constexpr):
    # Token rows of kept chunks number j*KB ... j*KB+KB-1 in the kept list, as one key block of KB*BT rows;
    # MASKED (the last, partial group) also returns which rows belong to an existing list entry.
    slot = j * KB + tl.arange(0, KB)
    if MASKED:
        idx = tl.load(far_idx + slot, mask=slot < n, other=0)
    else:
        idx = tl.load(far_idx + slot)
    rows = tl.reshape(idx.to(tl.int64)[:, None] * BT + tl.arange(0, BT)[None, :], [KB * BT])
    valid = tl.reshape(tl.broadcast_to((slot < n)[:, None], [KB, BT]), [KB * BT])
    return rows, valid


@triton.jit
def _fwd_far_step(j, n, b_q, b_m, b_l, b_o, k, v, far_idx, stride_k, stride_v, qk_scale, DK: tl.constexpr,
                  BDK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr, KB: tl.constexpr,
                  PREC: tl.constexpr, MASKED: tl.constexpr):
    # KB kept chunks before the program's first query chunk: all of their keys are visible.
    rows, valid = _far_rows(far_idx, j, n, BT, KB, MASKED)
    b_kt = _load_tile(k, rows, valid, stride_k, DK, BDK, True, MASKED)
    b_v = _load_tile(v, rows, valid, stride_v, DV, BDV, False, MASKED)
    return _softmax_step(b_q, b_kt, b_v, b_m, b_l, b_o, qk_scale, valid[None, :], PREC, MASKED)


@triton.jit
def _fwd_kernel(
    q, k_far, v_far, k, v, o, lse, keep, far_idx, n_far, qk_scale,
    T, NC, s_fb, s_fh, s_ft, s_vb, s_vh, s_vt,
    H: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
    G: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    # One program = G consecutive query chunks of one (b, h), heaviest (latest) programs launched first. Keys come
    # from `k_far` (kept chunks before the program's chunks, rows far_idx[j] * BT ...), then from the program's own
    # G chunks of `k` under the selection mask; `k_far` may also be a compacted K/V buffer.
    # INTERPRET: the interpreter (numpy >= 2.4) cannot use a loaded scalar as a range() bound, so it runs the same
    # loop body in a while loop; compiled code keeps the for loop, which Triton software-pipelines.
    i_m, i_bh = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    BM: tl.constexpr = G * BT
    o_t = i_m * BM + tl.arange(0, BM)
    m_t = o_t < T
    base, base_v = (i_b * T * H + i_h) * DK, (i_b * T * H + i_h) * DV
    b_q = _load_tile(q + base, o_t, m_t, H * DK, DK, BDK, False, True)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_o = tl.zeros([BM, BDV], dtype=tl.float32)
    far, far_v = k_far + i_b * s_fb + i_h * s_fh, v_far + i_b * s_vb + i_h * s_vh
    keep += i_bh * NC
    far_idx += i_bh * NC
    n = tl.load(n_far + i_bh * NC + i_m * G)
    if INTERPRET:
        j = 0
        while j < n // KB:
            b_m, b_l, b_o = _fwd_far_step(j, n, b_q, b_m, b_l, b_o, far, far_v, far_idx, s_ft, s_vt, qk_scale, DK, BDK,
                                          DV, BDV, BT, KB, PREC, False)
            j += 1
    else:
        for j in range(n // KB):
            b_m, b_l, b_o = _fwd_far_step(j, n, b_q, b_m, b_l, b_o, far, far_v, far_idx, s_ft, s_vt, qk_scale, DK, BDK,
                                          DV, BDV, BT, KB, PREC, False)
    if n % KB != 0:
        b_m, b_l, b_o = _fwd_far_step(n // KB, n, b_q, b_m, b_l, b_o, far, far_v, far_idx, s_ft, s_vt, qk_scale, DK,
                                      BDK, DV, BDV, BT, KB, PREC, True)
    for g in tl.static_range(G):
        c = i_m * G + g
        o_s = c * BT + tl.arange(0, BT)
        kept_c = (tl.load(keep + c, mask=c < NC, other=0.0) == 1).to(tl.int32)
        b_kt = _load_tile(k + base, o_s, o_s < T, H * DK, DK, BDK, True, True)
        b_v = _load_tile(v + base_v, o_s, o_s < T, H * DV, DV, BDV, False, True)
        b_mask = _near_mask(o_t, c, kept_c, T, BT)
        b_m, b_l, b_o = _softmax_step(b_q, b_kt, b_v, b_m, b_l, b_o, qk_scale, b_mask, PREC, True)
    b_l = tl.where(m_t, b_l, 1.0)  # padding rows past T saw no key
    b_o = b_o / b_l[:, None]
    o_d = tl.arange(0, BDV)
    tl.store(o + base_v + o_t[:, None] * (H * DV) + o_d[None, :], b_o.to(o.dtype.element_ty),
             mask=m_t[:, None] & (o_d[None, :] < DV))
    tl.store(lse + i_bh * T + o_t, b_m + tl.log2(b_l), mask=m_t)


@triton.jit
def _dkdv_step(b_k, b_v, q, do, lse, delta, o_q, T, stride_k, stride_v, qk_scale, b_mask,
               DK: tl.constexpr, BDK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    # Key chunk against one query chunk, transposed: S^T = K Q^T, P^T, dS^T = P^T (dP^T - Delta).
    m_q = o_q < T
    b_qt = _load_tile(q, o_q, m_q, stride_k, DK, BDK, True, MASK_ROWS)
    b_do = _load_tile(do, o_q, m_q, stride_v, DV, BDV, False, MASK_ROWS)
    if MASK_ROWS:
        b_lse = tl.load(lse + o_q, mask=m_q, other=0.0)
        b_delta = tl.load(delta + o_q, mask=m_q, other=0.0)
    else:
        b_lse = tl.load(lse + o_q)
        b_delta = tl.load(delta + o_q)
    b_st = tl.dot(b_k, b_qt, input_precision=PREC) * qk_scale
    b_pt = tl.exp2(b_st - b_lse[None, :])
    if MASK_ROWS:
        b_pt = tl.where(b_mask & m_q[None, :], b_pt, 0.0)
    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    return b_pt, b_dst, b_qt, b_do


@triton.jit
def _dkdv_later_step(i_q, b_k, b_v, b_dk, b_dv, b_dkeep, b_w, q, do, lse, delta, T, stride_k, stride_v, qk_scale,
                     DK: tl.constexpr, BDK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
                     PREC: tl.constexpr, GRAD_UNSELECTED: tl.constexpr, MASK_ROWS: tl.constexpr):
    # Query chunk i_q after the key chunk: no causal mask (MASK_ROWS only for the partial last chunk); its dS
    # feeds the keep gradient. With GRAD_UNSELECTED an unselected chunk (b_w = 0) is visited for that only.
    o_q = i_q * BT + tl.arange(0, BT)
    b_pt, b_dst, b_qt, b_do = _dkdv_step(b_k, b_v, q, do, lse, delta, o_q, T, stride_k, stride_v, qk_scale,
                                         tl.full([BT, BT], 1, dtype=tl.int1), DK, BDK, DV, BDV, PREC, MASK_ROWS)
    b_dkeep += tl.sum(b_dst, 1)
    if GRAD_UNSELECTED:
        b_pt, b_dst = b_pt * b_w, b_dst * b_w
    b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=PREC)
    b_dk += tl.dot(b_dst.to(b_qt.dtype), tl.trans(b_qt), input_precision=PREC)
    return b_dk, b_dv, b_dkeep


@triton.jit
def _bwd_dkdv_kernel(
    q, k, v, do, lse, delta, keep, dk, dv, dkeep, qk_scale, scale,
    T, NC,
    H: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, GRAD_UNSELECTED: tl.constexpr, INTERPRET: tl.constexpr,
):
    # Program c: dK, dV of key chunk c from its own query chunk (causal) and, when c is kept, from every later
    # query chunk, whose Σ dS is the keep gradient. Transposed operands come from transposed loads; tl.trans is
    # applied to loaded tiles only, never to a tl.dot result (Triton 3.6 on Hopper miscompiles that).
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    base, base_v = (i_b * T * H + i_h) * DK, (i_b * T * H + i_h) * DV
    q, k, v, do, dk, dv = q + base, k + base, v + base_v, do + base_v, dk + base, dv + base_v
    lse, delta = lse + i_bh * T, delta + i_bh * T
    o_c = i_c * BT + tl.arange(0, BT)
    m_c = o_c < T
    b_k = _load_tile(k, o_c, m_c, H * DK, DK, BDK, False, True)
    b_v = _load_tile(v, o_c, m_c, H * DV, DV, BDV, False, True)
    b_pt, b_dst, b_qt, b_do = _dkdv_step(b_k, b_v, q, do, lse, delta, o_c, T, H * DK, H * DV, qk_scale,
                                         o_c[None, :] >= o_c[:, None], DK, BDK, DV, BDV, PREC, True)
    b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=PREC)
    b_dk = tl.dot(b_dst.to(b_qt.dtype), tl.trans(b_qt), input_precision=PREC)
    kept = tl.load(keep + i_bh * NC + i_c) == 1
    b_w = kept.to(tl.float32)
    if GRAD_UNSELECTED:
        n_later = NC - 1 - i_c
    else:
        n_later = tl.where(kept, NC - 1 - i_c, 0)
    b_dkeep = tl.zeros([BT], dtype=tl.float32)
    # Later query chunks except the last one (full, unmasked; a pipelined loop), then the last one row-masked.
    if INTERPRET:
        i = 0
        while i < n_later - 1:
            b_dk, b_dv, b_dkeep = _dkdv_later_step(i_c + 1 + i, b_k, b_v, b_dk, b_dv, b_dkeep, b_w, q, do, lse, delta,
                                                   T, H * DK, H * DV, qk_scale, DK, BDK, DV, BDV, BT, PREC,
                                                   GRAD_UNSELECTED, False)
            i += 1
    else:
        for i in range(n_later - 1):
            b_dk, b_dv, b_dkeep = _dkdv_later_step(i_c + 1 + i, b_k, b_v, b_dk, b_dv, b_dkeep, b_w, q, do, lse, delta,
                                                   T, H * DK, H * DV, qk_scale, DK, BDK, DV, BDV, BT, PREC,
                                                   GRAD_UNSELECTED, False)
    if n_later > 0:
        b_dk, b_dv, b_dkeep = _dkdv_later_step(NC - 1, b_k, b_v, b_dk, b_dv, b_dkeep, b_w, q, do, lse, delta,
                                               T, H * DK, H * DV, qk_scale, DK, BDK, DV, BDV, BT, PREC,
                                               GRAD_UNSELECTED, True)
    o_k, o_v = tl.arange(0, BDK), tl.arange(0, BDV)
    tl.store(dk + o_c[:, None] * (H * DK) + o_k[None, :], (b_dk * scale).to(dk.dtype.element_ty),
             mask=m_c[:, None] & (o_k[None, :] < DK))
    tl.store(dv + o_c[:, None] * (H * DV) + o_v[None, :], b_dv.to(dv.dtype.element_ty),
             mask=m_c[:, None] & (o_v[None, :] < DV))
    tl.store(dkeep + i_bh * NC + i_c, tl.sum(b_dkeep, 0))


@triton.jit
def _dq_step(b_q, b_do, b_lse, b_delta, b_kt, b_vt, qk_scale, b_mask, PREC: tl.constexpr, MASKED: tl.constexpr):
    b_s = tl.dot(b_q, b_kt, input_precision=PREC) * qk_scale
    b_p = tl.exp2(b_s - b_lse[:, None])
    if MASKED:
        b_p = tl.where(b_mask, b_p, 0.0)
    b_ds = b_p * (tl.dot(b_do, b_vt, input_precision=PREC) - b_delta[:, None])
    return tl.dot(b_ds.to(b_kt.dtype), tl.trans(b_kt), input_precision=PREC)


@triton.jit
def _dq_far_step(j, n, b_q, b_do, b_lse, b_delta, k, v, far_idx, stride_k, stride_v, qk_scale, DK: tl.constexpr,
                 BDK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr, KB: tl.constexpr,
                 PREC: tl.constexpr, MASKED: tl.constexpr):
    rows, valid = _far_rows(far_idx, j, n, BT, KB, MASKED)
    b_kt = _load_tile(k, rows, valid, stride_k, DK, BDK, True, MASKED)
    b_vt = _load_tile(v, rows, valid, stride_v, DV, BDV, True, MASKED)
    return _dq_step(b_q, b_do, b_lse, b_delta, b_kt, b_vt, qk_scale, valid[None, :], PREC, MASKED)


@triton.jit
def _bwd_dq_kernel(
    q, k, v, o, do, lse, delta, keep, far_idx, n_far, dq, qk_scale, scale,
    T, NC,
    H: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
    G: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    # dQ of G consecutive query chunks, visiting the same keys as the forward (kept list, then own chunks).
    # Runs before the dK/dV kernel and stores Delta = rowsum(O * dO) for it.
    i_m, i_bh = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    base, base_v = (i_b * T * H + i_h) * DK, (i_b * T * H + i_h) * DV
    q, k, v, o, do, dq = q + base, k + base, v + base_v, o + base_v, do + base_v, dq + base
    BM: tl.constexpr = G * BT
    o_t = i_m * BM + tl.arange(0, BM)
    m_t = o_t < T
    b_q = _load_tile(q, o_t, m_t, H * DK, DK, BDK, False, True)
    b_do = _load_tile(do, o_t, m_t, H * DV, DV, BDV, False, True)
    b_lse = tl.load(lse + i_bh * T + o_t, mask=m_t, other=0.0)
    b_o = _load_tile(o, o_t, m_t, H * DV, DV, BDV, False, True)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)
    tl.store(delta + i_bh * T + o_t, b_delta, mask=m_t)
    b_dq = tl.zeros([BM, BDK], dtype=tl.float32)
    keep += i_bh * NC
    far_idx += i_bh * NC
    n = tl.load(n_far + i_bh * NC + i_m * G)
    if INTERPRET:
        j = 0
        while j < n // KB:
            b_dq += _dq_far_step(j, n, b_q, b_do, b_lse, b_delta, k, v, far_idx, H * DK, H * DV, qk_scale, DK, BDK,
                                 DV, BDV, BT, KB, PREC, False)
            j += 1
    else:
        for j in range(n // KB):
            b_dq += _dq_far_step(j, n, b_q, b_do, b_lse, b_delta, k, v, far_idx, H * DK, H * DV, qk_scale, DK, BDK,
                                 DV, BDV, BT, KB, PREC, False)
    if n % KB != 0:
        b_dq += _dq_far_step(n // KB, n, b_q, b_do, b_lse, b_delta, k, v, far_idx, H * DK, H * DV, qk_scale, DK, BDK,
                             DV, BDV, BT, KB, PREC, True)
    for g in tl.static_range(G):
        c = i_m * G + g
        o_s = c * BT + tl.arange(0, BT)
        kept_c = (tl.load(keep + c, mask=c < NC, other=0.0) == 1).to(tl.int32)
        b_kt = _load_tile(k, o_s, o_s < T, H * DK, DK, BDK, True, True)
        b_vt = _load_tile(v, o_s, o_s < T, H * DV, DV, BDV, True, True)
        b_mask = _near_mask(o_t, c, kept_c, T, BT)
        b_dq += _dq_step(b_q, b_do, b_lse, b_delta, b_kt, b_vt, qk_scale, b_mask, PREC, True)
    o_d = tl.arange(0, BDK)
    tl.store(dq + o_t[:, None] * (H * DK) + o_d[None, :], (b_dq * scale).to(dq.dtype.element_ty),
             mask=m_t[:, None] & (o_d[None, :] < DK))


def kept_chunk_lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (b, h): the kept chunk indices in ascending order, and how many of them precede each chunk.

    Args:
        keep: [B, H, NC] in {0, 1}.
    Returns:
        far_idx: [B, H, NC] int32, kept indices first (the tail is padding, never read).
        n_far: [B, H, NC] int32, n_far[..., i] = number of kept chunks c < i.
    """
    NC = keep.shape[-1]
    kept = keep == 1
    order = torch.arange(NC, device=keep.device, dtype=torch.int32).expand_as(keep)
    far_idx = torch.where(kept, order, NC).sort(-1).values.to(torch.int32)
    n_far = (torch.cumsum(kept.to(torch.int32), -1) - kept.to(torch.int32)).to(torch.int32)
    return far_idx.contiguous(), n_far.contiguous()


def _head_dims(DK: int, DV: int, device: torch.device) -> dict:
    """Head-dim tiles: at least 64 wide on the GPU, where the tiny model's 16/32-wide ones faulted with an illegal
    address on the H200 (Triton 3.6 sm_90 narrow tiles, as in the GDN op); columns >= D are masked."""
    lo = 64 if device.type == "cuda" else 16
    return dict(DK=DK, BDK=next_pow2(DK, lo), DV=DV, BDV=next_pow2(DV, lo))


# Launch settings on a GPU (the interpreter ignores warps and stages). G = query chunks per program, KB = kept
# chunks per key block in the loop over earlier kept chunks.
# tools/bench_nats_attention.py sweeps these; the values here are its choice on an H200.
GPU_CONFIG = {
    "fwd": {"G": 1, "KB": 1, "num_warps": 4, "num_stages": 3},
    "dkdv": {"num_warps": 4, "num_stages": 3},
    "dq": {"G": 1, "KB": 1, "num_warps": 4, "num_stages": 3},
}
# Under the interpreter only G matters; tests switch it to cover both program shapes.
CPU_CONFIG = {"fwd": {"G": 2, "KB": 2}, "dkdv": {}, "dq": {"G": 2, "KB": 2}}


def _config(q: torch.Tensor, kernel: str) -> dict:
    return dict((CPU_CONFIG if q.device.type == "cpu" else GPU_CONFIG)[kernel])


def _consts(q: torch.Tensor, DK: int, DV: int, chunk_size: int) -> dict:
    H = q.shape[2]
    return dict(H=H, **_head_dims(DK, DV, q.device), BT=chunk_size, PREC=dot_precision(q, "attention"),
                INTERPRET=interpreting())


def _launch(kernel, grid, args: tuple, q: torch.Tensor, consts: dict, cfg: dict) -> None:
    """On a GPU with fewer pipeline stages where the tiles of wide heads do not fit shared memory (measured on
    the H200: 3 stages of the dk/dv kernel at q/k 96-128 with v 192-256 ask for 246,784 bytes of the 232,448)."""
    if q.device.type == "cpu":
        kernel[grid](*args, **consts, **cfg)
        return
    key = (consts["BDK"], consts["BDV"], str(q.dtype), *sorted(cfg.items()))
    launch_fitting_stages(kernel, grid, args, {**consts, **cfg}, key, "chunk_selected_attention")


def chunk_selected_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float, chunk_size: int,
    compact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass. q, k [B, T, H, Dk], v [B, T, H, Dv]; keep [B, H, NC]. Returns o [B, T, H, Dv] and lse
    [B, H, T] (log2 units).

    compact=True first gathers the kept chunks of every head into a dense K/V buffer (the alternative to
    index-driven block skipping, kept for the benchmark); both give the same result.
    """
    B, T, H, DK = q.shape
    DV, NC = v.shape[-1], keep.shape[-1]
    far_idx, n_far = kept_chunk_lists(keep)
    o = q.new_empty(B, T, H, DV)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    if compact:
        k_far, v_far, far_idx = _compact_kept(k, v, far_idx, chunk_size)
        strides = k_far.stride()[:3] + v_far.stride()[:3]
    else:
        k_far, v_far = k, v
        strides = (T * H * DK, DK, H * DK, T * H * DV, DV, H * DV)
    cfg = _config(q, "fwd")
    consts = _consts(q, DK, DV, chunk_size)
    args = (q, k_far, v_far, k, v, o, lse, keep.float().contiguous(), far_idx, n_far, scale * LOG2E, T, NC, *strides)
    _launch(_fwd_kernel, (triton.cdiv(NC, cfg["G"]), B * H), args, q, consts, cfg)
    return o, lse


def _compact_kept(k, v, far_idx, chunk_size):
    """Gather the kept chunks (padded to T) into [B, H, NC*C, D] buffers; chunk j of the buffer is far_idx[j]."""
    NC = far_idx.shape[-1]
    idx = far_idx.clamp(max=NC - 1).long()
    k_far, v_far = (_gather_chunks(x, idx, chunk_size) for x in (k, v))
    identity = torch.arange(NC, device=k.device, dtype=torch.int32).expand_as(far_idx).contiguous()
    return k_far, v_far, identity


def _gather_chunks(x, idx, chunk_size):
    B, T, H, D = x.shape
    NC = idx.shape[-1]
    xc = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, NC * chunk_size - T)).transpose(1, 2)
    xc = xc.reshape(B, H, NC, chunk_size, D)
    return torch.gather(xc, 2, idx[..., None, None].expand(B, H, NC, chunk_size, D)).reshape(B, H, NC * chunk_size, D)


def chunk_selected_attention_bwd(
    q, k, v, o, lse, do, keep, scale: float, chunk_size: int, grad_unselected: bool = False,
):
    """Backward pass: returns dq, dk [B, T, H, Dk], dv [B, T, H, Dv] and dkeep [B, H, NC] (fp32)."""
    B, T, H, DK = q.shape
    DV, NC = v.shape[-1], keep.shape[-1]
    far_idx, n_far = kept_chunk_lists(keep)
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dkeep = torch.empty(B, H, NC, device=q.device, dtype=torch.float32)
    keep = keep.float().contiguous()
    consts = _consts(q, DK, DV, chunk_size)
    cfg = _config(q, "dq")
    args = (q, k, v, o, do, lse, delta, keep, far_idx, n_far, dq, scale * LOG2E, scale, T, NC)
    _launch(_bwd_dq_kernel, (triton.cdiv(NC, cfg["G"]), B * H), args, q, consts, cfg)
    args = (q, k, v, do, lse, delta, keep, dk, dv, dkeep, scale * LOG2E, scale, T, NC)
    _launch(_bwd_dkdv_kernel, (NC, B * H), args, q, {**consts, "GRAD_UNSELECTED": grad_unselected},
            _config(q, "dkdv"))
    return dq, dk, dv, dkeep


# The op enters autograd and torch.compile as two custom ops, so a compiled model keeps each NAtS layer in one
# graph with the op an opaque node in it (torch.compiler.disable broke the graph once per frame on the stack).
@torch.library.custom_op("megahybrid::selected_attention_fwd", mutates_args=())
def selected_attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float,
                              chunk_size: int, grad_unselected: bool, check_values: bool = True
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """o and the log-sum-exp per query row, on contiguous q, k, v (grad_unselected: for the backward)."""
    if check_values:
        check_keep_values(keep, "chunk_selected_attention")
    return chunk_selected_attention_fwd(q, k, v, keep, scale, chunk_size)


@selected_attention_fwd_op.register_fake
def _(q, k, v, keep, scale, chunk_size, grad_unselected, check_values=True):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("megahybrid::selected_attention_bwd", mutates_args=())
def selected_attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              do: torch.Tensor, keep: torch.Tensor, scale: float, chunk_size: int,
                              grad_unselected: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and d(keep) in keep's dtype."""
    dq, dk, dv, dkeep = chunk_selected_attention_bwd(q, k, v, o, lse, do, keep, scale, chunk_size, grad_unselected)
    return dq, dk, dv, dkeep.to(keep.dtype)


@selected_attention_bwd_op.register_fake
def _(q, k, v, o, lse, do, keep, scale, chunk_size, grad_unselected):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(keep)


def _setup_context(ctx, inputs, output):
    q, k, v, keep, scale, chunk_size, grad_unselected, *_ = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], keep)
    ctx.scale, ctx.chunk_size, ctx.grad_unselected = scale, chunk_size, grad_unselected


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, keep = ctx.saved_tensors
    grads = selected_attention_bwd_op(q, k, v, o, lse, do.contiguous(), keep, ctx.scale, ctx.chunk_size,
                                      ctx.grad_unselected)
    return *grads, None, None, None, None


selected_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(q, k, v, keep, chunk_size):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must share one shape [B, T, H, Dk] and v be [B, T, H, Dv] (no GQA); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}")
    B, T, H, D = q.shape
    NC = math.ceil(T / chunk_size)
    if tuple(keep.shape) != (B, H, NC):
        raise ValueError(f"keep must be [B, H, ceil(T/chunk_size)] = {(B, H, NC)}, got {tuple(keep.shape)}")
    if not keep.is_floating_point():
        raise ValueError(f"keep must be a float tensor of 0/1, got dtype {keep.dtype}")
    if len({x.device for x in (q, k, v, keep)}) != 1:
        raise ValueError("q, k, v and keep must be on one device")
    if len({x.dtype for x in (q, k, v)}) != 1 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q, k, v must share one float dtype (fp32, bf16, fp16), got {q.dtype}, {k.dtype}, {v.dtype}")
    if max(D, v.shape[-1]) > 256:
        raise ValueError(f"head dims must be <= 256, got Dk = {D}, Dv = {v.shape[-1]}")


@torch.compiler.disable
def _torch_path(q, k, v, keep, scale, chunk_size, grad_unselected, check_values):
    """The torch path, eager inside a compiled model as before (CPU only)."""
    if check_values:
        check_keep_values(keep, "chunk_selected_attention")
    return torch_chunk_selected_attention(q, k, v, keep, scale, chunk_size, grad_unselected)


def chunk_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    grad_unselected: bool = False,
    check_values: bool = True,
) -> torch.Tensor:
    """Causal softmax attention where a query in chunk c sees its own chunk causally and the earlier chunks
    whose keep = 1 for its head.

    Args:
        q, k: [B, T, H, Dk]; v: [B, T, H, Dv] (same H for all three: no GQA); Dk, Dv <= 256.
        keep: [B, H, ceil(T / chunk_size)] float in {0, 1} (other values raise ValueError; checking a new tensor's
            values costs one host sync on a GPU); receives the straight-through selection gradient.
        scale: default 1/sqrt(Dk).
        chunk_size: 16, 32, 64 or 128 (also the kernels' block size).
        grad_unselected: also compute d(keep) for chunks with keep = 0 (visits them in the backward).
        check_values: check keep's values; a caller whose keep is 0/1 by construction (the NAtS layer's hard
            selection) passes False and saves the host sync.

    Returns:
        o: [B, T, H, Dv] in the dtype of q. CPU tensors run `torch_chunk.py` unless TRITON_INTERPRET=1.
    """
    _check_inputs(q, k, v, keep, chunk_size)  # shapes here; keep's values inside the op (reading them syncs)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_torch_path(q):
        return _torch_path(q, k, v, keep, scale, chunk_size, grad_unselected, check_values)
    q, k, v = (x.contiguous() for x in (q, k, v))
    return selected_attention_fwd_op(q, k, v, keep, scale, chunk_size, grad_unselected, check_values)[0]
