"""`N` (NAtS-L, arXiv 2602.03681) and `G` (Gated DeltaNet): one layer module on the kernels/nats ops.

Both layers project the input once (one ColumnParallelLinear whose rows are grouped per GDN head, so a TP rank
holds whole heads and the layout does not depend on the TP size): q, k, v (each through a causal short conv and
SiLU), the output gate, the decay and beta inputs, and for `N` the chunk scores. The score layer of the
reference is a bias-free linear map of each 64-token chunk's mean input; mean and linear map commute, so its
rows sit in the same projection and the per-chunk mean is taken of its per-token outputs (under sequence
parallelism the projection has gathered the whole sequence, so every rank scores whole chunks).

`N`: the GDN view (H heads, q/k width K, v width V, q/k L2-normalized in the op) and the attention view (the same
channels as A heads of width K*H/A for q/k and V*H/A for v, per-head q/k RMSNorm, no RoPE) run over one per-head,
per-chunk choice {attention, GDN} (index 0, 1), the argmax of the chunk logits with the straight-through
gradient (Gumbel-softmax as an option). The GDN op commits the chunks chosen for GDN and rolls the others back;
the attention op keeps the chunks chosen for attention visible to later chunks; every chunk's own tokens are
seen by both. The branch outputs are RMS-normalized in groups of the attention value width, scaled, merged
with a softmax over a linear map of q (one pair per attention head), gated by swish(gate) and projected back.
`G`: the same projections and GDN branch with every chunk kept, a gated RMSNorm over V, no attention.

Decoding keeps a per-layer `NatsDecodeCache` in megatron's inference_context (see `_decode`).

Context parallelism (parallel.cp > 1, contiguous shards of whole 64-token chunks, megahybrid.model.cp): chunk
scores and selections are shard-local (chunks never straddle shards). (1) The short conv takes the previous
shard's last conv_size - 1 inputs (`previous_shard_tail`). (2) GDN: the state after a shard is affine in the
state before it, S_end = Phi S_0 + S_loc (Phi [K, K] per head, data-dependent through k, g, beta and the keep
masks, dropped chunks' decays included), because the recurrence, rollback included, is linear in (S, v) jointly
and acts on every value column alike. One run of the op with value width K + V from the start state [I_K | 0] and
values [0 | v] therefore gives [Phi | S_loc] as its final state and [o_Phi | o_loc] as its outputs, where o_Phi
is scale Phi_t^T q_t; `prefix_states_matrix` over the all-gathered (S_loc, Phi) gives the true S_0, and the
outputs are o_loc + S_0^T o_Phi (`_shard_gdn`, exact; the same one core pass whether or not there is an earlier
shard, so no rerun). (3) Attention, kept chunks only: each rank packs, per (batch, head), its shard's chunks
with keep 1 in order into the first of C chunk slots (C the largest kept count over batch, heads and CP ranks,
from one MAX all-reduce of the counts, so every rank's piece has one shape; at least 1, all padding when nothing
is kept), their keep entries gathered along (an earlier shard's chunk gets its straight-through keep gradient
back), padding zero with keep 0, and all-gathers the K|V and keep pieces. Rank r runs the op once over [the
pieces of ranks < r, its own shard with its keep decisions] with zero queries ahead of its own (their outputs are
dropped, their gradients are zero): every kept earlier chunk lies before every local query, so it is seen whole
whatever its slot, padding by none, and the own shard is the op's as at cp = 1 (`_shard_attention`; the op
returns no log-sum-exp, so merging a separate prefix pass is not open). Bytes scale with the kept share of the
most-keeping head (cp_bytes at model.nats.kept_fraction, 1.0 the bound); the zero queries add r * C * 64 rows;
the count costs one host sync per layer. Gradients reach earlier ranks through every all-gather.
"""
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megahybrid_kernels.nats import chunk_selected_attention, chunk_selected_gdn, chunk_selected_gdn_step
from megahybrid_kernels.nats.attention import SelectedAttentionCache, selected_attention_prefill, selected_attention_step
from megahybrid.errors import ConfigError
from megahybrid.model.cp import (
    gather_sequence, layer_cp_group, max_over_ranks, prefix_states_matrix, previous_shard_tail)
