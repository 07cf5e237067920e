"""Context parallelism: each CP rank holds one contiguous, ordered shard of every sequence.

Contiguous shards (rank r holds tokens [r*S, (r+1)*S) of a T = cp*S sequence) are what the recurrent mixers
need: a rank's initial state is the state after all earlier shards, obtained by the state-passing pattern of
LASP-2 / flash-linear-attention (every rank summarizes its shard, one all-gather of the fixed-size summaries,
a causal prefix combine). Softmax layers all-gather K and V and mask by global position; with contiguous
shards the last rank attends over the whole sequence and the first over its own shard only, an imbalance of
(2r+1)/cp in attention work on rank r (documented in the README; the matmuls around it are balanced).

Pieces here: a differentiable all-gather along the sequence (its backward sums the gradients of all ranks and
keeps this rank's slice), the shard of a batch, the RoPE table of a shard, the prefix combine of per-rank
summaries for diagonal and matrix transitions, and the read-out of a start state by per-token maps.
"""
import torch
import torch.distributed as dist

from megahybrid_kernels._triton import tf32_bmm


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over `group` in rank order; the backward reduce-scatters the gradient, each rank
    getting the sum of every rank's gradient for its own part: (cp - 1) pieces sent, where an all-reduce of the
    gathered gradient sends 2 (cp - 1). NCCL and gloo (torch 2.13, the CPU pin) serve it; it runs outside compiled
    graphs (gather_sequence)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        # the ranks' parts one after another along dim 0 (already so, without a copy, for a gather along dim 0)
        parts = grad.contiguous() if ctx.dim == 0 else torch.cat(grad.chunk(ctx.size, ctx.dim))
        mine = parts.new_empty(parts.shape[0] // ctx.size, *parts.shape[1:])
        reduce_scatter(mine, parts, group=ctx.group)
        return mine, None, None


def reduce_scatter(output: torch.Tensor, parts: torch.Tensor, group) -> None:
    """output = the sum over ranks of their parts[r * n:(r + 1) * n] for this rank r (n = len(output)), the
    concatenated form (gloo serves no other). Looked up at each call, so that a stand-in group (tools/bench_cp.py)
    can answer it; reduce_scatter_single is torch 2.13's name for reduce_scatter_tensor, which it deprecates."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, parts, group=group)


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole sequence from every rank's shard along `dim` (differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _gather_outside_graphs(x, dim, group)


@torch.compiler.disable
def _gather_outside_graphs(x, dim, group):
    """The CP collectives run between compiled graphs, never in one. The ranks' graphs differ (rank 0 has no
    prefix: its use of a gathered tensor is a zero term or an empty slice), and where a rank's gradient for a
    gathered tensor is a constant, AOT autograd's partitioner hoists the backward reduce-scatter into that rank's
    forward graph: `model.pattern=G parallel.cp=2 train.compile=true` hung in the first step, rank 0 in that
    reduce-scatter, rank 1 in the next forward all-gather. Eager, each collective runs where autograd reaches it,
    in the same order on every rank."""
    return _GatherSequence.apply(x, dim, group)


@torch.compiler.disable
def max_over_ranks(count: torch.Tensor, group) -> int:
    """The largest of every rank's one-element count, as an int (a host sync; outside compiled graphs as the
    gathers are)."""
    count = count.detach().clone()
    dist.all_reduce(count, dist.ReduceOp.MAX, group=group)
    return int(count)


def shard_batch(batch: dict, cp_rank: int, cp: int) -> dict:
    """This rank's contiguous part of every [B, T] tensor of a batch."""
    if cp == 1:
        return batch
    return {name: t.chunk(cp, dim=1)[cp_rank].contiguous() for name, t in batch.items()}


class ContiguousShardRotary(torch.nn.Module):
    """megatron's RotaryEmbedding for contiguous CP shards: the full table, then this rank's contiguous slice
    (megatron's own CP slicing assumes load-balanced zigzag shards)."""

    def __init__(self, rotary, cp_rank: int, cp: int):
        super().__init__()
        self.rotary, self.cp_rank, self.cp = rotary, cp_rank, cp
        rotary.cp_group = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        emb = self.rotary(max_seq_len, offset=offset, packed_seq=packed_seq)
        return emb.chunk(self.cp, dim=0)[self.cp_rank]


def prefix_states_diagonal(final_state: torch.Tensor, decay: torch.Tensor, group) -> torch.Tensor:
    """Initial state of this rank's shard from every rank's zero-start final state h_r and its shard transition
    a_r (elementwise, broadcast against h; complex allowed): s_r = sum_{j<r} (prod_{j<i<r} a_i) h_j.
    Differentiable in both (gradients flow back to the earlier ranks' summaries)."""
    return _prefix(final_state, decay, group, lambda a, s: a * s)


