"""Attention over selected chunks in plain torch (the CPU path): masked einsum attention over blocks of query chunks.

Same semantics and selection gradient as `naive.py` (README.md); autograd differentiates it. Queries are processed
QUERY_BLOCK tokens at a time against the keys up to the block's end, so memory is O(QUERY_BLOCK * T) per head.
"""
import torch

QUERY_BLOCK = 512


def torch_chunk_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    grad_unselected: bool = False,
) -> torch.Tensor:
    """q, k [B, T, H, Dk], v [B, T, H, Dv], keep [B, H, NC] in {0, 1}; returns o [B, T, H, Dv] in q's dtype."""
    B, T, H, _ = q.shape
    C = chunk_size
    # keep * (keep == 1) equals keep on {0, 1}; its derivative is zero where keep = 0 (the reference's default)
    gate = keep.float() if grad_unselected else keep.float() * (keep == 1).float()
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    chunk_of = torch.arange(T, device=q.device) // C
    pos = torch.arange(T, device=q.device)
    block = max(C, QUERY_BLOCK // C * C)
    outs = []
    for lo in range(0, T, block):
        hi = min(T, lo + block)
        s = torch.einsum("bhid,bhjd->bhij", qf[:, :, lo:hi], kf[:, :, :hi]) * scale
        cq, ck = chunk_of[lo:hi, None], chunk_of[None, :hi]
        causal = pos[lo:hi, None] >= pos[None, :hi]
        earlier = (ck < cq).float()
        # weight of key s for query t: 1 in the own chunk (causal), gate[c(s)] for earlier chunks, 0 otherwise
        w = gate[:, :, None, chunk_of[:hi]] * earlier + ((ck == cq) & causal).float()
        visible = (w.detach() > 0) | ((ck == cq) & causal)
        m = s.detach().masked_fill(~visible, float("-inf")).amax(-1, keepdim=True)
        e = torch.exp((s - m).masked_fill(~causal, float("-inf"))) * w
        p = e / e.sum(-1, keepdim=True)
        outs.append(torch.einsum("bhij,bhjd->bhid", p, vf[:, :, :hi]))
    return torch.cat(outs, 2).transpose(1, 2).to(q.dtype)
