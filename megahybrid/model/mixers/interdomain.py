"""`I` (Interdomain Attention) and `D` (S4D) mixers: the paper's scalable layer (arXiv 2605.24330, Section 3.3,
Appendix A.2) and the cells of its ablation (Appendix B.1), on the ops in kernels/interdomain.

Per head h (the heads are split over TP ranks; each per-head parameter and conv channel lives with its head):

    q, k   = x W_q, x W_k -> causal depthwise conv (kernel conv_size, own weights) -> RoPE -> xi
    xi(x)  = SiLU(x) / max(||SiLU(x)||_2, 1e-6)                       (FEATURE_EPS; the paper's Eq. 10)
    k~     = RMSNorm(xi(k)) + b_k,  v~ = RMSNorm(x W_v) + b_v         (norm scales shared by the heads, biases
                                                                        per head; nothing normalizes xi(q))
    S4D core, M complex modes per head: A = -exp(a_re) + i a_im, Delta = exp(log_dt) (one per head),
        lambda = exp(Delta A)  -> the op's decay = (Re(Delta A), Im(Delta A)); Re(Delta A) < 0 always
        B is discretized by zero-order hold: b = (lambda - 1) / A * B  (= Delta B (1 + Delta A / 2 + ...))
    readout: the op's query-conditioned readout with the full complex C_h [M, M] mixing the modes of U and
        Gamma (o = sum_m Re(xi(q) . u'_m conj(gamma'_m)), U' = C U, Gamma' = C Gamma), denominator-free
        unless the `normalized` cell; then the optional output gate SiLU(x W_g) * o and W_o.

Initialization: S4D-Inv (Re A = -1/2, Im A(n) = (M/pi)(M/(2n+1) - 1)) or S4D-Lin (Im A(n) = pi n), Delta
log-uniform in [dt_min, dt_max], B = 1, C = identity for the query readout (the layer starts as the plain op),
complex normal with variance 1/M for the contraction readout; W_o uses the residual init 0.02 / sqrt(2 L).

The cells (each its own spec function below): the input side is `DualInput` ([xi(k), v] with the query) or
`GenericInput` ([a, b]: two projections each with its own conv; RoPE on the a-half when on); the readout side is
`QueryReadout` (the op) or `ContractionReadout` (S4D's learned linear contraction y = Re(C s) of the state of
every channel, kernels/interdomain/s4d.py; the mixer then outputs R + d_h channels per head). The state per head
is 2 (R + d_h) M real numbers in every cell.

Parameters: Delta, A, B, C and the input norms' scales and biases are created fp32 (whatever params_dtype) and
tagged `lr_cap` (megahybrid.train.engine.param_groups: their own group, lr = min(lr, interdomain.ssm_lr), no
weight decay). Under DeepSpeed bf16 the engine casts every module parameter to bf16 (it keeps only buffers in
fp32), so their fp32 values live where all trained values do: ZeRO's fp32 master partitions (stage 1/2:
`single_partition_of_fp32_groups`, stage 3: `fp32_partitioned_groups_flat`); the layer reads the module copy and
computes the discretization, C and the ops' state in fp32.

Context parallelism (parallel.cp > 1, contiguous shards of S tokens, megahybrid.model.cp): each rank (1) takes
the previous rank's last conv_size - 1 inputs of every short conv as its conv tail (one all-gather of the shard
tails, `previous_shard_tail`), (2) forms its shard's zero-start final state in closed form, h = sum_t b
lambda^(S-1-t) x_t (`shard_summary`: two products over 64-token blocks, exact, instead of a zero-start run of
the core), (3) gets its true initial state from every rank's (h_r, lambda^S) by `prefix_states_diagonal`
(complex per head, mode and channel; lambda^S is data-independent), and (4) runs the core once from that state
for its outputs. We rerun rather than correct the output: the query readout is bilinear in (U, Gamma), so a
correction from the initial state is not a sum of two runs; with the closed-form summary the core runs once per
shard anyway. RoPE positions are global (offset cp_rank * S). Gradients flow back to earlier ranks through both
all-gathers. Decoding (an inference context) never uses CP.

What the module takes from TransformerLayer and ignores: attention_mask (the mixer is causal by construction),
rotary_pos_emb / rotary_pos_cos / rotary_pos_sin (it applies its own RoPE over R, which need not be the softmax
head dim; positions start at the inference offset), attention_bias; packed_seq_params must be None (documents
would leak state across boundaries; raises). inference_context holds the decode cache.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megahybrid.errors import ConfigError
from megahybrid.model.cp import layer_cp_group
from megahybrid.model.mixers import Mixer
from megahybrid.model.mixers.shortconv import causal_depthwise_conv
from megahybrid_kernels._triton import interpreting

FEATURE_EPS = 1e-6
CHUNK = 64


def _tp_size() -> int:
    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _shard(full: torch.Tensor, heads: slice) -> torch.nn.Parameter:
    """This rank's heads of a full per-head tensor (built identically on every rank), tagged as TP-sharded."""
    param = torch.nn.Parameter(full[heads].contiguous().float())
    if _tp_size() > 1:
        set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


