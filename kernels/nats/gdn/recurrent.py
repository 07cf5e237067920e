"""One-token decode step of chunk-selected Gated DeltaNet (fp32 state math in torch)."""
import torch


def chunk_selected_gdn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rollback_state: torch.Tensor,
    keep: torch.Tensor | None = None,
    scale: float | None = None,
    decay_dropped: bool = True,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advance the decode cache by one token; pass `keep` on the last token of each 64-token chunk.

    The cache is the running state (with the current chunk's pseudo-update) and the rollback state: the state
    at the current chunk's start, decayed by the chunk's gates so far when `decay_dropped`. Giving `keep`
    commits the chunk: state = rollback + keep * (state - rollback), and the rollback state becomes that state.

    Args:
        q, k: `[B, H, K]`; v: `[B, H, V]`; g, beta: `[B, H]`.
        state, rollback_state: `[B, H, K, V]` fp32 (zeros, or the chunk op's final state, at a chunk start).
        keep: `[B, H]` in {0, 1}, or None inside a chunk.

    Returns:
        o `[B, H, V]` in v's dtype, the new state and the new rollback state.
    """
    _check_step(q, k, v, g, beta, state, rollback_state, keep)
    qf, kf, vf, gf, bf = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        qf = qf * torch.rsqrt(qf.pow(2).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    decay = gf.exp()[..., None, None]
    S = state * decay
    v_new = bf[..., None] * (vf - torch.einsum("bhkv,bhk->bhv", S, kf))
    S = S + kf[..., :, None] * v_new[..., None, :]
    o = scale * torch.einsum("bhkv,bhk->bhv", S, qf)
    rollback = rollback_state * decay if decay_dropped else rollback_state
    if keep is not None:
        S = rollback + keep.float()[..., None, None] * (S - rollback)
        rollback = S
    return o.to(v.dtype), S, rollback


def _check_step(q, k, v, g, beta, state, rollback_state, keep):
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, H, K] (one token); got {tuple(q.shape)} and {tuple(k.shape)}")
    B, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (B, H):
        raise ValueError(f"v must be [B, H, V] = [{B}, {H}, V]; got {tuple(v.shape)}")
    if g.shape != (B, H) or beta.shape != (B, H):
        raise ValueError(f"g and beta must be [B, H] = {(B, H)}; got {tuple(g.shape)} and {tuple(beta.shape)}")
    want = (B, H, K, v.shape[-1])
    if state.shape != want or rollback_state.shape != want:
        raise ValueError(f"state and rollback_state must be [B, H, K, V] = {want}; got {tuple(state.shape)} and "
                         f"{tuple(rollback_state.shape)}")
    if keep is not None and keep.shape != (B, H):
        raise ValueError(f"keep must be [B, H] = {(B, H)} or None; got {tuple(keep.shape)}")
