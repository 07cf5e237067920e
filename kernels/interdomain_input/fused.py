"""The input path of the `I` layer's dual input with query, fused: one Triton kernel from the projection output to
the Interdomain op's q, k~, v~, and one for its backward, which recomputes the forward instead of saving anything.

Definition (naive.py, in fp32): per batch row b, token t and head h, with x [B, T, H, 2R + V] the projection output
split per head into q | k | v columns, conv weight w [H, 2R, KC], conv tail [B, KC - 1, H 2R] (zeros when None):

    xp    = cat(tail, x[..., :2R]) along time;  c[t, h, j] = sum_{i < KC} w[h, j, i] xp[t + i, h, j]
    RoPE  on the q channels c[..., :R] and the k channels c[..., R:] separately (rotate-half, half = R / 2):
          y1 = c1 cos(a) - c2 sin(a), y2 = c2 cos(a) + c1 sin(a), a[t, i] = (offset + t) base^(-2i/R)
    xi(y) = silu(y) / max(||silu(y)||_2, 1e-6) over the R features
    q     = xi(rope(c_q));  k~ = RMSNorm(xi(rope(c_k))) wk + bk[h];  v~ = RMSNorm(x_v) wv + bv[h]
          RMSNorm(z) = z rsqrt(mean(z^2) + norm_eps); wk [R], wv [V] shared by the heads, bk [H, R], bv [H, V]

q, k~, v~ come back in x's dtype, with the new tail (the last KC - 1 rows of xp, plain torch slicing). The kernels
compute in fp32 from the loaded x to the stored outputs; the layer's unfused torch path rounds to x's dtype after
the conv and again after RoPE, so in bf16 the two differ by about one bf16 rounding of the features.

Gradients: dx (all 2R + V columns), dw, dtail (when a tail is given), dwk, dbk, dwv, dbv. The weight gradients are
sums over tokens (and batch; heads too for wk, wv): each program writes its share to an fp32 buffer and the host
sums them (deterministic; no atomics).

Names: B, T, H batch, tokens, heads; R the q / k feature dim, HR = R / 2, V the value dim, W = 2R + V columns per
head of x; KC conv taps; BT tokens per program, BH the padded width of a half feature row, BV of a value row.
The forward's program p covers tokens [p BT, (p + 1) BT). A backward program covers BT rows u = a + [0, BT) with
a = p S - (KC - 1), S = BT - (KC - 1): the conv's input gradient at token s sums the conv-output gradients of tokens
s .. s + KC - 1, so each program recomputes those of its S own rows plus KC - 1 rows after them (a halo), shifts
them in registers (tl.gather) and owns the input gradients of rows [a, a + S) (program 0's first KC - 1 rows, at
negative tokens, are the tail's). Feature rows are loaded whole, as separate halves for RoPE; no tl.dot.
"""
import torch
import triton
import triton.language as tl

from megahybrid_kernels._triton import absent, next_pow2, present, use_torch_path

from .naive import interdomain_input_naive, rope_inv_freq

MAX_DIM = 256  # R and V: one whole feature row per tile
MAX_TAPS = 8  # conv size: a backward program's S own rows must hold the tail's KC - 1 (BT >= 16 >= 2 (KC - 1))
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_FEATURE_EPS = tl.constexpr(1e-6)


