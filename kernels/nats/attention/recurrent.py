"""Decoding for attention over selected chunks: a cache of the kept chunks plus the current chunk, and a step.

Usage per generated token: `o = selected_attention_step(q, k, v, cache)`; once `cache.chunk_full()`, the layer
decides the chunk's selection and calls `cache.commit(keep)` before the next step. Only kept chunks are stored.
"""
import math
from dataclasses import dataclass

import torch


@dataclass
class SelectedAttentionCache:
    """Keys/values of the kept chunks ([B, H, L, Dk] / [B, H, L, Dv]; the first n_kept[b, h] rows are valid, L grows
    as needed) and of the current, unfinished chunk ([B, H, C, Dk] / [B, H, C, Dv]; the first n_cur rows valid)."""

    k_kept: torch.Tensor
    v_kept: torch.Tensor
    n_kept: torch.Tensor
    k_cur: torch.Tensor
    v_cur: torch.Tensor
    n_cur: int
    chunk_size: int

    @classmethod
    def empty(cls, B: int, H: int, D: int, chunk_size: int = 64, device=None, dtype=torch.float32,
              Dv: int | None = None):
        """An empty cache; D is the key head dim, Dv the value head dim (default D)."""
        zeros = lambda L, d: torch.zeros(B, H, L, d, device=device, dtype=dtype)  # noqa: E731
        Dv = D if Dv is None else Dv
        n_kept = torch.zeros(B, H, device=device, dtype=torch.long)
        return cls(zeros(0, D), zeros(0, Dv), n_kept, zeros(chunk_size, D), zeros(chunk_size, Dv), 0, chunk_size)

    def chunk_full(self) -> bool:
        return self.n_cur == self.chunk_size

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add one token's k [B, H, Dk] and v [B, H, Dv] to the current chunk."""
        if self.chunk_full():
            raise ValueError("the current chunk is full: call cache.commit(keep) before the next step")
        self.k_cur[:, :, self.n_cur] = k
        self.v_cur[:, :, self.n_cur] = v
        self.n_cur += 1

    def commit(self, keep: torch.Tensor) -> None:
        """Close the full current chunk: heads with keep[b, h] = 1 store it, the others drop it."""
        B, H = self.n_kept.shape
        if not self.chunk_full():
            raise ValueError(f"commit needs a full chunk ({self.chunk_size} tokens), the current one has {self.n_cur}")
        if tuple(keep.shape) != (B, H):
            raise ValueError(f"keep must be [B, H] = {(B, H)} for commit, got {tuple(keep.shape)}")
        need = int(self.n_kept.max()) + self.chunk_size
        if need > self.k_kept.shape[2]:
            grow = lambda x: torch.nn.functional.pad(x, (0, 0, 0, need - x.shape[2]))  # noqa: E731
            self.k_kept, self.v_kept = grow(self.k_kept), grow(self.v_kept)
        # Every head writes after its valid rows; only kept heads advance n_kept, so the others' writes stay unused.
        rows = (self.n_kept[..., None] + torch.arange(self.chunk_size, device=keep.device))[..., None]
        self.k_kept.scatter_(2, rows.expand(B, H, self.chunk_size, self.k_cur.shape[-1]), self.k_cur)
        self.v_kept.scatter_(2, rows.expand(B, H, self.chunk_size, self.v_cur.shape[-1]), self.v_cur)
        self.n_kept += (keep == 1).long() * self.chunk_size
        self.n_cur = 0


def selected_attention_prefill(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, chunk_size: int = 64):
    """Build the cache after a prompt. k [B, T, H, Dk], v [B, T, H, Dv]; keep [B, H, ceil(T / C)] (a partial last
    chunk's entry is unused: that chunk stays current). The prompt's outputs come from `chunk_selected_attention`."""
    B, T, H, D = k.shape
    if tuple(keep.shape) != (B, H, math.ceil(T / chunk_size)):
        raise ValueError(f"keep must be [B, H, ceil(T/chunk_size)] = {(B, H, math.ceil(T / chunk_size))}, "
                         f"got {tuple(keep.shape)}")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, T, H, Dv] = [{B}, {T}, {H}, Dv], got {tuple(v.shape)}")
    cache = SelectedAttentionCache.empty(B, H, D, chunk_size, k.device, k.dtype, Dv=v.shape[-1])
    for c in range(math.ceil(T / chunk_size)):
        lo, hi = c * chunk_size, min(T, (c + 1) * chunk_size)
        cache.k_cur[:, :, : hi - lo] = k[:, lo:hi].transpose(1, 2)
        cache.v_cur[:, :, : hi - lo] = v[:, lo:hi].transpose(1, 2)
        cache.n_cur = hi - lo
        if cache.chunk_full():
            cache.commit(keep[:, :, c])
    return cache


def selected_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SelectedAttentionCache, scale: float | None = None
) -> torch.Tensor:
    """One decoding step: append k, v to the cache's current chunk, then attend from q to the kept chunks and
    the current chunk (itself included).

    Args:
        q, k: [B, H, Dk]; v: [B, H, Dv] for the new token.
        cache: updated in place.
    Returns:
        o: [B, H, Dv].
    """
    B, H = cache.n_kept.shape
    D, Dv = cache.k_cur.shape[-1], cache.v_cur.shape[-1]
    for name, x, d in (("q", q, D), ("k", k, D), ("v", v, Dv)):
        if tuple(x.shape) != (B, H, d):
            raise ValueError(f"{name} must be [B, H, {d}] = {(B, H, d)} for one decoding step, got {tuple(x.shape)}")
    cache.append(k, v)
    scale = D**-0.5 if scale is None else scale
    keys = torch.cat([cache.k_kept, cache.k_cur[:, :, : cache.n_cur]], 2).float()
    values = torch.cat([cache.v_kept, cache.v_cur[:, :, : cache.n_cur]], 2).float()
    L = cache.k_kept.shape[2]
    valid = torch.cat([torch.arange(L, device=q.device) < cache.n_kept[..., None],
                       torch.ones(B, H, cache.n_cur, device=q.device, dtype=torch.bool)], -1)
    s = torch.einsum("bhd,bhld->bhl", q.float(), keys) * scale
    p = torch.softmax(s.masked_fill(~valid, float("-inf")), -1)
    return torch.einsum("bhl,bhld->bhd", p, values).to(q.dtype)
