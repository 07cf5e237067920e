"""Reference input path of the `I` layer's dual input with query: the fp32 torch definition of the fused op,
differentiable through torch autograd (fused.py's docstring has the kernels' side).

x [B, T, H, 2R + V] (per head q | k | v columns), conv weight w [H, 2R, KC], tail [B, KC - 1, H 2R] (zeros: None):
    xp = cat(tail, x[..., :2R]) along time;  c[t, h, j] = sum_{i < KC} w[h, j, i] xp[t + i, h, j]
    rope: rotate-half over the q channels c[..., :R] and the k channels c[..., R:] separately, at positions
        offset + t with frequencies base^(-2i/R);  xi(y) = silu(y) / max(||silu(y)||_2, 1e-6)
    q = xi(rope(c_q)),  k~ = RMSNorm(xi(rope(c_k))) wk + bk[h],  v~ = RMSNorm(x_v) wv + bv[h],
        RMSNorm(z) = z rsqrt(mean(z^2) + norm_eps)
Every step in fp32 (the layer's unfused path rounds to x's dtype after the conv and after RoPE); q, k~, v~ are
returned in x's dtype with the new tail, the last KC - 1 rows of xp. These are the layer's causal_depthwise_conv,
rope, feature_map and HeadNorm (tests/kernels/test_interdomain_input.py holds them to it)."""
import torch
import torch.nn.functional as F

FEATURE_EPS = 1e-6


def rope_inv_freq(R: int, base: float, device) -> torch.Tensor:
    """base^(-2i/R) for i < R/2, fp32, computed as the layer's `rope` computes it (the kernels take this tensor, so
    that both multiply the same fp32 frequencies by the same fp32 positions)."""
    return base ** (-torch.arange(0, R, 2, device=device, dtype=torch.float32) / R)


def _rope(y: torch.Tensor, offset: int, base: float) -> torch.Tensor:
    """Rotate-half RoPE over the last dim (R even) of y [B, T, H, R], fp32."""
    R, T = y.shape[-1], y.shape[1]
    pos = torch.arange(offset, offset + T, device=y.device, dtype=torch.float32)
    ang = pos[:, None] * rope_inv_freq(R, base, y.device)[None]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    y1, y2 = y[..., :R // 2], y[..., R // 2:]
    return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), -1)


def _xi(y: torch.Tensor) -> torch.Tensor:
    return F.normalize(F.silu(y), dim=-1, eps=FEATURE_EPS)


def _rms(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight.float() + bias.float()


def interdomain_input_naive(x, w, tail, offset, use_rope, rope_base, wk, bk, wv, bv, norm_eps):
    """x [B, T, H, 2R + V] (per head q | k | v columns), w [H, 2R, KC], tail [B, KC - 1, H 2R] or None, wk [R],
    bk [H, R], wv [V], bv [H, V]. Returns q, k~, v~ [B, T, H, R | R | V] in x's dtype and the new tail (the last
    KC - 1 conv inputs, in x's dtype). Every step in fp32."""
    B, T, H, _ = x.shape
    R2, KC = w.shape[1], w.shape[2]
    R = R2 // 2
    if tail is None:
        tail = x.new_zeros(B, KC - 1, H * R2)
    xp = torch.cat((tail.to(x.dtype), x[..., :R2].reshape(B, T, H * R2)), 1)
    xf = xp.float().view(B, T + KC - 1, H, R2)
    c = sum(w[:, :, i].float() * xf[:, i:i + T] for i in range(KC))
    cq, ck = c[..., :R], c[..., R:]
    if use_rope:
        cq, ck = _rope(cq, offset, rope_base), _rope(ck, offset, rope_base)
    q = _xi(cq)
    k = _rms(_xi(ck), wk, bk, norm_eps)
    v = _rms(x[..., R2:].float(), wv, bv, norm_eps)
    new_tail = xp[:, xp.shape[1] - (KC - 1):]
    return q.to(x.dtype), k.to(x.dtype), v.to(x.dtype), new_tail
