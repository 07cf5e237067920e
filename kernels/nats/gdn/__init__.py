"""Chunk-selected Gated DeltaNet (NAtS-L's linear branch): public op, decode step and fp32 reference."""
import contextlib
import math

import torch
from triton.runtime.errors import OutOfResources

from kernels.nats.checks import check_keep_values, check_log_decay, use_torch_path
from kernels.nats.gdn.chunk import chunk_selected_gdn_bwd, chunk_selected_gdn_fwd
from kernels.nats.gdn.naive import naive_chunk_selected_gdn
from kernels.nats.gdn.recurrent import chunk_selected_gdn_step
from kernels.nats.gdn.torch_chunk import torch_chunk_selected_gdn

__all__ = ["chunk_selected_gdn", "chunk_selected_gdn_step", "naive_chunk_selected_gdn"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class ChunkSelectedGDNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, keep, scale, initial_state, output_final_state, decay_dropped,
                dkeep_dropped):
        with _refuse_unbuildable(q, v):
            o, ht, G, Ai = chunk_selected_gdn_fwd(q, k, v, g, beta, keep, scale, initial_state, output_final_state,
                                                  decay_dropped)
        ctx.save_for_backward(q, k, v, beta, keep, G, Ai, initial_state)
        ctx.scale, ctx.decay_dropped, ctx.dkeep_dropped = scale, decay_dropped, dkeep_dropped
        ctx.g_dtype = g.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, keep, G, Ai, initial_state = ctx.saved_tensors
        with _refuse_unbuildable(q, v):
            dq, dk, dv, dg, dbeta, dkeep, dh0 = chunk_selected_gdn_bwd(
                q, k, v, beta, keep, G, Ai, ctx.scale, initial_state, do, dht, ctx.decay_dropped, ctx.dkeep_dropped)
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, dkeep, None, dh0, None, None, None


@contextlib.contextmanager
def _refuse_unbuildable(q, v):
    """A head size whose kernels need more shared memory than the GPU has becomes a one-line ValueError."""
    try:
        yield
    except OutOfResources as e:
        raise ValueError(f"chunk_selected_gdn: K={q.shape[-1]}, V={v.shape[-1]} in {q.dtype} does not fit this GPU "
                         f"({str(e).splitlines()[0]}); use bf16 or smaller heads") from None


def chunk_selected_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    keep: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    decay_dropped: bool = True,
    dkeep_dropped: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet whose state keeps a chunk's write only where `keep` = 1 (semantics: kernels/nats/README.md).

    Args:
        q, k: `[B, T, H, K]`, K <= 256; L2-normalized by the caller unless `use_qk_l2norm`.
        v: `[B, T, H, V]`.
        g: `[B, T, H]` log decay (<= 0, else ValueError); beta: `[B, T, H]`.
        keep: `[B, H, ceil(T / 64)]` float in {0, 1} (else ValueError): commit chunk c's write into the state (1) or
            roll it back (0). Checking the values of a new g or keep tensor costs one host sync on a GPU.
        scale: output scale, default `K ** -0.5`.
        initial_state: `[B, H, K, V]` (fp32 recommended) or None.
        output_final_state: also return the final state `[B, H, K, V]` in fp32.
        chunk_size: must be 64 (the selection granularity and the kernels' chunk).
        decay_dropped: a rolled-back chunk still applies its decays to the state (reference default).
        dkeep_dropped: give the straight-through gradient of `keep` also where keep = 0 (default: zero there).

    Returns:
        o `[B, T, H, V]` in v's dtype and the final state (or None). CPU tensors run `torch_chunk.py` (autograd)
        unless TRITON_INTERPRET=1 asks for the Triton kernels.
    """
    _check(q, k, v, g, beta, keep, initial_state, chunk_size)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_torch_path(q):
        o, ht = torch_chunk_selected_gdn(q, k, v, g, beta, keep, scale, initial_state, decay_dropped, dkeep_dropped)
        return o, (ht if output_final_state else None)
    args = [x.contiguous() for x in (q, k, v, g, beta, keep)]
    h0 = initial_state.contiguous() if initial_state is not None else None
    return ChunkSelectedGDNFunction.apply(*args, scale, h0, output_final_state, decay_dropped, dkeep_dropped)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _check(q, k, v, g, beta, keep, initial_state, chunk_size):
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64 (got {chunk_size}); the selection and kernels use 64-token chunks")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"g and beta must be [B, T, H] = {(B, T, H)}; got {tuple(g.shape)} and {tuple(beta.shape)}")
    if keep.shape != (B, H, math.ceil(T / chunk_size)):
        raise ValueError(f"keep must be [B, H, ceil(T/64)] = {(B, H, math.ceil(T / chunk_size))}; got "
                         f"{tuple(keep.shape)}")
    if K > 256 or T == 0:
        raise ValueError(f"need 1 <= T and K <= 256; got T={T}, K={K}")
    tensors = [q, k, v, g, beta, keep] + ([initial_state] if initial_state is not None else [])
    if any(t.dtype not in _FLOATS for t in tensors) or len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError("q, k, v must share one float dtype (fp32/bf16/fp16) and g, beta, keep must be float")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted({str(t.device) for t in tensors})}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}; got "
                         f"{tuple(initial_state.shape)}")
    check_keep_values(keep, "chunk_selected_gdn")
    check_log_decay(g, "chunk_selected_gdn")
