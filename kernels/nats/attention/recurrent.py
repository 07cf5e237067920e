"""Decoding for attention over selected chunks: a cache of the kept chunks plus the current chunk, and a step.

Usage per generated token: `o = selected_attention_step(q, k, v, cache)`; once `cache.chunk_full()`, the layer
decides the chunk's selection and calls `cache.commit(keep)` before the next step. Only kept chunks are stored.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SelectedAttentionCache:
    """Keys and values in one buffer per (batch, head), k [B, H, L, Dk] and v [B, H, L, Dv]: rows [0, n_kept[b, h])
    hold the kept chunks, the next n_cur rows the current, unfinished chunk. A step then attends over the first
    n_kept + n_cur rows of each head with a length mask, reading the bf16 cache once (no concatenated fp32 copy of
    the kept chunks per token), and a commit only moves n_kept. `rows` (host) = max n_kept + chunk_size <= L, the
    rows a step reads; L grows by whole chunks at a commit that needs it (the one host sync, once per chunk)."""

    k: torch.Tensor
    v: torch.Tensor
    n_kept: torch.Tensor
    n_cur: int
    chunk_size: int
    rows: int

    @classmethod
    def empty(cls, B: int, H: int, D: int, chunk_size: int = 64, device=None, dtype=torch.float32,
              Dv: int | None = None):
        """An empty cache; D is the key head dim, Dv the value head dim (default D)."""
        Dv = D if Dv is None else Dv
        k = torch.zeros(B, H, chunk_size, D, device=device, dtype=dtype)
        v = torch.zeros(B, H, chunk_size, Dv, device=device, dtype=dtype)
        return cls(k, v, torch.zeros(B, H, device=device, dtype=torch.long), 0, chunk_size, chunk_size)

    def chunk_full(self) -> bool:
        return self.n_cur == self.chunk_size

    def kept(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept chunks' keys and values of one (batch, head): [n_kept, Dk], [n_kept, Dv]."""
        n = int(self.n_kept[b, h])
        return self.k[b, h, :n], self.v[b, h, :n]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add one token's k [B, H, Dk] and v [B, H, Dv] to the current chunk (row n_kept + n_cur of each head)."""
        if self.chunk_full():
            raise ValueError("the current chunk is full: call cache.commit(keep) before the next step")
        row = (self.n_kept + self.n_cur)[..., None, None]
        self.k.scatter_(2, row.expand(*row.shape[:3], k.shape[-1]), k[:, :, None].to(self.k.dtype))
        self.v.scatter_(2, row.expand(*row.shape[:3], v.shape[-1]), v[:, :, None].to(self.v.dtype))
        self.n_cur += 1

    def commit(self, keep: torch.Tensor) -> None:
        """Close the full current chunk: heads with keep[b, h] = 1 keep its rows, the others' rows are written over
        by the next chunk."""
        B, H = self.n_kept.shape
        if not self.chunk_full():
            raise ValueError(f"commit needs a full chunk ({self.chunk_size} tokens), the current one has {self.n_cur}")
        if tuple(keep.shape) != (B, H):
            raise ValueError(f"keep must be [B, H] = {(B, H)} for commit, got {tuple(keep.shape)}")
        self.n_kept += (keep == 1).long() * self.chunk_size
        self.n_cur = 0
        self._reserve(int(self.n_kept.max()) + self.chunk_size)

    def _reserve(self, rows: int) -> None:
        if rows > self.k.shape[2]:
            grow = lambda x: F.pad(x, (0, 0, 0, rows - x.shape[2]))  # noqa: E731
            self.k, self.v = grow(self.k), grow(self.v)
        self.rows = rows


def selected_attention_prefill(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, chunk_size: int = 64):
    """Build the cache after a prompt. k [B, T, H, Dk], v [B, T, H, Dv]; keep [B, H, ceil(T / C)] (a partial last
    chunk's entry is unused: that chunk stays current). The prompt's outputs come from `chunk_selected_attention`."""
    B, T, H, D = k.shape
    C = chunk_size
    NC, full = math.ceil(T / C), T // C
    if tuple(keep.shape) != (B, H, NC):
        raise ValueError(f"keep must be [B, H, ceil(T/chunk_size)] = {(B, H, NC)}, got {tuple(keep.shape)}")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, T, H, Dv] = [{B}, {T}, {H}, Dv], got {tuple(v.shape)}")
    # every stored token's row: the kept chunks packed in order, then the open chunk; dropped chunks are not stored
    kept = torch.cat([(keep[..., :full] == 1).long(), keep.new_ones(B, H, NC - full, dtype=torch.long)], -1)
    before = torch.cumsum(kept, -1) - kept  # kept chunks before each chunk, [B, H, NC]
    cache = SelectedAttentionCache.empty(B, H, D, C, k.device, k.dtype, Dv=v.shape[-1])
    cache.n_kept, cache.n_cur = kept[..., :full].sum(-1) * C, T - full * C
    cache._reserve(int(cache.n_kept.max()) + C)
    row = before.repeat_interleave(C, -1)[..., :T] * C + torch.arange(T, device=k.device) % C  # [B, H, T]
    b, h, t = kept.repeat_interleave(C, -1)[..., :T].nonzero(as_tuple=True)
    cache.k[b, h, row[b, h, t]] = k[b, t, h].to(cache.k.dtype)
    cache.v[b, h, row[b, h, t]] = v[b, t, h].to(cache.v.dtype)
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
    D, Dv = cache.k.shape[-1], cache.v.shape[-1]
    for name, x, d in (("q", q, D), ("k", k, D), ("v", v, Dv)):
        if tuple(x.shape) != (B, H, d):
            raise ValueError(f"{name} must be [B, H, {d}] = {(B, H, d)} for one decoding step, got {tuple(x.shape)}")
    cache.append(k, v)
    scale = D**-0.5 if scale is None else scale
    rows = torch.arange(cache.rows, device=q.device)
    valid = rows < (cache.n_kept + cache.n_cur)[..., None]  # [B, H, rows]
    o = F.scaled_dot_product_attention(q[:, :, None].to(cache.k.dtype), cache.k[:, :, :cache.rows],
                                       cache.v[:, :, :cache.rows], attn_mask=valid[:, :, None], scale=scale)
    return o[:, :, 0].to(q.dtype)