def _ssm_param(param: torch.nn.Parameter, cap: float) -> torch.nn.Parameter:
    """Tag for megahybrid.train.engine.param_groups: learning rate capped at `cap`, no weight decay."""
    param.lr_cap = cap
    return param


def _local_heads(heads: int) -> slice:
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if heads % tp:
        raise ConfigError(f"the Interdomain mixer's {heads} heads are not divisible by parallel.tp={tp}; "
                          "change model.interdomain.head_dim or parallel.tp")
    per = heads // tp
    return slice(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class Dims:
    """Head geometry of one mixer: all heads, this rank's, and the per-head widths."""

    heads: int
    local: slice
    dh: int
    R: int
    M: int
    conv_size: int

    @property
    def n_local(self) -> int:
        return self.local.stop - self.local.start


def dims_of(cfg) -> Dims:
    opts = cfg.interdomain
    heads, dh, R = opts.heads(cfg.hidden_size, cfg.head_dim)
    return Dims(heads, _local_heads(heads), dh, R, opts.modes, opts.conv_size)


class S4DCore(torch.nn.Module):
    """Delta, A and B of every head of this rank, fp32, discretized into the ops' (decay, b)."""

    def __init__(self, dims: Dims, opts):
        super().__init__()
        H, M = dims.heads, dims.M
        n = torch.arange(M, dtype=torch.float64)
        im = (M / torch.pi) * (M / (2 * n + 1) - 1) if opts.init == "inv" else torch.pi * n
        u = torch.rand(H, dtype=torch.float64)
        log_dt = torch.log(torch.tensor(opts.dt_min, dtype=torch.float64)) * (1 - u) + u * torch.log(
            torch.tensor(opts.dt_max, dtype=torch.float64))
        cap = opts.ssm_lr
        self.log_dt = _ssm_param(_shard(log_dt, dims.local), cap)
        self.a_re = _ssm_param(_shard(torch.full((H, M), torch.log(torch.tensor(0.5)).item()), dims.local), cap)
        self.a_im = _ssm_param(_shard(im.expand(H, M), dims.local), cap)
        self.B = _ssm_param(_shard(torch.stack((torch.ones(H, M), torch.zeros(H, M)), -1), dims.local), cap)

    def discretized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """decay [H, M, 2] = (Re, Im) of Delta A and b [H, M, 2] = (lambda - 1) / A * B (zero-order hold).
        Without autograd the same tensors come back until a parameter changes: the op checks a decay tensor's
        values once (a host sync), so decode steps pass it one checked tensor and stay CUDA-graph capturable."""
        if torch.is_grad_enabled():
            return self._discretize()
        key = tuple((p.data_ptr(), p._version) for p in self.parameters())
        if getattr(self, "_memo", (None,))[0] != key:
            self._memo = (key, self._discretize())
        return self._memo[1]

    def _discretize(self) -> tuple[torch.Tensor, torch.Tensor]:
        A = torch.complex(-torch.exp(self.a_re.float()), self.a_im.float())
        dA = torch.exp(self.log_dt.float())[:, None] * A
        b = torch.expm1(dA) / A * torch.complex(self.B[..., 0].float(), self.B[..., 1].float())
        return torch.stack((dA.real, dA.imag), -1), torch.stack((b.real, b.imag), -1)

    def magnitudes(self) -> torch.Tensor:
        """|lambda| of every mode of this rank's heads."""
        return torch.exp(-torch.exp(self.log_dt.float())[:, None] * torch.exp(self.a_re.float()))


class HeadNorm(torch.nn.Module):
    """RMSNorm over one head's features, scale shared by all heads (its TP gradient is all-reduced: each rank sees
    other heads), bias per head (sharded with the heads)."""

    def __init__(self, dims: Dims, width: int, eps: float, cap: float):
        super().__init__()
        self.eps = eps
        self.weight = _ssm_param(torch.nn.Parameter(torch.ones(width)), cap)
        self.bias = _ssm_param(_shard(torch.zeros(dims.heads, width), dims.local), cap)

    def tp_weight(self) -> torch.Tensor:
        """The shared scale as this rank uses it: through the TP region copy, whose backward all-reduces."""
        return copy_to_tensor_model_parallel_region(self.weight) if _tp_size() > 1 else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.tp_weight() + self.bias


def rope(x: torch.Tensor, offset: int, base: float) -> torch.Tensor:
    """Rotate-half RoPE over the last dim of x [B, T, H, R] at positions offset, offset + 1, ..."""
    R = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, R - R % 2, 2, device=x.device, dtype=torch.float32) / R)
    pos = torch.arange(offset, offset + x.shape[1], device=x.device, dtype=torch.float32)
    ang = pos[:, None] * inv_freq[None]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    half = inv_freq.shape[0]
    x1, x2, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)
    return torch.cat((out, rest), -1)