@triton.jit
def _xp(x_bh, tail_bh, s, c, cm, T, sxt, C2H, KC: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Conv input rows at tokens s (negative: the tail's rows, zeros without one), columns c < 2R, fp32."""
    m = ((s >= 0) & (s < T))[:, None] & cm[None, :]
    out = tl.load(x_bh + s.to(tl.int64)[:, None] * sxt + c[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_TAIL:
        mt = ((s < 0) & (s > -KC))[:, None] & cm[None, :]
        out += tl.load(tail_bh + (s + KC - 1)[:, None] * C2H + c[None, :], mask=mt, other=0.0).to(tl.float32)
    return out


@triton.jit
def _conv(x_bh, tail_bh, w_h, u, c, cm, T, sxt, C2H, KC: tl.constexpr, HAS_TAIL: tl.constexpr):
    """c[u, j] = sum_i w[j, i] xp at token u + i - (KC - 1): KC shifted loads (the rows overlap in cache)."""
    acc = tl.zeros([u.shape[0], c.shape[0]], tl.float32)
    for i in tl.static_range(KC):
        wi = tl.load(w_h + c * KC + i, mask=cm, other=0.0).to(tl.float32)
        acc += wi[None, :] * _xp(x_bh, tail_bh, u + i - (KC - 1), c, cm, T, sxt, C2H, KC, HAS_TAIL)
    return acc


@triton.jit
def _angles(freq, u, offset, j, jm):
    """cos, sin of (offset + u) freq[j]: fp32 positions times the host's fp32 frequencies, as the layer's `rope`
    forms them (all zero frequencies when RoPE is off: the rotation is then exactly the identity)."""
    ang = (offset + u).to(tl.float32)[:, None] * tl.load(freq + j, mask=jm, other=0.0)[None, :]
    return tl.cos(ang), tl.sin(ang)


@triton.jit
def _rotated(x_bh, tail_bh, w_h, u, c0, j, jm, cos, sin, T, sxt, C2H, HR: tl.constexpr, KC: tl.constexpr,
             HAS_TAIL: tl.constexpr):
    """RoPE of the conv output of one segment (columns c0 + [0, R)), as its two halves."""
    c1 = _conv(x_bh, tail_bh, w_h, u, c0 + j, jm, T, sxt, C2H, KC, HAS_TAIL)
    c2 = _conv(x_bh, tail_bh, w_h, u, c0 + HR + j, jm, T, sxt, C2H, KC, HAS_TAIL)
    return c1 * cos - c2 * sin, c2 * cos + c1 * sin


@triton.jit
def _xi(y1, y2):
    """The feature map over a row split in two halves; also the clamped norm and the raw norm (for the backward)."""
    s1, s2 = y1 * tl.sigmoid(y1), y2 * tl.sigmoid(y2)
    n = tl.sqrt(tl.sum(s1 * s1, 1) + tl.sum(s2 * s2, 1))
    inv = 1.0 / tl.maximum(n, _FEATURE_EPS)
    return s1 * inv[:, None], s2 * inv[:, None], inv, n


@triton.jit
def _xi_bwd(y1, y2, g1, g2):
    """dL/dy of xi: ds = (g - out (g . out)) / n while n > eps (below, max() passes nothing to n), times silu'."""
    o1, o2, inv, n = _xi(y1, y2)
    dot = tl.where(n > _FEATURE_EPS, tl.sum(g1 * o1, 1) + tl.sum(g2 * o2, 1), 0.0)
    sg1, sg2 = tl.sigmoid(y1), tl.sigmoid(y2)
    d1 = (g1 - dot[:, None] * o1) * inv[:, None] * (sg1 * (1.0 + y1 * (1.0 - sg1)))
    d2 = (g2 - dot[:, None] * o2) * inv[:, None] * (sg2 * (1.0 + y2 * (1.0 - sg2)))
    return d1, d2



@triton.jit
def _rsqrt_ms(z1, z2, n: tl.constexpr, eps):
    """rsqrt(mean(z^2) + eps) per row of a row split in two halves."""
    return tl.rsqrt((tl.sum(z1 * z1, 1) + tl.sum(z2 * z2, 1)) / n + eps)


@triton.jit
def _ld_rows(ptr, u, c, cm, T, stride):
    """fp32 rows u (zero outside [0, T)) of a [T, ...] tensor, ptr at the (batch row, head), token stride `stride`."""
    m = ((u >= 0) & (u < T))[:, None] & cm[None, :]
    return tl.load(ptr + u.to(tl.int64)[:, None] * stride + c[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _st_rows(ptr, u, c, cm, T, stride, x, rows):
    """x into rows u of ptr (as _ld_rows) where `rows` holds and 0 <= u < T."""
    m = (rows & (u >= 0) & (u < T))[:, None] & cm[None, :]
    tl.store(ptr + u.to(tl.int64)[:, None] * stride + c[None, :], x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _ld_vec(ptr, c, cm):
    return tl.load(ptr + c, mask=cm, other=0.0).to(tl.float32)


@triton.jit
def _fwd_kernel(x, w, tail, freq, wk, bk, wv, bv, q, k, v, T, offset, sxb, sxt, eps, H: tl.constexpr,
                R: tl.constexpr, V: tl.constexpr, KC: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                BV: tl.constexpr, HAS_TAIL: tl.constexpr):
    """q, k~, v~ of BT tokens of one (batch row, head); grid (cdiv(T, BT), B H)."""
    HR: tl.constexpr = R // 2
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    x_bh = x + i_b.to(tl.int64) * sxb + i_h * (2 * R + V)
    tail_bh = tail + i_b.to(tl.int64) * (KC - 1) * H * 2 * R + i_h * 2 * R
    w_h = w + i_h * 2 * R * KC
    row = i_b.to(tl.int64) * T * H + i_h  # (b, h) of the [B, T, H, .] outputs, in rows of one head
    u = i_t * BT + tl.arange(0, BT)
    j, jv = tl.arange(0, BH), tl.arange(0, BV)
    jm, jvm, rows = j < HR, jv < V, u < T
    cos, sin = _angles(freq, u, offset, j, jm)
    y1, y2 = _rotated(x_bh, tail_bh, w_h, u, 0, j, jm, cos, sin, T, sxt, H * 2 * R, HR, KC, HAS_TAIL)
    q1, q2, _, _ = _xi(y1, y2)
    _st_rows(q + row * R, u, j, jm, T, H * R, q1, rows)
    _st_rows(q + row * R + HR, u, j, jm, T, H * R, q2, rows)
    y1, y2 = _rotated(x_bh, tail_bh, w_h, u, R, j, jm, cos, sin, T, sxt, H * 2 * R, HR, KC, HAS_TAIL)
    z1, z2, _, _ = _xi(y1, y2)
    rs = _rsqrt_ms(z1, z2, R, eps)[:, None]
    k1 = z1 * rs * _ld_vec(wk, j, jm)[None, :] + _ld_vec(bk + i_h * R, j, jm)[None, :]
    k2 = z2 * rs * _ld_vec(wk + HR, j, jm)[None, :] + _ld_vec(bk + i_h * R + HR, j, jm)[None, :]
    _st_rows(k + row * R, u, j, jm, T, H * R, k1, rows)
    _st_rows(k + row * R + HR, u, j, jm, T, H * R, k2, rows)
    xv = _ld_rows(x_bh + 2 * R, u, jv, jvm, T, sxt)
    rs = tl.rsqrt(tl.sum(xv * xv, 1) / V + eps)[:, None]
    vv = xv * rs * _ld_vec(wv, jv, jvm)[None, :] + _ld_vec(bv + i_h * V, jv, jvm)[None, :]
    _st_rows(v + row * V, u, jv, jvm, T, H * V, vv, rows)


@triton.jit
def _conv_bwd(dc, c, cm, u, l, own, x_bh, tail_bh, w_h, dx_bh, dtail_bh, part, T, sxt, C2H, HW,
              KC: tl.constexpr, BT: tl.constexpr, HAS_TAIL: tl.constexpr):
    """From the conv-output gradient dc of columns c: this program's dw share (its own rows) into part, and the
    input gradient of its own rows, dxp[s] = sum_i w[i] dc[s + KC - 1 - i], into dx (tokens >= 0) or dtail."""
    acc = tl.zeros(dc.shape, tl.float32)
    for i in tl.static_range(KC):
        xs = _xp(x_bh, tail_bh, u + i - (KC - 1), c, cm, T, sxt, C2H, KC, HAS_TAIL)
        tl.store(part + c * KC + i, tl.sum(tl.where(own[:, None], dc * xs, 0.0), 0), mask=cm)
        # own rows read rows <= S - 1 + KC - 1 = BT - 1; the clamp only keeps the others' indices in range
        src = tl.minimum(l + KC - 1 - i, BT - 1)[:, None] + tl.zeros(dc.shape, tl.int32)
        acc += _ld_vec(w_h + i, c * KC, cm)[None, :] * tl.gather(dc, src, 0)
    _st_rows(dx_bh, u, c, cm, T, HW, acc, own)
    if HAS_TAIL:
        m = (own & (u < 0))[:, None] & cm[None, :]
        tl.store(dtail_bh + (u + KC - 1)[:, None] * C2H + c[None, :], acc.to(dtail_bh.dtype.element_ty), mask=m)


@triton.jit
def _bwd_kernel(x, w, tail, freq, wk, wv, dq, dk, dv, dx, dtail, dw_part, k_part, v_part, T, offset, sxb, sxt, eps,
                H: tl.constexpr, R: tl.constexpr, V: tl.constexpr, KC: tl.constexpr, BT: tl.constexpr,
                BH: tl.constexpr, BV: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Recomputes the forward of BT rows and writes the input gradients of its S own rows and its shares of dw,
    dwk, dbk, dwv, dbv; grid (cdiv(T + KC - 1, S), B H)."""
    HR: tl.constexpr = R // 2
    S: tl.constexpr = BT - (KC - 1)
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    x_bh = x + i_b.to(tl.int64) * sxb + i_h * (2 * R + V)
    tail_bh = tail + i_b.to(tl.int64) * (KC - 1) * H * 2 * R + i_h * 2 * R
    dtail_bh = dtail + i_b.to(tl.int64) * (KC - 1) * H * 2 * R + i_h * 2 * R
    w_h = w + i_h * 2 * R * KC
    row = i_b.to(tl.int64) * T * H + i_h
    dx_bh = dx + row * (2 * R + V)
    share = i_p.to(tl.int64) * tl.num_programs(1) + i_bh  # this program's slot in the partial-sum buffers
    dw_part += share * 2 * R * KC
    k_part += share * 2 * R
    v_part += share * 2 * V
    l = tl.arange(0, BT)
    u, own = i_p * S - (KC - 1) + l, l < S
    j, jv = tl.arange(0, BH), tl.arange(0, BV)
    jm, jvm = j < HR, jv < V
    cos, sin = _angles(freq, u, offset, j, jm)
    C2H: tl.constexpr = H * 2 * R
    HW: tl.constexpr = H * (2 * R + V)
    # q = xi(rope(conv)): upstream dq straight into the feature map's backward
    y1, y2 = _rotated(x_bh, tail_bh, w_h, u, 0, j, jm, cos, sin, T, sxt, C2H, HR, KC, HAS_TAIL)
    d1, d2 = _xi_bwd(y1, y2, _ld_rows(dq + row * R, u, j, jm, T, H * R), _ld_rows(dq + row * R + HR, u, j, jm, T,
                                                                                    H * R))
    _conv_bwd(d1 * cos + d2 * sin, j, jm, u, l, own, x_bh, tail_bh, w_h, dx_bh, dtail_bh, dw_part, T, sxt, C2H, HW,
              KC, BT, HAS_TAIL)
    _conv_bwd(d2 * cos - d1 * sin, HR + j, jm, u, l, own, x_bh, tail_bh, w_h, dx_bh, dtail_bh, dw_part, T, sxt, C2H,
              HW, KC, BT, HAS_TAIL)
    # k~ = RMSNorm(xi(rope(conv))) wk + bk
    y1, y2 = _rotated(x_bh, tail_bh, w_h, u, R, j, jm, cos, sin, T, sxt, C2H, HR, KC, HAS_TAIL)
    z1, z2, _, _ = _xi(y1, y2)
    g1, g2 = _ld_rows(dk + row * R, u, j, jm, T, H * R), _ld_rows(dk + row * R + HR, u, j, jm, T, H * R)
    w1, w2 = _ld_vec(wk, j, jm), _ld_vec(wk + HR, j, jm)
    rs = _rsqrt_ms(z1, z2, R, eps)
    m = (tl.sum(g1 * w1[None, :] * z1, 1) + tl.sum(g2 * w2[None, :] * z2, 1)) * rs * rs * rs / R
    mine1, mine2 = tl.where(own[:, None], g1, 0.0), tl.where(own[:, None], g2, 0.0)
    tl.store(k_part + j, tl.sum(mine1 * z1 * rs[:, None], 0), mask=jm)
    tl.store(k_part + HR + j, tl.sum(mine2 * z2 * rs[:, None], 0), mask=jm)
    tl.store(k_part + R + j, tl.sum(mine1, 0), mask=jm)
    tl.store(k_part + R + HR + j, tl.sum(mine2, 0), mask=jm)
    d1, d2 = _xi_bwd(y1, y2, g1 * w1[None, :] * rs[:, None] - z1 * m[:, None],
                     g2 * w2[None, :] * rs[:, None] - z2 * m[:, None])
    _conv_bwd(d1 * cos + d2 * sin, R + j, jm, u, l, own, x_bh, tail_bh, w_h, dx_bh, dtail_bh, dw_part, T, sxt, C2H,
              HW, KC, BT, HAS_TAIL)
    _conv_bwd(d2 * cos - d1 * sin, R + HR + j, jm, u, l, own, x_bh, tail_bh, w_h, dx_bh, dtail_bh, dw_part, T, sxt,
              C2H, HW, KC, BT, HAS_TAIL)
    # v~ = RMSNorm(x_v) wv + bv
    xv = _ld_rows(x_bh + 2 * R, u, jv, jvm, T, sxt)
    g = _ld_rows(dv + row * V, u, jv, jvm, T, H * V)
    wvv = _ld_vec(wv, jv, jvm)
    rs = tl.rsqrt(tl.sum(xv * xv, 1) / V + eps)
    m = tl.sum(g * wvv[None, :] * xv, 1) * rs * rs * rs / V
    mine = tl.where(own[:, None], g, 0.0)
    tl.store(v_part + jv, tl.sum(mine * xv * rs[:, None], 0), mask=jvm)
    tl.store(v_part + V + jv, tl.sum(mine, 0), mask=jvm)
    _st_rows(dx_bh + 2 * R, u, jv, jvm, T, HW, g * wvv[None, :] * rs[:, None] - xv * m[:, None], own)


def _tiles(R: int, V: int) -> tuple[int, int, int]:
    """(BT, BH, BV): 64 tokens per program up to 64-wide rows, fewer for wider rows (bounded registers)."""
    BH, BV = next_pow2(R // 2, 8), next_pow2(V, 8)
    widest = max(2 * BH, BV)
    return (64 if widest <= 64 else 32 if widest <= 128 else 16), BH, BV


def _freq(R: int, use_rope: bool, rope_base: float, device) -> torch.Tensor:
    """RoPE off: zero frequencies, which make the kernels' rotation the identity exactly."""
    return rope_inv_freq(R, rope_base, device) if use_rope else torch.zeros(R // 2, device=device)


def _geometry(x, w):
    B, T, H, W = x.shape
    R, KC = w.shape[1] // 2, w.shape[2]
    return B, T, H, R, W - 2 * R, KC


def _rows_view(x):
    """x with unit feature stride and heads packed (batch and token strides free: the layer's transposed view of
    the projection output is read in place)."""
    return x if x.stride(3) == 1 and x.stride(2) == x.shape[3] else x.contiguous()


def interdomain_input_fwd(x, w, tail, wk, bk, wv, bv, offset, use_rope, rope_base, eps):
    """q, k~, v~ [B, T, H, R | R | V] in x's dtype (fused.py's docstring); tail: [B, KC - 1, H 2R] or None."""
    B, T, H, R, V, KC = _geometry(x, w)
    x = _rows_view(x)
    q, k, v = x.new_empty(B, T, H, R), x.new_empty(B, T, H, R), x.new_empty(B, T, H, V)
    BT, BH, BV = _tiles(R, V)
    _fwd_kernel[(triton.cdiv(T, BT), B * H)](
        x=x, w=w, tail=x if tail is None else tail, freq=_freq(R, use_rope, rope_base, x.device), wk=wk, bk=bk,
        wv=wv, bv=bv, q=q, k=k, v=v, T=T, offset=offset, sxb=x.stride(0), sxt=x.stride(1), eps=eps, H=H, R=R, V=V,
        KC=KC, BT=BT, BH=BH, BV=BV, HAS_TAIL=tail is not None, num_warps=4)
    return q, k, v


def interdomain_input_bwd(x, w, tail, wk, bk, wv, bv, dq, dk, dv, offset, use_rope, rope_base, eps):
    """dx (x's layout made contiguous), dw, dtail (None without a tail), dwk, dbk, dwv, dbv, each in its input's
    dtype; the weight gradients are the host's sums of the programs' fp32 shares."""
    B, T, H, R, V, KC = _geometry(x, w)
    x = _rows_view(x)
    BT, BH, BV = _tiles(R, V)
    NP = triton.cdiv(T + KC - 1, BT - (KC - 1))
    dx = x.new_empty(B, T, H, 2 * R + V)
    dtail = torch.empty_like(tail) if tail is not None else None
    f32 = dict(dtype=torch.float32)
    dw_part, k_part, v_part = (x.new_empty(NP, B, H, *s, **f32) for s in ((2 * R, KC), (2, R), (2, V)))
    _bwd_kernel[(NP, B * H)](
        x=x, w=w, tail=x if tail is None else tail, freq=_freq(R, use_rope, rope_base, x.device), wk=wk, wv=wv,
        dq=dq, dk=dk, dv=dv, dx=dx, dtail=dx if dtail is None else dtail, dw_part=dw_part, k_part=k_part,
        v_part=v_part, T=T, offset=offset, sxb=x.stride(0), sxt=x.stride(1), eps=eps, H=H, R=R, V=V, KC=KC, BT=BT,
        BH=BH, BV=BV, HAS_TAIL=tail is not None, num_warps=8)  # ~a dozen live tiles: 8 warps bound the registers
    # [H, 2, R | V]: (weight, bias) per head; contiguous, as the fake kernel promises (a compiled caller checks)
    k_sum, v_sum = k_part.sum((0, 1)), v_part.sum((0, 1))
    dbk, dbv = k_sum[:, 1].to(bk.dtype).contiguous(), v_sum[:, 1].to(bv.dtype).contiguous()
    return (dx, dw_part.sum((0, 1)).to(w.dtype), dtail, k_sum[:, 0].sum(0).to(wk.dtype), dbk,
            v_sum[:, 0].sum(0).to(wv.dtype), dbv)


# The op enters autograd and torch.compile as two custom ops (as kernels/interdomain does): a compiled layer keeps
# the fused input path in its graph as one opaque node, and the backward, its own op, recomputes from x.


@torch.library.custom_op("megahybrid::interdomain_input_fwd", mutates_args=())
def interdomain_input_fwd_op(x: torch.Tensor, w: torch.Tensor, tail: torch.Tensor | None, wk: torch.Tensor,
                             bk: torch.Tensor, wv: torch.Tensor, bv: torch.Tensor, offset: int, use_rope: bool,
                             rope_base: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return interdomain_input_fwd(x, w, tail, wk, bk, wv, bv, offset, use_rope, rope_base, eps)


@interdomain_input_fwd_op.register_fake
def _(x, w, tail, wk, bk, wv, bv, offset, use_rope, rope_base, eps):
    B, T, H, R, V, _ = _geometry(x, w)
    return x.new_empty(B, T, H, R), x.new_empty(B, T, H, R), x.new_empty(B, T, H, V)


@torch.library.custom_op("megahybrid::interdomain_input_bwd", mutates_args=())
def interdomain_input_bwd_op(x: torch.Tensor, w: torch.Tensor, tail: torch.Tensor | None, wk: torch.Tensor,
                             bk: torch.Tensor, wv: torch.Tensor, bv: torch.Tensor, dq: torch.Tensor,
                             dk: torch.Tensor, dv: torch.Tensor, offset: int, use_rope: bool, rope_base: float,
                             eps: float) -> list[torch.Tensor]:
    """dx, dw, dtail (empty without a tail), dwk, dbk, dwv, dbv."""
    grads = interdomain_input_bwd(x, w, tail, wk, bk, wv, bv, dq, dk, dv, offset, use_rope, rope_base, eps)
    return [absent(x) if g is None else g for g in grads]


@interdomain_input_bwd_op.register_fake
def _(x, w, tail, wk, bk, wv, bv, dq, dk, dv, offset, use_rope, rope_base, eps):
    like = [w, tail, wk, bk, wv, bv]
    return [x.new_empty(x.shape)] + [absent(x) if t is None else torch.empty_like(t) for t in like]


def _setup_context(ctx, inputs, output):
    x, w, tail, wk, bk, wv, bv, offset, use_rope, rope_base, eps = inputs
    ctx.save_for_backward(x, w, tail, wk, bk, wv, bv)
    ctx.args = (offset, use_rope, rope_base, eps)


def _backward(ctx, dq, dk, dv):
    x, w, tail, wk, bk, wv, bv = ctx.saved_tensors
    dq, dk, dv = (g.contiguous() for g in (dq, dk, dv))
    dx, dw, dtail, dwk, dbk, dwv, dbv = interdomain_input_bwd_op(x, w, tail, wk, bk, wv, bv, dq, dk, dv, *ctx.args)
    return dx, dw, present(dtail) if tail is not None else None, dwk, dbk, dwv, dbv, None, None, None, None


interdomain_input_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def check_inputs(x, w, tail, wk, bk, wv, bv):
    """One-line ValueErrors naming the fix for every input the kernels cannot serve."""
    if x.dim() != 4 or w.dim() != 3:
        raise ValueError(f"x must be [B, T, H, 2R + V] and w [H, 2R, KC]; got {tuple(x.shape)} and {tuple(w.shape)}")
    B, T, H, W = x.shape
    R2, KC = w.shape[1], w.shape[2]
    R, V = R2 // 2, W - R2
    if w.shape[0] != H or R2 % 4:
        raise ValueError(f"w must be [H={H}, 2R, KC] with R even (RoPE rotates halves); got {tuple(w.shape)}: "
                         "choose an even feature_dim")
    if B == 0 or T == 0 or V < 1:
        raise ValueError(f"x must have B, T >= 1 and 2R + V > 2R = {R2} columns per head; got {tuple(x.shape)}")
    if R > MAX_DIM or V > MAX_DIM or not 1 <= KC <= MAX_TAPS:
        raise ValueError(f"need R, V <= {MAX_DIM} and 1 <= conv_size <= {MAX_TAPS}; got R={R}, V={V}, KC={KC}: "
                         "use smaller heads or the unfused input path")
    want = {"wk": (wk, (R,)), "bk": (bk, (H, R)), "wv": (wv, (V,)), "bv": (bv, (H, V))}
    if tail is not None:
        want["tail"] = (tail, (B, KC - 1, H * R2))
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} (x {tuple(x.shape)}, w {tuple(w.shape)}); got "
                             f"{tuple(t.shape)}")
    tensors = [x, w, wk, bk, wv, bv] + ([tail] if tail is not None else [])
    if any(t.dtype not in _FLOATS for t in tensors):
        raise ValueError(f"x, w, tail and the norm weights must be fp32/bf16/fp16; got {[t.dtype for t in tensors]}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted({str(t.device) for t in tensors})}")


def _new_tail(x, tail, R2, KC):
    """The last KC - 1 rows of cat(tail, x[..., :2R]) along time, without forming the concatenation."""
    B, T, H, _ = x.shape
    n = KC - 1
    recent = x[:, max(T - n, 0):, :, :R2].reshape(B, -1, H * R2)
    if T >= n:
        return recent
    older = tail[:, T:] if tail is not None else x.new_zeros(B, n - T, H * R2)
    return torch.cat((older, recent), 1)


def interdomain_input(x, w, tail, offset, use_rope, rope_base, wk, bk, wv, bv, norm_eps):
    """The fused input path (fused.py's docstring): q, k~, v~ [B, T, H, R | R | V] in x's dtype and the new conv
    tail [B, KC - 1, H 2R] (x's dtype).

    Args:
        x: [B, T, H, 2R + V] (fp32/bf16/fp16) per head q | k | v columns; any batch and token strides.
        w: [H, 2R, KC] conv weight; tail: [B, KC - 1, H 2R] or None (zeros), cast to x's dtype.
        offset: position of token 0; use_rope, rope_base: RoPE on q and k.
        wk [R], bk [H, R], wv [V], bv [H, V]: the head norms' scales (shared by heads) and biases; norm_eps.
    CPU tensors run naive.py (autograd) unless TRITON_INTERPRET=1, which runs the kernels in the interpreter.
    """
    check_inputs(x, w, tail, wk, bk, wv, bv)
    # conv size 1 has no tail rows: the kernels then see none (no zero-size tensor among their arguments)
    tail = tail.to(x.dtype).contiguous() if tail is not None and w.shape[2] > 1 else None
    if use_torch_path(x):
        return interdomain_input_naive(x, w, tail, offset, use_rope, rope_base, wk, bk, wv, bv, norm_eps)
    q, k, v = interdomain_input_fwd_op(x, w.contiguous(), tail, wk.contiguous(), bk.contiguous(), wv.contiguous(),
                                       bv.contiguous(), int(offset), bool(use_rope), float(rope_base),
                                       float(norm_eps))
    return q, k, v, _new_tail(x, tail, w.shape[1], w.shape[2])