from megahybrid.model.mixers import Mixer
from megahybrid.model.mixers.gdn_segments import affine_gdn, from_start, segmented_gdn
from megahybrid.model.mixers.shortconv import causal_depthwise_conv

CHUNK = 64  # the selection granularity of NAtS-L and the chunk of both ops


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _local_param(full: torch.Tensor, dim: int, dtype) -> torch.nn.Parameter:
    """This TP rank's contiguous slice of a full (CPU-initialized, TP-independent) tensor along `dim`, tagged as
    megatron tags its own sharded weights."""
    world, rank = _tp()
    piece = full.chunk(world, dim)[rank].contiguous().to(dtype)
    param = torch.nn.Parameter(piece)
    set_tensor_model_parallel_attributes(param, True, dim, 1)
    return param


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class _AllReduceBothWays(torch.autograd.Function):
    """Sum of per-rank partials; each rank then uses a different slice, so the gradient is summed as well."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _select(logits: torch.Tensor, gumbel: bool) -> torch.Tensor:
    """One-hot choice over the last dim, exactly 0/1 in value, with the softmax's straight-through gradient."""
    if gumbel:
        logits = logits - torch.empty_like(logits).exponential_().log()
    soft = logits.softmax(-1)
    hard = F.one_hot(soft.argmax(-1), soft.shape[-1]).to(soft.dtype)
    return hard + (soft - soft.detach())


def _chunk_mean(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B, ceil(T / 64), ...] means over each chunk's tokens (the last may be partial)."""
    B, T = x.shape[:2]
    NC = math.ceil(T / CHUNK)
    padded = F.pad(x, (0, 0) * (x.dim() - 2) + (0, NC * CHUNK - T)).view(B, NC, CHUNK, *x.shape[2:])
    # formed on the device: writing the last count from the host is a copy no CUDA graph can capture
    counts = (T - CHUNK * torch.arange(NC, device=x.device)).clamp(max=CHUNK).to(x.dtype)
    return padded.sum(2) / counts.view(1, NC, *([1] * (x.dim() - 2)))