def feature_map(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(F.silu(x.float()), dim=-1, eps=FEATURE_EPS)


class _Input(torch.nn.Module):
    """One fused ColumnParallelLinear for the segments of every head (head-major, so a TP shard is whole heads),
    then a causal conv over the leading (`convolved`) segments. Subclasses name the segments and their treatment."""

    segments: tuple[str, ...] = ()
    convolved: tuple[str, ...] = ()
    keyed: str = ""  # the key / a-half segment, which gets RoPE with q when RoPE is on
    mapped: tuple[str, ...] = ()  # segments through xi

    def __init__(self, config, cfg, dims: Dims, query: bool, use_rope: bool):
        super().__init__()
        self.names = tuple(s for s in self.segments if query or s != "q")
        widths = {"q": dims.R, "k": dims.R, "a": dims.R, "v": dims.dh, "b": dims.dh}
        self.widths = [widths[s] for s in self.names]
        self.dims, self.use_rope, self.rope_base = dims, use_rope, cfg.rope_base
        self.proj = ColumnParallelLinear(cfg.hidden_size, dims.heads * sum(self.widths), config=config,
                                         init_method=config.init_method, bias=False, gather_output=False)
        self.conv_width = sum(w for s, w in zip(self.names, self.widths) if s in self.convolved)
        k = dims.conv_size
        bound = k ** -0.5  # torch Conv1d's default for a depthwise kernel
        full = (torch.rand(dims.heads, self.conv_width, k) * 2 - 1) * bound
        self.conv = _shard(full, dims.local)
        norm_eps, cap = cfg.norm_eps, cfg.interdomain.ssm_lr
        self.norms = torch.nn.ModuleDict({s: HeadNorm(dims, widths[s], norm_eps, cap)
                                          for s in self.names if s != "q"})
        # the fused kernels serve the dual input with query: conv on q, k; RoPE and xi on both; norms on k, v
        dual = (self.names, self.convolved, self.keyed, self.mapped) == (("q", "k", "v"), ("q", "k"), "k", ("q", "k"))
        self.fused = cfg.interdomain.fused_input if dual else False  # None: on CUDA tensors only

    def forward(self, hidden: torch.Tensor, tail: torch.Tensor, offset: int, cp_group=None):
        """hidden [S(/tp with SP), B, d] -> ({segment: [B, T, H_local, width]}, new conv tail). With a CP group the
        tail is the previous shard's last conv inputs and positions start at this shard's global offset."""
        x, _ = self.proj(hidden)
        d = self.dims
        x = x.transpose(0, 1).reshape(x.shape[1], x.shape[0], d.n_local, -1)
        B, T = x.shape[:2]
        if cp_group is not None:
            from megahybrid.model.cp import previous_shard_tail

            # the conv inputs of the last conv_size - 1 tokens (all previous_shard_tail reads)
            recent = x[:, max(T - d.conv_size + 1, 0):, :, :self.conv_width].flatten(2)
            tail = previous_shard_tail(recent, d.conv_size - 1, cp_group)
            offset += torch.distributed.get_rank(cp_group) * T
        if self.fused is not False and (x.is_cuda or (self.fused is True and interpreting())):
            return self._fused(x, tail, offset)
        conv_in = x[..., :self.conv_width].reshape(B, T, -1)
        conv_out, tail = causal_depthwise_conv(conv_in, self.conv.reshape(-1, d.conv_size), tail)
        x = torch.cat((conv_out.view(B, T, d.n_local, -1), x[..., self.conv_width:]), -1)
        parts = dict(zip(self.names, x.split(self.widths, -1)))
        for s in parts:
            if self.use_rope and s in ("q", self.keyed):
                parts[s] = rope(parts[s], offset, self.rope_base)
            if s in self.mapped:
                parts[s] = feature_map(parts[s])
            if s in self.norms:
                parts[s] = self.norms[s](parts[s])
            parts[s] = parts[s].to(x.dtype)
        return parts, tail

    def _fused(self, x: torch.Tensor, tail, offset: int):
        """The fused kernels (megahybrid_kernels.interdomain_input) from x [B, T, H_local, 2R + d_h] in place of the
        conv, RoPE, xi and norm steps above; the same parts and new tail."""
        from megahybrid_kernels.interdomain_input import interdomain_input

        nk, nv = self.norms["k"], self.norms["v"]
        q, k, v, tail = interdomain_input(x, self.conv, tail, offset, self.use_rope, self.rope_base, nk.tp_weight(),
                                          nk.bias, nv.tp_weight(), nv.bias, nk.eps)
        return {"q": q, "k": k, "v": v}, tail


class DualInput(_Input):
    """The dual input [xi(k), v] (and xi(q)): conv on q and k only."""

    segments, convolved, keyed, mapped = ("q", "k", "v"), ("q", "k"), "k", ("q", "k")


class GenericInput(_Input):
    """The generic input [a, b] (and xi(q)): q, a and b each with its own conv; no feature map on a."""

    segments, convolved, keyed, mapped = ("q", "a", "b"), ("q", "a", "b"), "a", ("q",)


class QueryReadout(torch.nn.Module):
    """The op's query-conditioned readout with the full complex mode-mixing C_h [M, M] (init identity)."""

    query = True

    def __init__(self, dims: Dims, cap: float, normalize: bool = False):
        super().__init__()
        self.dims, self.normalize = dims, normalize
        eye = torch.eye(dims.M).expand(dims.heads, dims.M, dims.M)
        self.C = _ssm_param(_shard(torch.stack((eye, torch.zeros_like(eye)), -1), dims.local), cap)

    def out_width(self) -> int:
        return self.dims.dh

    def zero_state(self, batch: int, device) -> tuple[torch.Tensor, ...]:
        d = self.dims
        shapes = [(d.R,), (d.dh,)] + ([()] if self.normalize else [])
        return tuple(torch.zeros(batch, d.n_local, d.M, 2, *s, device=device) for s in shapes)

    def state_inputs(self, parts) -> tuple[torch.Tensor, ...]:
        """What each state tensor accumulates per token (U: the keys, Gamma: the values, eta: ones)."""
        k, v = parts.get("k", parts.get("a")), parts.get("v", parts.get("b"))
        return (k, v) + ((v.new_ones(*v.shape[:3], 1),) if self.normalize else ())

    def forward(self, parts, decay, b, state):
        from megahybrid_kernels.interdomain import interdomain_attention, interdomain_step

        q, k, v = parts["q"], parts.get("k", parts.get("a")), parts.get("v", parts.get("b"))
        C = self.C.float()
        if q.shape[1] == 1:
            state = state if state is not None else self.zero_state(q.shape[0], q.device)
            o, new = interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, state, readout=C)
            return o[:, None], new
        # decay's real part is -exp(log_dt) exp(a_re) < 0 by construction: the op's value check (a host sync on a
        # GPU, the tensor being new every step) has nothing to find
        return interdomain_attention(q, k, v, decay, b, state, True, self.normalize, CHUNK, readout=C,
                                     check_values=False)


