"""The selected Gated DeltaNet op over a long sequence cut into segments that run side by side (model.nats.gdn_segments).

The op's state kernels walk a sequence one 64-token chunk after another, parallel only over (batch, head, value
tile): at a 128K prefill of natsl-340m (batch 1, 6 heads) that is 96 programs on 132 SMs, latency-bound, 111 of the
compiled Hybrid's 415 ms of kernels (tools/results/nats-layer-prefill.md). Cut into S segments of whole chunks, the
sequence becomes S batch rows. Each segment's end state is affine in its start state, S_end = Phi S_0 + S_loc
(context parallelism's shard summary, megahybrid/model/mixers/nats.py, (2)): one run from the start state [I | 0]
with values [0 | v] gives [Phi | S_loc] and the outputs [o_Phi | o_loc]. The segments' true start states follow
by S - 1 products [K, K] x [K, V] per (batch, head), and the outputs are o_loc + S_0^T o_Phi. Exact; the op runs
once, on values K + V wide (1.5x the work at natsl-340m, S times the parallelism). Measured there (H200, 1440cd6,
tools/results/nats-layer-prefill.md): 8 segments take the compiled prefill from 417.2 to 409.7 ms, 2%; off by default.

Padding: the last segment is filled to whole chunks with neutral tokens (k = v = q = 0, beta = 0: nothing written;
g = 0: no decay), whose outputs are dropped; the op's keep entries for the padded chunks are 1.
"""
import math

import torch
import torch.nn.functional as F

from megahybrid.model.cp import read_start_state
from megahybrid_kernels.nats import chunk_selected_gdn

CHUNK = 64


def _pad_time(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x [B, T, ...] with `pad` zero rows appended along T."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x


def _segment_plan(T: int, segments: int) -> tuple[int, int]:
    """(segments used, chunks per segment): whole chunks each, no empty segment."""
    chunks = math.ceil(T / CHUNK)
    per = math.ceil(chunks / max(1, segments))
    return math.ceil(chunks / per), per


def segmented_gdn(q, k, v, g, beta, keep, segments: int, initial_state=None, output_final_state=False,
                  use_qk_l2norm=True, check_values=True):
    """chunk_selected_gdn's arguments and results (scale left at its default), computed in `segments` pieces of
    the sequence at once (module docstring). segments <= 1, or a sequence of one segment, calls the op as is."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    S, per = _segment_plan(T, segments)
    if S <= 1:
        return chunk_selected_gdn(q, k, v, g, beta, keep, initial_state=initial_state,
                                  output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                                  check_values=check_values)
    L = per * CHUNK
    pad = S * L - T
    rows = lambda x: _pad_time(x, pad).reshape(B * S, L, *x.shape[2:])  # noqa: E731
    keep = F.pad(keep, (0, S * per - keep.shape[-1]), value=1.0).unflatten(-1, (S, per)).transpose(1, 2)
    o_map, o_loc, transition, local = affine_gdn(rows(q), rows(k), rows(v), rows(g), rows(beta),
                                                 keep.reshape(B * S, H, per), use_qk_l2norm, check_values)
    transition, local = transition.unflatten(0, (B, S)), local.unflatten(0, (B, S))
    state = initial_state.float() if initial_state is not None else local.new_zeros(B, H, K, V)
    starts = []
    for j in range(S):
        starts.append(state)
        state = transition[:, j] @ state + local[:, j]
    out = from_start(o_map, o_loc, torch.stack(starts, 1).flatten(0, 1))
    return out.reshape(B, S * L, H, V)[:, :T], (state if output_final_state else None)


def affine_gdn(q, k, v, g, beta, keep, use_qk_l2norm=True, check_values=True):
    """The op run so that its results are affine in an unknown start state S_0 (context parallelism's shard summary
    and the segments above): from [I | 0] with values [0 | v]. Returns o_Phi [B, T, H, K] and o_loc [B, T, H, V]
    (the outputs are o_loc + S_0^T o_Phi, from_start) and Phi [B, H, K, K], S_loc [B, H, K, V] (S_end = Phi S_0 +
    S_loc)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    eye = torch.eye(K, device=k.device, dtype=torch.float32).expand(B, H, K, K)
    start = torch.cat([eye, eye.new_zeros(B, H, K, V)], -1)
    values = torch.cat([v.new_zeros(B, T, H, K), v], -1)
    o, final = chunk_selected_gdn(q, k, values, g, beta, keep, initial_state=start, output_final_state=True,
                                  use_qk_l2norm=use_qk_l2norm, check_values=check_values)
    o_map, o_loc = o.split([K, V], -1)
    transition, local = final.split([K, V], -1)
    return o_map, o_loc, transition, local


def from_start(o_map: torch.Tensor, o_loc: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """affine_gdn's outputs from the start state s0 [B, H, K, V]: o_loc + S_0^T o_Phi in o_loc's dtype."""
    return (o_loc.float() + read_start_state(o_map, s0)).to(o_loc.dtype)