@dataclass
class NatsDecodeCache:
    """One layer's decode state for one batch: conv inputs of the last conv_size - 1 tokens, the GDN state and
    its rollback copy (the open chunk's start state, decayed; `N` only), the attention cache (kept chunks + open
    chunk; `N` only), the open chunk's summed score logits and its length."""

    conv_tail: torch.Tensor
    state: torch.Tensor
    rollback: torch.Tensor
    attention: SelectedAttentionCache | None
    score_sum: torch.Tensor | None
    n_open: int

    def nbytes(self) -> int:
        tensors = [self.conv_tail, self.state, self.rollback]
        if self.attention is not None:
            c = self.attention
            tensors += [c.k, c.v]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class NatsLayer(MegatronModule):
    """`N` (select=True) or `G` (select=False); input [s, b, hidden], output ([s, b, hidden], None)."""

    def __init__(self, config: TransformerConfig, layer_number: int, options, select: bool, eps: float,
                 cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        world, _ = _tp()
        o = options
        if o.gdn_heads % world or (select and o.attention_heads % world):
            raise ConfigError(f"model.nats.gdn_heads={o.gdn_heads} and attention_heads={o.attention_heads} must be "
                              f"divisible by parallel.tp={world}")
        self.layer_number, self.select, self.eps = layer_number, select, eps
        self.gumbel = o.selection == "gumbel"
        self.H, self.K, self.V = o.gdn_heads // world, o.gdn_head_dim, o.gdn_value_dim
        self.per_head = o.attention_heads // o.gdn_heads
        self.dqk, self.dv = o.attn_qk_dim, o.attn_v_dim
        self.conv_size, self.gdn_segments = o.conv_size, o.gdn_segments
        self.widths = [2 * self.K + self.V, self.V, 1, 1] + ([2] if select else [])
        self.proj = ColumnParallelLinear(
            config.hidden_size, o.gdn_heads * sum(self.widths), config=config, init_method=config.init_method,
            bias=False, gather_output=False, skip_bias_add=True)
        self.out_proj = RowParallelLinear(
            o.gdn_heads * self.V, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True)
        self._init_own_params(o, config.params_dtype)
        self.last_stats: dict[str, torch.Tensor] = {}

    def _init_own_params(self, o, dtype):
        """Full tensors drawn on the CPU in a fixed order (the same model for every TP size), then sliced."""
        H, K = o.gdn_heads, o.gdn_head_dim
        bound = 1.0 / math.sqrt(o.conv_size)  # torch's default Conv1d init for a depthwise kernel
        self.conv_weight = _local_param(torch.empty(H, self.widths[0], o.conv_size).uniform_(-bound, bound), 0, dtype)
        self.A_log = _local_param(torch.empty(H).uniform_(0, 16).log(), 0, torch.float32)
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = _local_param(dt + torch.log(-torch.expm1(-dt)), 0, torch.float32)  # softplus^-1(dt)
        ones = lambda n: torch.nn.Parameter(torch.ones(n, dtype=dtype))  # noqa: E731
        if not self.select:
            self.out_norm = ones(self.V)
            return
        merge = torch.empty(2 * o.attention_heads, H * K)
        self.config.init_method(merge)
        self.merge_weight = _local_param(merge, 1, dtype)
        self.q_norm, self.k_norm = ones(self.dqk), ones(self.dqk)
        self.attn_norm, self.gdn_norm = ones(self.dv), ones(self.dv)

    def _replicated(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight every TP rank holds whole but applies to its own heads: its gradient is summed over TP."""
        from megahybrid.distributed import tensor_parallel_group

        return copy_to_tensor_model_parallel_region(weight, group=tensor_parallel_group()) if _tp()[0] > 1 else weight

    def forward(self, hidden_states, attention_mask=None, inference_context=None, **unused):
        proj, _ = self.proj(hidden_states)
        parts = proj.transpose(0, 1).unflatten(-1, (self.H, sum(self.widths))).split(self.widths, -1)
        if inference_context is not None and not self.training:
            o = self._decode(parts, inference_context)
        else:
            o = self._mix(parts)
        out, _ = self.out_proj(o.transpose(0, 1).contiguous())
        return out, None

    def _conv(self, qkv: torch.Tensor, tail: torch.Tensor | None):
        """Causal depthwise conv + SiLU over [B, T, H, C]; also returns the last conv_size - 1 inputs."""
        B, T, H, C = qkv.shape
        weight = self.conv_weight.reshape(H * C, self.conv_size)
        y, tail = causal_depthwise_conv(qkv.reshape(B, T, H * C), weight, tail)
        return F.silu(y).view(B, T, H, C), tail

    def _inputs(self, parts, tail=None, cp_group=None):
        """q, k, v (after conv and SiLU), gate, g (log decay, fp32), beta, score logits (or None), conv tail.
        With a CP group the conv continues from the previous shard's inputs."""
        qkv, gate, a, b = parts[:4]
        if cp_group is not None:
            B, T, H, C = qkv.shape
            tail = previous_shard_tail(qkv.reshape(B, T, H * C), self.conv_size - 1, cp_group)
        qkv, tail = self._conv(qkv, tail)
        q, k, v = qkv.split([self.K, self.K, self.V], -1)
        g = -self.A_log.exp() * F.softplus(a[..., 0].float() + self.dt_bias)
        score = parts[4].float() if self.select else None
        return q, k, v, gate, g, b[..., 0].sigmoid(), score, tail

    def _attention_view(self, q, k, v):
        """[B, T, H, K/V] -> the attention heads [B, T, H * per_head, d]; q and k RMS-normalized per head."""
        B, T = q.shape[:2]
        qa = _rms(q.reshape(B, T, -1, self.dqk), self._replicated(self.q_norm), self.eps)
        ka = _rms(k.reshape(B, T, -1, self.dqk), self._replicated(self.k_norm), self.eps)
        return qa, ka, v.reshape(B, T, -1, self.dv)

    def _merge(self, q, o_gdn, o_attn, gate):
        """Normalize each branch in groups of dv, weight by softmax(W q) per attention head, gate, flatten."""
        B, T = q.shape[:2]
        if not self.select:
            o = _rms(o_gdn, self._replicated(self.out_norm), self.eps)
            return (o * F.silu(gate)).reshape(B, T, -1)
        logits = q.reshape(B, T, -1) @ self.merge_weight.t()
        if _tp()[0] > 1:
            from megahybrid.distributed import tensor_parallel_group

            logits = _AllReduceBothWays.apply(logits, tensor_parallel_group())
        n = self.H * self.per_head
        lo = _tp()[1] * n
        weights = logits.unflatten(-1, (-1, 2))[:, :, lo:lo + n].float().softmax(-1).to(q.dtype)
        o_gdn = _rms(o_gdn.reshape(B, T, n, self.dv), self._replicated(self.gdn_norm), self.eps)
        o_attn = _rms(o_attn, self._replicated(self.attn_norm), self.eps)
        o = weights[..., :1] * o_attn + weights[..., 1:] * o_gdn
        self.last_stats["merge"] = weights.detach().flatten(0, 2).mean(0)
        return o.reshape(B, T, -1) * F.silu(gate.reshape(B, T, -1))

    def _choose(self, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk logits [B, NC, H, 2] -> keep masks [B, H, NC] for attention and for GDN."""
        choice = _select(score, self.gumbel and self.training).permute(0, 2, 1, 3)
        keep_attn = choice[..., 0].detach()
        self.last_stats["kept"] = keep_attn.mean((0, 2))
        return choice[..., 0], choice[..., 1]

    def _per_attention_head(self, keep: torch.Tensor) -> torch.Tensor:
        """A GDN head's choices [B, H, ...] for each attention head viewing its channels: [B, H * per_head, ...]
        (repeat_interleave along the heads, as an expand: the form the 128K prefill's CUDA graph ran with)."""
        B, H = keep.shape[:2]
        return keep.unsqueeze(2).expand(B, H, self.per_head, *keep.shape[2:]).flatten(1, 2)

    def _mix(self, parts):
        """The training / full-sequence forward: [B, T, H * V] before the output projection."""
        group = layer_cp_group(self.config)
        q, k, v, gate, g, beta, score, _ = self._inputs(parts, cp_group=group)
        gdn = self._gdn_op() if group is None else _shard_gdn(group)
        # g = -exp(A_log) softplus(.) <= 0 and keep (an exact one-hot, _select) in {0, 1} by construction: the ops'
        # value checks, a host sync each on a GPU with tensors new every step, are skipped (check_values=False)
        if not self.select:
            keep = torch.ones(q.shape[0], self.H, math.ceil(q.shape[1] / CHUNK), device=q.device)
            o_gdn, _ = gdn(q, k, v, g, beta, keep, use_qk_l2norm=True, check_values=False)
            return self._merge(q, o_gdn, None, gate)
        keep_attn, keep_gdn = self._choose(_chunk_mean(score))
        o_gdn, _ = gdn(q, k, v, g, beta, keep_gdn, use_qk_l2norm=True, check_values=False)
        qa, ka, va = self._attention_view(q, k, v)
        attention = chunk_selected_attention if group is None else _shard_attention(group)
        o_attn = attention(qa, ka, va, self._per_attention_head(keep_attn), scale=self.dqk ** -0.5,
                           check_values=False)
        return self._merge(q, o_gdn, o_attn, gate)

    def _gdn_op(self):
        """The GDN op over a whole sequence: as is, or in model.nats.gdn_segments pieces side by side."""
        if self.gdn_segments == 1:
            return chunk_selected_gdn
        return functools.partial(segmented_gdn, segments=self.gdn_segments)

    def _decode(self, parts, context):
        """The first call (sequence_len_offset = 0) is a prefill that builds this layer's cache in
        context.key_value_memory_dict[layer_number]; later calls advance it token by token (a later call with
        several tokens, a prefill in pieces, runs them as steps)."""
        memory = context.key_value_memory_dict
        if context.sequence_len_offset == 0:
            o, memory[self.layer_number] = self._prefill(parts)
            return o
        if self.layer_number not in memory:
            raise ValueError(f"no NAtS-L cache for layer {self.layer_number}: start decoding at sequence_len_offset 0")
        cache = memory[self.layer_number]
        steps = [self._step([p[:, t:t + 1] for p in parts], cache) for t in range(parts[0].shape[1])]
        return torch.cat(steps, 1)

    def _prefill(self, parts):
        q, k, v, gate, g, beta, score, tail = self._inputs(parts)
        B, T = q.shape[:2]
        n = T // CHUNK * CHUNK  # tokens of the complete chunks, whose choice is final; the rest is the open chunk
        if self.select:
            keep_attn, keep_gdn = self._choose(_chunk_mean(score))
        else:
            keep_gdn = torch.ones(B, self.H, math.ceil(T / CHUNK), device=q.device)
        o_gdn, state, rollback = self._gdn_prefill(q, k, v, g, beta, keep_gdn, n)
        cache = NatsDecodeCache(tail, state, rollback if self.select else None, None, None, T - n)
        if not self.select:
            return self._merge(q, o_gdn, None, gate), cache
        qa, ka, va = self._attention_view(q, k, v)
        keep = self._per_attention_head(keep_attn.detach())
        o_attn = chunk_selected_attention(qa, ka, va, keep, scale=self.dqk ** -0.5, check_values=False)
        cache.attention = selected_attention_prefill(ka, va, keep, CHUNK)
        cache.score_sum = score[:, n:].sum(1)
        return self._merge(q, o_gdn, o_attn, gate), cache

    def _gdn_prefill(self, q, k, v, g, beta, keep, n):
        """The prompt's GDN outputs, running state and rollback state: the complete chunks with their choices,
        then the open chunk from their final state (its start state decayed by its gates is the rollback)."""
        B, T = q.shape[:2]
        state = q.new_zeros(B, self.H, self.K, self.V, dtype=torch.float32)
        outs = []
        if n:
            o, state = self._gdn_op()(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], keep[:, :, : n // CHUNK],
                                      output_final_state=True, use_qk_l2norm=True, check_values=False)
            outs.append(o)
        rollback = state
        if n < T:
            o, state = chunk_selected_gdn(q[:, n:], k[:, n:], v[:, n:], g[:, n:], beta[:, n:],
                                          keep.new_ones(B, self.H, 1), initial_state=rollback,
                                          output_final_state=True, use_qk_l2norm=True, check_values=False)
            outs.append(o)
            rollback = rollback * g[:, n:].sum(1).exp()[..., None, None]
        return torch.cat(outs, 1), state, rollback

    def _step(self, parts, cache: NatsDecodeCache):
        q, k, v, gate, g, beta, score, cache.conv_tail = self._inputs(parts, cache.conv_tail)
        cache.n_open = (cache.n_open + 1) % CHUNK
        if not self.select:  # `G` commits every chunk to its state: the running state is all it keeps
            o_gdn, cache.state, _ = chunk_selected_gdn_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], cache.state,
                                                            cache.state, decay_dropped=False, use_qk_l2norm=True)
            return self._merge(q, o_gdn[:, None], None, gate)
        keep_attn = keep_gdn = None
        cache.score_sum = cache.score_sum + score[:, 0]
        if cache.n_open == 0:  # the open chunk is complete: decide its type, commit it to one memory
            keep_attn, keep_gdn = (x[..., 0] for x in self._choose((cache.score_sum / CHUNK)[:, None]))
            cache.score_sum = torch.zeros_like(cache.score_sum)
        o_gdn, cache.state, cache.rollback = chunk_selected_gdn_step(
            q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], cache.state, cache.rollback, keep=keep_gdn,
            use_qk_l2norm=True)
        qa, ka, va = (x[:, 0] for x in self._attention_view(q, k, v))
        o_attn = selected_attention_step(qa, ka, va, cache.attention, self.dqk ** -0.5)
        if keep_attn is not None:
            cache.attention.commit(self._per_attention_head(keep_attn))
        return self._merge(q, o_gdn[:, None], o_attn[:, None], gate)

    def tensorboard_scalars(self) -> dict[str, float]:
        """Selection telemetry of the last forward (this rank's heads): attention-kept fraction of the chunks,
        its standard deviation over heads, and the mean merge weight of each branch."""
        if not self.select or "kept" not in self.last_stats:
            return {}
        kept, merge = self.last_stats["kept"], self.last_stats["merge"]
        spread = kept.std() if kept.numel() > 1 else kept.new_zeros(())
        values = torch.stack([kept.mean(), spread, merge[0], merge[1]]).tolist()
        return dict(zip(("kept_attention", "kept_attention_head_std", "merge_weight_attention",
                         "merge_weight_gdn"), values))


def _shard_gdn(group):
    """chunk_selected_gdn for this CP rank's shard (module docstring, (2)): outputs as if the op had run from the
    state after all earlier shards; the final state is not returned (None)."""

    def gdn(q, k, v, g, beta, keep, use_qk_l2norm, check_values=True):
        o_map, o_local, transition, local = affine_gdn(q, k, v, g, beta, keep, use_qk_l2norm, check_values)
        s0 = prefix_states_matrix(local.contiguous(), transition.contiguous(), group)
        return from_start(o_map, o_local, s0), None

    return gdn


def _shard_attention(group):
    """chunk_selected_attention for this CP rank's shard (module docstring, (3)): this shard's queries over the
    kept chunks of every earlier shard, compacted, then this shard with its own keep decisions."""

    def attention(q, k, v, keep, scale, check_values=True):
        count = max_over_ranks((keep.detach() == 1).sum(-1).amax().reshape(1), group)
        slots = max(1, count)  # one all-padding slot when nothing is kept: every rank's shapes still agree
        kv, kept = compact_kept_chunks(torch.cat([k, v], -1), keep, slots)
        rank = torch.distributed.get_rank(group)
        # Every rank, rank 0 with an empty prefix, slices both gathered tensors, so every rank runs their backward.
        prefix_kv = gather_sequence(kv, 1, group)[:, :rank * slots * CHUNK]
        prefix_keep = gather_sequence(kept, 2, group)[:, :, :rank * slots]
        prefix_k, prefix_v = prefix_kv.split([k.shape[-1], v.shape[-1]], -1)
        return attend_after_prefix(q, k, v, keep, prefix_k, prefix_v, prefix_keep, scale, check_values)

    return attention


def compact_kept_chunks(x: torch.Tensor, keep: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, head), the chunks of x [B, S, H, D] whose keep [B, H, S/64] is 1, in order, in the first of
    `slots` chunk slots: [B, slots*64, H, D] (padding zero) and their keep entries [B, H, slots] (padding 0).
    Gathers, so gradients (keep's straight-through one included) return to the chosen chunks."""
    B, S, H, D = x.shape
    NC = S // CHUNK
    order = torch.arange(NC, device=keep.device).expand_as(keep)
    picked = torch.where(keep.detach() == 1, order, NC).sort(-1).values[..., :slots]  # NC marks padding
    real, index = picked < NC, picked.clamp(max=NC - 1)
    chunks = x.reshape(B, NC, CHUNK, H, D).permute(0, 3, 1, 2, 4)
    rows = chunks.gather(2, index[..., None, None].expand(B, H, slots, CHUNK, D))
    rows = torch.where(real[..., None, None], rows, 0)
    return rows.permute(0, 2, 3, 1, 4).reshape(B, slots * CHUNK, H, D), torch.where(real, keep.gather(2, index), 0)


def attend_after_prefix(q, k, v, keep, prefix_k, prefix_v, prefix_keep, scale, check_values=True):
    """chunk_selected_attention of q over [prefix, own keys]: one op call with zero queries ahead of q's (their
    outputs are dropped, their gradients are zero), so a prefix chunk with keep 1 is seen by every query, one
    with keep 0 by none."""
    P = prefix_k.shape[1]
    q_all = torch.cat([q.new_zeros(q.shape[0], P, *q.shape[2:]), q], 1)
    k_all, v_all = torch.cat([prefix_k, k], 1), torch.cat([prefix_v, v], 1)
    return chunk_selected_attention(q_all, k_all, v_all, torch.cat([prefix_keep, keep], 2), scale=scale,
                                    check_values=check_values)[:, P:]


def _spec(select: bool):
    def spec(cfg) -> ModuleSpec:
        return ModuleSpec(module=NatsLayer, params={"options": cfg.nats, "select": select, "eps": cfg.norm_eps})

    return spec


def nats_params(cfg, select: bool = True) -> int:
    """Projection (q, k, v, gate, decay, beta, and the chunk scores for `N`), conv, A_log and dt_bias, output
    projection; for `N` also the merge map, q/k norms and both branch scales, for `G` the output norm."""
    o, d = cfg.nats, cfg.hidden_size
    H, K, V = o.gdn_heads, o.gdn_head_dim, o.gdn_value_dim
    n = d * H * (2 * K + 2 * V + 2) + H * (2 * K + V) * o.conv_size + 2 * H + H * V * d
    if not select:
        return n + V
    return n + d * 2 * H + 2 * o.attention_heads * H * K + 2 * o.attn_qk_dim + 2 * o.attn_v_dim


def _gdn_core_flops(cfg) -> float:
    """Chunked Gated DeltaNet per token and head, 2 FLOPs per MAC: v' = u - wS, the state write, qS (3 KV), the
    intra-chunk kk^T, qk^T, (I + A)^-1 k (3 CK) and (I + A)^-1 v, (qk^T) v' (2 CV)."""
    o = cfg.nats
    K, V = o.gdn_head_dim, o.gdn_value_dim
    return 2.0 * o.gdn_heads * (3 * K * V + 3 * CHUNK * K + 2 * CHUNK * V)


def nats_flops(cfg, select: bool = True) -> float:
    """2 per weight, the conv, the GDN core, and for `N` attention over the own chunk plus the kept fraction
    (model.nats.kept_fraction, default 1.0: every chunk, the worst case) of the causal context."""
    o = cfg.nats
    conv = 2.0 * o.gdn_heads * (2 * o.gdn_head_dim + o.gdn_value_dim) * o.conv_size
    flops = 2.0 * nats_params(cfg, select) + conv + _gdn_core_flops(cfg)
    if select:
        seen = o.kept_fraction * cfg.seq_length + (1 - o.kept_fraction) * CHUNK
        flops += seen * o.attention_heads * (o.attn_qk_dim + o.attn_v_dim)
    return flops


def nats_state_floats(cfg, context: int, select: bool = True) -> int:
    """Decode cache: GDN state (and for `N` its rollback copy), conv tails, and for `N` the K/V of the open
    chunk and of the kept complete chunks (model.nats.kept_fraction of them; 1.0 = all kept, the worst case)."""
    o = cfg.nats
    H, K, V = o.gdn_heads, o.gdn_head_dim, o.gdn_value_dim
    floats = H * K * V * (2 if select else 1) + (o.conv_size - 1) * H * (2 * K + V)
    if select:
        kept_tokens = round(o.kept_fraction * (context // CHUNK)) * CHUNK
        floats += (kept_tokens + CHUNK) * o.attention_heads * (o.attn_qk_dim + o.attn_v_dim)
    return floats


def cache_bytes(cfg, context: int, kv_bytes: int = 2) -> dict[str, int]:
    """Decode-cache bytes per layer after `context` tokens: `N` (at model.nats.kept_fraction), `G`, and the full
    KV cache of a softmax layer `S` of the same model; states fp32, K/V and conv tails `kv_bytes` each."""
    from megahybrid.model.mixers.softmax import softmax_state_floats

    o = cfg.nats
    H, K, V = o.gdn_heads, o.gdn_head_dim, o.gdn_value_dim
    out = {}
    for char, select in (("N", True), ("G", False)):
        state = H * K * V * (2 if select else 1)
        out[char] = 4 * state + kv_bytes * (nats_state_floats(cfg, context, select) - state)
    out["S"] = kv_bytes * softmax_state_floats(cfg, context)
    return out


def nats_cp_bytes(cfg, cp: int, element_bytes: int, select: bool = True) -> int:
    """Bytes one CP rank sends per layer, sequence and training step. Each all-gather sends (cp - 1) copies of
    the rank's piece forward and reduce-scatters the gathered gradient, (cp - 1) pieces, backward. Pieces: the
    conv halo (conv_size - 1 input rows of the q/k/v channels, activation dtype), the
    fp32 GDN summary (state S_loc [K, V] and transition Phi [K, K] per head); for `N` also the attention view's K
    and V of C compacted chunks (activation dtype) and their fp32 keep entries, C = ceil(kept_fraction * S / 64)
    with model.nats.kept_fraction read as the kept share of the most-keeping (sequence, head, rank), which sizes
    every piece: the default 1.0 is the bound (every chunk kept). The 8-byte count all-reduce is not counted."""
    o = cfg.nats
    H, K, V = o.gdn_heads, o.gdn_head_dim, o.gdn_value_dim
    piece = (o.conv_size - 1) * H * (2 * K + V) * element_bytes + 4 * H * K * (K + V)
    if select:
        slots = _cp_slots(cfg, cp)
        piece += slots * CHUNK * H * (K + V) * element_bytes + 4 * slots * o.attention_heads
    return 2 * (cp - 1) * piece


def _cp_slots(cfg, cp: int) -> int:
    """C, the compacted chunk slots per rank, at model.nats.kept_fraction (nats_cp_bytes)."""
    return max(1, math.ceil(cfg.nats.kept_fraction * (cfg.seq_length // cp // CHUNK)))


def nats_cp_flops(cfg, cp: int, select: bool = True) -> float:
    """Forward FLOPs per token that context parallelism adds on the last rank (module docstring, (2) and (3)):
    the GDN op at value width K + V instead of V (the Phi columns, in _gdn_core_flops' terms), the correction
    S_0^T o_Phi (2 K V per head), cp - 1 prefix products Phi S ([K, K] x [K, V] per head) per shard; for `N` also
    the zero queries ahead of the shard, P = (cp - 1) C 64 rows (C as in nats_cp_bytes) over about P^2 / 2
    prefix keys in all, 2 FLOPs per multiply-add of q k and p v."""
    if cp == 1:
        return 0.0
    o = cfg.nats
    H, K, V = o.gdn_heads, o.gdn_head_dim, o.gdn_value_dim
    S = cfg.seq_length // cp
    flops = 2.0 * H * (3 * K * K + 2 * CHUNK * K) + 2.0 * H * K * V + (cp - 1) * 2.0 * H * K * K * V / S
    if select:
        P = (cp - 1) * _cp_slots(cfg, cp) * CHUNK
        flops += P * P / S * o.attention_heads * (o.attn_qk_dim + o.attn_v_dim)
    return flops


NATSL = Mixer("N", "NAtS-L", _spec(True), nats_params, nats_flops, nats_state_floats, chunk_size=CHUNK, cp=True,
              cp_bytes=nats_cp_bytes, cp_flops=nats_cp_flops,
              cache="NAtS-L cache: kept-chunk K/V + open chunk, GDN state + rollback copy, conv tails")
GATED_DELTANET = Mixer(
    "G", "Gated DeltaNet", _spec(False), lambda cfg: nats_params(cfg, False), lambda cfg: nats_flops(cfg, False),
    lambda cfg, context: nats_state_floats(cfg, context, False), chunk_size=CHUNK, cp=True,
    cp_bytes=lambda cfg, cp, element_bytes: nats_cp_bytes(cfg, cp, element_bytes, False),
    cp_flops=lambda cfg, cp: nats_cp_flops(cfg, cp, False),
    cache="GDN state + conv tails")