class ContractionReadout(torch.nn.Module):
    """S4D's learned linear contraction y = Re(C s) over the R + d_h channels of each head (no query)."""

    query = False

    def __init__(self, dims: Dims, cap: float, contraction: str = "chunked"):
        super().__init__()
        self.dims, self.contraction = dims, contraction
        width = dims.R + dims.dh
        self.C = _ssm_param(_shard(torch.randn(dims.heads, dims.M, width, 2) * (2 * dims.M) ** -0.5, dims.local),
                            cap)

    def out_width(self) -> int:
        return self.dims.R + self.dims.dh

    def zero_state(self, batch: int, device) -> tuple[torch.Tensor, ...]:
        d = self.dims
        return (torch.zeros(batch, d.n_local, d.M, 2, d.R + d.dh, device=device),)

    def state_inputs(self, parts) -> tuple[torch.Tensor, ...]:
        return (torch.cat(list(parts.values()), -1),)

    def forward(self, parts, decay, b, state):
        from megahybrid_kernels.interdomain.s4d import s4d_contraction, s4d_contraction_step
        from megahybrid_kernels.interdomain.s4d_chunk import s4d_contraction_chunked

        x = torch.cat(list(parts.values()), -1)
        if x.shape[1] == 1:
            state = state if state is not None else self.zero_state(x.shape[0], x.device)
            y, new = s4d_contraction_step(x[:, 0], decay, b, self.C.float(), state[0])
            return y[:, None], (new,)
        contract = s4d_contraction_chunked if self.contraction == "chunked" else s4d_contraction
        y, new = contract(x, decay, b, self.C.float(), state[0] if state is not None else None, True)
        return y, (new,)


