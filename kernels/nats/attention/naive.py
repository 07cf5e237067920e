"""Reference definition of attention over selected chunks (fp32, one query chunk at a time).

Every other implementation in this folder is tested against `naive_chunk_selected_attention`, including the
gradient with respect to `keep`, which autograd produces here from a continuous gate (see README.md).
"""
import math

import torch


class _SelectedOnlyGrad(torch.autograd.Function):
    """Identity whose backward keeps the gradient of selected chunks only (keep = 1), like the reference."""

    @staticmethod
    def forward(ctx, keep):
        ctx.save_for_backward(keep)
        return keep.clone()

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * (keep == 1).to(grad.dtype)


def naive_chunk_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    grad_unselected: bool = False,
) -> torch.Tensor:
    """Causal softmax attention where a query sees its own chunk and the earlier chunks with keep = 1.

    Args:
        q, k, v: [B, T, H, D].
        keep: [B, H, ceil(T / chunk_size)], values in {0, 1}. It multiplies the exp-scores of a chunk's keys as
            seen from later chunks, so d(loss)/d(keep) is the derivative with respect to that gate.
        scale: logit scale, default 1/sqrt(D).
        grad_unselected: also return the gate derivative for chunks with keep = 0 (default: zero there).

    Returns:
        o: [B, T, H, D] in fp32.
    """
    B, T, H, D = q.shape
    C = chunk_size
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    gate = keep.float() if grad_unselected else _SelectedOnlyGrad.apply(keep.float())
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    outs = []
    for c in range(math.ceil(T / C)):
        lo, hi = c * C, min(T, (c + 1) * C)
        s = torch.einsum("bhid,bhjd->bhij", q[:, :, lo:hi], k[:, :, :hi]) * scale
        causal = torch.arange(lo, hi)[:, None] >= torch.arange(hi)[None, :]
        # Keys of chunk c' < c carry gate[c']; the own chunk is always seen (gate 1).
        w_key = torch.cat([gate[:, :, :c].repeat_interleave(C, dim=-1), gate.new_ones(B, H, hi - lo)], -1)
        s = s.masked_fill(~causal.to(s.device), float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True)) * w_key[:, :, None, :]
        p = e / e.sum(-1, keepdim=True)
        outs.append(torch.einsum("bhij,bhjd->bhid", p, v[:, :, :hi]))
    return torch.cat(outs, 2).transpose(1, 2)
