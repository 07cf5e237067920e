"""Chunk-selected GDN over a long sequence cut into segments that run side by side (and the state map they need).

The op's state recurrence walks the chunks of a sequence in order, one program per (V tile, batch row, head), so
with few rows (a prefill of one 128K-token prompt: 6 heads, 2,048 chunks) most SMs idle while each program steps
through the chunks (`_fwd_h_kernel` took 109 of the natsl-340m Hybrid's 479 ms of 128K prefill kernels on the
H200). The state is linear in (initial state, values) jointly, so a segment run once from the start state
[I | 0] with values [0 | v] gives, in one op call at value width K + V (B·H·nseg rows instead of B·H):

    o_map   [T, K]   q_t^T Phi_{0->t}: what the segment's true start state S_0 adds to its outputs (o_map S_0)
    o_local [T, V]   its outputs from a zero start
    Phi     [K, K]   its state transition (keep masks and dropped chunks' decays included): S_end = Phi S_0 + h
    h       [K, V]   its zero-start final state

Then the start states follow by a prefix over the segments (s_{i+1} = Phi_i s_i + h_i; nseg small products) and
o = o_local + o_map s_i. Context parallelism (megahybrid.model.mixers.nats) uses the same map across ranks.
"""
import math

import torch

from .chunk import chunk_selected_gdn

CHUNK = 64


def run_with_state_map(q, k, v, g, beta, keep, **op_kwargs):
    """The op from the start state [I | 0] with values [0 | v]: (o_map [B, T, H, K], o_local [B, T, H, V] in v's
    dtype, Phi [B, H, K, K], h [B, H, K, V] fp32). op_kwargs: chunk_selected_gdn's other options."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    eye = torch.eye(K, device=k.device, dtype=torch.float32).expand(B, H, K, K)
    start = torch.cat([eye, eye.new_zeros(B, H, K, V)], -1)
    values = torch.cat([v.new_zeros(B, T, H, K), v], -1)
    o, final = chunk_selected_gdn(q, k, values, g, beta, keep, initial_state=start, output_final_state=True,
                                  **op_kwargs)
    o_map, o_local = o.split([K, V], -1)
    transition, local = final.split([K, V], -1)
    return o_map, o_local, transition.contiguous(), local.contiguous()


def add_start_state(o_local: torch.Tensor, o_map: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """o_local + o_map s0 per (batch row, head): [B, T, H, V] in o_local's dtype, summed in fp32. The product takes
    o_map's dtype (bf16 runs: the tensor cores, where an fp32 einsum ran at a tenth of their rate)."""
    corr = torch.einsum("bthk,bhkv->bthv", o_map, s0.to(o_map.dtype))
    return (o_local.float() + corr.float()).to(o_local.dtype)


def gdn_segments(B: int, H: int, T: int, device: torch.device, min_chunks: int = 64, most: int = 32) -> int:
    """How many segments a GPU call should run: 1 (the plain op) unless B·H rows leave SMs idle and the sequence
    has whole chunks to cut; then the fewest (a power of two dividing the chunk count, segments of at least
    `min_chunks` chunks, at most `most`) that give every SM a row."""
    if device.type != "cuda" or T % CHUNK:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chunks, n = T // CHUNK, 1
    while B * H * n < sms and n < most and chunks % (2 * n) == 0 and chunks // (2 * n) >= min_chunks:
        n *= 2
    return n


def chunk_selected_gdn_segmented(q, k, v, g, beta, keep, segments: int, initial_state=None,
                                 output_final_state: bool = False, **op_kwargs):
    """chunk_selected_gdn (same arguments and results) with each sequence cut into `segments` equal runs of whole
    chunks that the op runs as one batch (module docstring). Differentiable as the op is; T must be a multiple of
    64 * segments."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if segments == 1:
        return chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=initial_state,
                                  output_final_state=output_final_state, **op_kwargs)
    if T % (CHUNK * segments):
        raise ValueError(f"T = {T} must be a multiple of 64 x segments = {CHUNK * segments}")
    n, L = segments, T // segments

    def rows(x):  # [B, T, ...] -> [B * n, L, ...]
        return x.reshape(B * n, L, *x.shape[2:])

    keep_rows = keep.reshape(B, H, n, math.ceil(L / CHUNK)).transpose(1, 2).reshape(B * n, H, -1)
    o_map, o_local, phi, h = run_with_state_map(rows(q), rows(k), rows(v), rows(g), rows(beta), keep_rows,
                                                **op_kwargs)
    phi, h = phi.unflatten(0, (B, n)), h.unflatten(0, (B, n))
    s = initial_state.float() if initial_state is not None else h.new_zeros(B, H, K, V)
    starts = []
    for i in range(n):
        starts.append(s)
        s = phi[:, i] @ s + h[:, i]
    o = add_start_state(o_local, o_map, torch.stack(starts, 1).flatten(0, 1))
    return o.reshape(B, T, H, V), (s if output_final_state else None)