def shard_summary(inputs: torch.Tensor, decay: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The zero-start final state of a shard in closed form, h[m, d] = sum_t b[m] lambda[m]^(S-1-t) x_t[d]:
    inputs [B, S, H, D] -> complex [B, H, M, D] (real products per head over 64-token blocks, zero_start_state's
    blocked form; the core's chunked pass would cost a full run)."""
    from megahybrid_kernels.interdomain.s4d import zero_start_state

    return zero_start_state(inputs, decay, b)


def shard_initial_state(inputs: tuple[torch.Tensor, ...], decay, b, group, like) -> tuple[torch.Tensor, ...]:
    """This CP rank's true initial core state, shaped as the zero state `like` (one tensor per entry of `inputs`):
    every rank's zero-start summary and its shard transition lambda^S, combined by megahybrid.model.cp."""
    from megahybrid.model.cp import prefix_states_diagonal

    widths = [x.shape[-1] for x in inputs]
    summary = shard_summary(torch.cat(inputs, -1), decay, b)
    transition = torch.exp(inputs[0].shape[1] * torch.complex(decay[..., 0], decay[..., 1]))[..., None]
    pairs = torch.view_as_real(prefix_states_diagonal(summary, transition, group)).transpose(-1, -2)
    return tuple(p.reshape(z.shape) for p, z in zip(pairs.split(widths, -1), like))


@dataclass
class InterdomainSubmodules:
    inputs: type
    readout: type


@dataclass
class MixerState:
    """What one sequence carries between calls: the conv inputs of the last K-1 tokens and the core state.
    Decoding keeps one per layer in the inference cache (updated in place: fixed shapes for CUDA graphs); a
    context-parallel pass can hand the previous rank's final MixerState in as `initial`."""

    conv: torch.Tensor
    core: tuple[torch.Tensor, ...]

    def copy_(self, other: "MixerState") -> None:
        self.conv.copy_(other.conv)
        for mine, theirs in zip(self.core, other.core):
            mine.copy_(theirs)


class InterdomainMixer(MegatronModule):
    """One cell of the family: `submodules` picks the input and readout sides; returns (out [S, B, d], None)."""

    def __init__(self, config, layer_number: int, submodules: InterdomainSubmodules, model_cfg, normalize=False,
                 rope_default=True, **_ignored):
        super().__init__(config=config)
        opts = model_cfg.interdomain
        self.layer_number = layer_number
        self.dims = dims = dims_of(model_cfg)
        readout_kwargs = {"normalize": normalize} if normalize else {}
        if not submodules.readout.query:
            readout_kwargs["contraction"] = opts.contraction
        self.readout = submodules.readout(dims, opts.ssm_lr, **readout_kwargs)
        use_rope = rope_default if opts.rope is None else opts.rope
        self.inputs = submodules.inputs(config, model_cfg, dims, self.readout.query, use_rope)
        self.core = S4DCore(dims, opts)
        width = dims.heads * self.readout.out_width()
        self.gate = (ColumnParallelLinear(model_cfg.hidden_size, width, config=config, init_method=config.init_method,
                                          bias=False, gather_output=False) if opts.output_gate else None)
        self.out = RowParallelLinear(width, model_cfg.hidden_size, config=config,
                                     init_method=config.output_layer_init_method, bias=False,
                                     input_is_parallel=True, skip_bias_add=True)
        self._last = None

    def zero_state(self, batch: int, device) -> MixerState:
        conv = torch.zeros(batch, self.dims.conv_size - 1, self.dims.n_local * self.inputs.conv_width, device=device)
        return MixerState(conv, self.readout.zero_state(batch, device))

    def mix(self, hidden: torch.Tensor, initial: MixerState | None = None, offset: int = 0):
        """The mixer on hidden [S, B, d] continuing from `initial` (None: the sequence starts here) at position
        `offset`. Returns (out [S, B, d] before the bias-dropout-add, the final MixerState)."""
        cp_group = layer_cp_group(self.config) if initial is None else None
        # no initial state at a sequence start: the ops then skip the zero state's loads and products
        parts, tail = self.inputs(hidden, initial.conv if initial else None, offset, cp_group)
        decay, b = self.core.discretized()
        core = initial.core if initial else None
        if cp_group is not None:
            like = self.readout.zero_state(hidden.shape[1], hidden.device)
            core = shard_initial_state(self.readout.state_inputs(parts), decay, b, cp_group, like)
        o, state = self.readout(parts, decay, b, core)
        key = parts.get("k", parts.get("a")).detach()
        # small tensors only (no host sync, no activation kept); tensorboard_scalars reduces them when asked
        self._last = (tuple(s.detach() for s in state), key.float().norm(dim=-1).mean())
        B, T = o.shape[:2]
        o = o.reshape(B, T, -1).transpose(0, 1)
        if self.gate is not None:
            g, _ = self.gate(hidden)
            o = F.silu(g) * o.to(g.dtype)
        out, _ = self.out(o.to(hidden.dtype).contiguous())
        return out, MixerState(tail, tuple(state))

    def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                packed_seq_params=None, **_ignored):
        if packed_seq_params is not None:
            raise ConfigError("the Interdomain mixers do not support packed sequences; turn packing off")
        if inference_context is None:
            return self.mix(hidden_states)[0], None
        offset = inference_context.sequence_len_offset
        caches = inference_context.key_value_memory_dict
        if offset == 0 or self.layer_number not in caches:
            caches[self.layer_number] = self.zero_state(hidden_states.shape[1], hidden_states.device)
        cache = caches[self.layer_number]
        out, state = self.mix(hidden_states, cache, offset)
        cache.copy_(state)
        return out, None

    def tensorboard_scalars(self) -> dict[str, float]:
        """From the last forward, reduced only when asked (the trainer asks on logging steps), over this rank's
        heads: state_norm = mean over sequences of the final state's l2 norm; lambda_min / lambda_median of |lambda|
        (memory length ~ 1 / (1 - |lambda|) tokens); feature_norm = mean l2 norm of k~ (the a-half for [a, b])."""
        if self._last is None:
            return {}
        state, feature_norm = self._last
        mags = self.core.magnitudes().detach().flatten()
        return {
            "state_norm": float(torch.sqrt(sum(s.float().pow(2).flatten(1).sum(1) for s in state)).mean()),
            "lambda_min": float(mags.min()),
            "lambda_median": float(mags.median()),
            "feature_norm": float(feature_norm),
        }


def _spec(inputs: type, readout: type, cfg, **params) -> ModuleSpec:
    return ModuleSpec(module=InterdomainMixer, submodules=InterdomainSubmodules(inputs, readout),
                      params={"model_cfg": cfg, **params})


def full_spec(cfg) -> ModuleSpec:
    """Cell 4, `I`: dual input, query-conditioned readout, RoPE."""
    return _spec(DualInput, QueryReadout, cfg)


def normalized_spec(cfg) -> ModuleSpec:
    """Cell 5: the full layer with the op's normalized (theoretical) readout."""
    return _spec(DualInput, QueryReadout, cfg, normalize=True)


def generic_query_spec(cfg) -> ModuleSpec:
    """Cell 3: [a, b] input plus a query: q, a, b each with a conv; RoPE on q and a."""
    return _spec(GenericInput, QueryReadout, cfg)


def dual_contraction_spec(cfg) -> ModuleSpec:
    """Cell 2: dual [xi(k), v] input, linear-contraction readout, no query."""
    return _spec(DualInput, ContractionReadout, cfg)


def s4d_spec(cfg) -> ModuleSpec:
    """Cell 1, `D`: the S4D-only baseline, [a, b] input, linear contraction, RoPE off (model.interdomain.rope
    turns it on for the a-half)."""
    return _spec(GenericInput, ContractionReadout, cfg, rope_default=False)


CELLS = {"full": full_spec, "normalized": normalized_spec, "generic-query": generic_query_spec,
         "dual-contraction": dual_contraction_spec}


def interdomain_spec(cfg) -> ModuleSpec:
    """The `I` character: the cell named by model.interdomain.variant."""
    return CELLS[cfg.interdomain.variant](cfg)


def _cell_parts(cfg, s4d: bool):
    spec = s4d_spec(cfg) if s4d else interdomain_spec(cfg)
    return spec.submodules.inputs, spec.submodules.readout, spec.params.get("normalize", False)


def _conv_channels(cfg, s4d: bool) -> int:
    """Short-conv channels per head: the widths of the convolved segments."""
    inputs, readout, _ = _cell_parts(cfg, s4d)
    _, dh, R = cfg.interdomain.heads(cfg.hidden_size, cfg.head_dim)
    widths = {"q": R, "k": R, "a": R, "v": dh, "b": dh}
    return sum(widths[s] for s in inputs.segments if s in inputs.convolved and (readout.query or s != "q"))


def _cp_bytes(cfg, cp: int, element_bytes: int, s4d: bool) -> int:
    """Two all-gathers per layer, each (cp - 1) per-rank pieces forward and a reduce-scatter of the gathered
    gradient, (cp - 1) pieces, backward: the conv halo (K - 1 input rows of every conv channel, in the
    activation dtype) and the fp32 shard summary (the complex state, plus lambda^S once: an upper bound per
    sequence when a batch shares it). Independent of the sequence length."""
    H, _, _ = cfg.interdomain.heads(cfg.hidden_size, cfg.head_dim)
    halo = (cfg.interdomain.conv_size - 1) * H * _conv_channels(cfg, s4d) * element_bytes
    summary = 4 * (_state_floats(cfg, s4d) + 2 * H * cfg.interdomain.modes)
    return 2 * (cp - 1) * (halo + summary)


def _cp_flops(cfg, cp: int, s4d: bool) -> float:
    """What the state passing adds per token: the closed-form shard summary (shard_summary: one complex
    multiply-add, 8 real FLOPs, per token, mode and state column: 4 per real state float) and, on the last rank,
    cp - 1 prefix-combine steps over the state per shard. The core runs once, from the combined state."""
    if cp == 1:
        return 0.0
    state = _state_floats(cfg, s4d)
    return 4.0 * state * (1 + (cp - 1) / (cfg.seq_length // cp))


def _counts(cfg, s4d: bool) -> dict[str, int]:
    """Parameters of one layer's mixer by kind, from the same segment lists the modules are built from."""
    inputs, readout, _ = _cell_parts(cfg, s4d)
    opts = cfg.interdomain
    H, dh, R = opts.heads(cfg.hidden_size, cfg.head_dim)
    M, d = opts.modes, cfg.hidden_size
    widths = {"q": R, "k": R, "a": R, "v": dh, "b": dh}
    names = [s for s in inputs.segments if readout.query or s != "q"]
    out_width = dh if readout.query else R + dh
    c_size = M * M * 2 if readout.query else M * (R + dh) * 2
    normed = [widths[s] for s in names if s != "q"]
    return {
        "matmul": d * H * sum(widths[s] for s in names) + H * out_width * d * (2 if opts.output_gate else 1),
        "conv": H * opts.conv_size * _conv_channels(cfg, s4d),
        "ssm": H * (1 + 4 * M) + H * c_size,
        "norm": sum(normed) * (1 + H),
    }


def _flops(cfg, s4d: bool) -> float:
    """2 per matmul weight and conv tap, plus the core: the complex state update and readout of every mode and
    channel (8 real FLOPs per complex multiply-add, two passes), and the query readout's C applied per chunk."""
    _, readout, _ = _cell_parts(cfg, s4d)
    counts = _counts(cfg, s4d)
    H, dh, R = cfg.interdomain.heads(cfg.hidden_size, cfg.head_dim)
    M = cfg.interdomain.modes
    core = 2 * 8 * H * M * (R + dh)
    if readout.query:
        core += 8 * H * M * M * (R + dh) / CHUNK
    return 2.0 * (counts["matmul"] + counts["conv"]) + core


def _state_floats(cfg, s4d: bool) -> int:
    """The recurrent state of every head, 2 (R + d_h) M real numbers (plus eta's 2 M with the normalized readout);
    the K-1 conv input rows are not counted."""
    _, _, normalize = _cell_parts(cfg, s4d)
    H, dh, R = cfg.interdomain.heads(cfg.hidden_size, cfg.head_dim)
    M = cfg.interdomain.modes
    return H * (2 * (R + dh) * M + (2 * M if normalize else 0))


INTERDOMAIN = Mixer("I", "Interdomain attention", interdomain_spec, lambda cfg: sum(_counts(cfg, False).values()),
                    lambda cfg: _flops(cfg, False), lambda cfg, context: _state_floats(cfg, False),
                    chunk_size=CHUNK, cp=True, cp_bytes=lambda cfg, cp, nbytes: _cp_bytes(cfg, cp, nbytes, False),
                    cp_flops=lambda cfg, cp: _cp_flops(cfg, cp, False),
                    cache="conv tails + Interdomain state")
S4D = Mixer("D", "S4D", s4d_spec, lambda cfg: sum(_counts(cfg, True).values()), lambda cfg: _flops(cfg, True),
            lambda cfg, context: _state_floats(cfg, True), chunk_size=CHUNK, cp=True,
            cp_bytes=lambda cfg, cp, nbytes: _cp_bytes(cfg, cp, nbytes, True),
            cp_flops=lambda cfg, cp: _cp_flops(cfg, cp, True), cache="conv tails + S4D state")
# D compiled at 125M, 4K, on the H200: 180.2K tok/s with s4d_chunk.py's contraction, 150.9K with the FFT
# (tools/results/bench_train-s4d.md); an earlier chunked form ran slower compiled than eager (30.9K against 47.0K).
