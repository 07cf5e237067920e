"""Chunk-selected Gated DeltaNet in plain torch (the CPU path): the WY form per 64-token chunk, all chunks at once,
and a loop over chunks only for the chunk-start states. Same semantics as `naive.py`; autograd differentiates it
(also in `keep`, straight-through as the definition's gate m_c).

Per chunk with start state S, G the chunk-local cumsum of g and A_ij = beta_i k_i.k_j e^{G_i - G_j} (i > j):
U = (I + A)^{-1} (beta V - beta e^G K S) = u - w S (the new values v'), o = scale (e^G Q S + causal(Q K^T
e^{G_i - G_j}) U), and S_full = e^{G_L} S + K~^T U with K~_i = k_i e^{G_L - G_i}.
"""
import torch
import torch.nn.functional as F

C = 64


def torch_chunk_selected_gdn(q, k, v, g, beta, keep, scale, initial_state=None, decay_dropped=True,
                             dkeep_dropped=False):
    """q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; keep [B, H, NT]. Returns o (v's dtype) and the
    final state [B, H, K, V] (fp32)."""
    B, T, H, K = q.shape
    V, NT = v.shape[-1], keep.shape[-1]
    pad = NT * C - T
    # padded tokens: g = 0 (no decay) and beta = 0 (no write), so they change nothing
    qc, kc, vc = (_chunks(F.pad(x.float(), (0, 0, 0, 0, 0, pad)), NT) for x in (q, k, v))
    gc, bc = (_chunks(F.pad(x.float(), (0, 0, 0, pad))[..., None], NT)[..., 0] for x in (g, beta))
    G = gc.cumsum(-1)
    u, w, attn = _wy(qc, kc, vc, G, bc)
    gate = keep.float() if dkeep_dropped else keep.float() * keep.detach().float()
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    eg, decay = G.exp(), G[..., -1].exp()
    k_tilde = kc * (G[..., -1:] - G).exp()[..., None]
    starts, new_values = [], []
    for c in range(NT):
        starts.append(S)
        vn = u[:, :, c] - w[:, :, c] @ S
        new_values.append(vn)
        d = decay[:, :, c, None, None]
        full = d * S + k_tilde[:, :, c].transpose(-1, -2) @ vn
        base = d * S if decay_dropped else S
        S = base + gate[:, :, c, None, None] * (full - base)
    S0, U = torch.stack(starts, 2), torch.stack(new_values, 2)
    o = scale * ((qc * eg[..., None]) @ S0 + attn @ U)
    o = o.reshape(B, H, NT * C, V)[:, :, :T].transpose(1, 2)
    return o.to(v.dtype), S


def _chunks(x, NT):
    """[B, T', H, D] (T' = NT * 64) -> [B, H, NT, 64, D]."""
    B, _, H, D = x.shape
    return x.reshape(B, NT, C, H, D).permute(0, 3, 1, 2, 4)


def _wy(qc, kc, vc, G, bc):
    """u = (I + A)^{-1} beta V, w = (I + A)^{-1} beta e^G K and the causal intra-chunk scores, per chunk."""
    decay = (G[..., :, None] - G[..., None, :]).tril().exp()
    strict = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(-1)
    A = (kc @ kc.transpose(-1, -2)) * decay * bc[..., None]
    eye = torch.eye(C, device=G.device)
    M = torch.where(strict, A, 0.0) + eye
    rhs = torch.cat([vc * bc[..., None], kc * (bc * G.exp())[..., None]], -1)
    x = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
    u, w = x[..., :vc.shape[-1]], x[..., vc.shape[-1]:]
    attn = torch.where(strict | eye.bool(), (qc @ kc.transpose(-1, -2)) * decay, 0.0)
    return u, w, attn
