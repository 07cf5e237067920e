"""Token-by-token fp32 definition of chunk-selected Gated DeltaNet (the reference every kernel is tested against)."""
import torch


def naive_chunk_selected_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    keep: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    decay_dropped: bool = True,
    dkeep_dropped: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-selected Gated DeltaNet, computed one token at a time in fp32 (differentiable, also in `keep`).

    Args:
        q, k: `[B, T, H, K]` (already L2-normalized if wanted).
        v: `[B, T, H, V]`.
        g: `[B, T, H]` log decay per token; beta: `[B, T, H]`.
        keep: `[B, H, ceil(T / chunk_size)]`, 1 commits the chunk's write into the state, 0 rolls it back.
        scale: output scale, default `K ** -0.5`.
        initial_state: `[B, H, K, V]` or None (zeros).
        decay_dropped: a rolled-back chunk still applies its decays to the state (the reference default).
        dkeep_dropped: also give the straight-through gradient of `keep` where keep = 0 (zero otherwise).

    Returns:
        o `[B, T, H, V]` in fp32 and the final state `[B, H, K, V]` in fp32.
    """
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    # keep * keep.detach() has the same value for keep in {0, 1} but zero derivative where keep = 0
    gate = keep.float() if dkeep_dropped else keep.float() * keep.detach().float()
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for c0 in range(0, T, chunk_size):
        S_start, log_decay = S, 0.0
        for t in range(c0, min(c0 + chunk_size, T)):
            S, o_t = _gdn_token(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale)
            log_decay = log_decay + g[:, t]
            outputs.append(o_t)
        base = S_start * log_decay.exp()[..., None, None] if decay_dropped else S_start
        m = gate[:, :, c0 // chunk_size, None, None]
        S = base + m * (S - base)
    return torch.stack(outputs, dim=1), S


def _gdn_token(S, q_t, k_t, v_t, g_t, beta_t, scale):
    """One Gated DeltaNet step in the flash-linear-attention convention; all `[B, H, ...]`."""
    S = S * g_t.exp()[..., None, None]
    v_t = beta_t[..., None] * (v_t - torch.einsum("bhkv,bhk->bhv", S, k_t))
    S = S + k_t[..., :, None] * v_t[..., None, :]
    return S, scale * torch.einsum("bhkv,bhk->bhv", S, q_t)