def prefix_states_matrix(final_state: torch.Tensor, transition: torch.Tensor, group) -> torch.Tensor:
    """As prefix_states_diagonal for a matrix transition: s_{i+1} = A_i s_i + h_i with A [..., K, K] acting on
    the state's K axis (state [..., K, V]), as the Gated DeltaNet shard summary."""
    return _prefix(final_state, transition, group, lambda a, s: a @ s)


def _prefix(final_state, transition, group, apply):
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return torch.zeros_like(final_state)
    rank = dist.get_rank(group)
    # One all-gather of both summaries. Every rank's result depends on it (rank 0 through a zero term), so every
    # rank runs its backward reduce-scatter, which the later ranks' gradients for rank 0's summary need.
    packed = gather_sequence(torch.cat([final_state.flatten(), transition.flatten()])[None], 0, group)
    states = packed[:, :final_state.numel()].reshape(size, *final_state.shape)
    transitions = packed[:, final_state.numel():].reshape(size, *transition.shape)
    s = torch.zeros_like(final_state) + 0 * packed.sum()
    for j in range(rank):
        s = apply(transitions[j], s) + states[j]
    return s


def previous_shard_tail(x: torch.Tensor, width: int, group) -> torch.Tensor:
    """The last `width` rows along dim 1 of the previous rank's x [B, S, C] (zeros on rank 0): a short conv's halo.
    Differentiable; every rank uses the gathered tensor (rank 0 through a zero term), so every rank runs the
    backward reduce-scatter."""
    tails = gather_sequence(x[:, x.shape[1] - width:], 1, group)
    rank = dist.get_rank(group)
    if rank == 0:
        return torch.zeros_like(x[:, :width]) + 0 * tails.sum()
    return tails[:, (rank - 1) * width:rank * width]


def layer_cp_group(config):
    """The CP process group a mixer layer with megatron TransformerConfig `config` exchanges over, or None at cp = 1
    (and when decoding, which the callers check)."""
    if config.context_parallel_size == 1:
        return None
    from megahybrid.distributed import context_parallel_group

    return context_parallel_group()


class _Tf32StateReadout(torch.autograd.Function):
    """o[b, t, h, v] = sum_k x[b, t, h, k] s[b, h, k, v] for 16-bit x and fp32 s on the GPU's TF32 tensor cores,
    forward and both gradients (x is exact in TF32; s rounds to 1e-3 relative, as the ops' fp32 intermediates do in
    16-bit runs). As plain fp32 products the GDN shard correction was most of the 38 ms of fp32 products in a
    32K-token shard of the 340M `G` model's step on the H200 (bench_cp --profile, c7dda94)."""

    @staticmethod
    def forward(ctx, x, s):
        B, T, H, K = x.shape
        x_NTK = x.transpose(1, 2).reshape(B * H, T, K)  # N = (b, h): one product per sequence and head
        ctx.save_for_backward(x_NTK, s)  # the backward's layout too: saved instead of x, not copied again
        return tf32_bmm(x_NTK, s.reshape(B * H, K, -1)).reshape(B, H, T, -1).transpose(1, 2)

    @staticmethod
    def backward(ctx, do):
        x_NTK, s = ctx.saved_tensors
        (B, H), (N, T, K) = s.shape[:2], x_NTK.shape
        do_NTV = do.transpose(1, 2).reshape(N, T, -1)
        dx = ds = None
        if ctx.needs_input_grad[0]:
            dx = tf32_bmm(do_NTV, s.transpose(-1, -2).reshape(N, -1, K))
            dx = dx.reshape(B, H, T, K).transpose(1, 2).to(x_NTK.dtype)
        if ctx.needs_input_grad[1]:
            ds = tf32_bmm(x_NTK.transpose(1, 2), do_NTV).reshape(s.shape)
        return dx, ds


def read_start_state(x_BTHK: torch.Tensor, s_BHKV: torch.Tensor) -> torch.Tensor:
    """sum_k x[b, t, h, k] s0[b, h, k, v] in fp32 [B, T, H, V]: what a start state s0 adds to the outputs of a
    shard whose per-token maps x were run from the identity (the GDN shard correction). TF32 for 16-bit x on a
    GPU, full fp32 otherwise."""
    if x_BTHK.is_cuda and x_BTHK.dtype != torch.float32:
        return _Tf32StateReadout.apply(x_BTHK, s_BHKV.float())
    return torch.einsum("bthk,bhkv->bthv", x_BTHK.float(), s_BHKV)
