"""S4D with a linear-contraction readout: the state of the `D` mixer and of the contraction ablation cells.

Per head h, mode m and channel d (the channels of a head are its R + d_h input features), with the same complex
lambda [H, M] and b [H, M] as the Interdomain op:

    s_t[m, d] = lambda[m] s_{t-1}[m, d] + b[m] x_t[d]          (complex state [M, D] per head)
    y_t[d]    = sum_m Re(c[m, d] s_t[m, d])                    (c: learned complex readout [M, D] per head)

The state layout is the op's: real pairs [B, H, M, 2, D] fp32. `s4d_contraction` is the training path
(any device, differentiable through autograd): the map x -> y is a causal convolution of each channel with the
kernel K[tau, d] = Re(sum_m c[m, d] b[m] lambda[m]^tau), taken by FFT. `s4d_contraction_naive` is the token loop
that defines it.
"""
import torch

from megahybrid_kernels._triton import tf32_bmm

__all__ = ["s4d_contraction", "s4d_contraction_naive", "s4d_contraction_step", "zero_start_state"]


def _complex(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] real pairs -> complex."""
    return torch.complex(pairs[..., 0].float(), pairs[..., 1].float())


def _state_complex(state: torch.Tensor) -> torch.Tensor:
    """[B, H, M, 2, D] -> complex [B, H, M, D]."""
    return torch.complex(state[..., 0, :].float(), state[..., 1, :].float())


def _state_pairs(z: torch.Tensor) -> torch.Tensor:
    return torch.stack((z.real, z.imag), -2)


def check_s4d_inputs(x, decay, b, c, initial_state):
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, D]; got {tuple(x.shape)}")
    B, T, H, D = x.shape
    M = decay.shape[1] if decay.dim() == 3 else -1
    if decay.shape != (H, M, 2) or b.shape != (H, M, 2):
        raise ValueError(f"decay and b must be [H={H}, M, 2]; got {tuple(decay.shape)} and {tuple(b.shape)}")
    if c.shape != (H, M, D, 2):
        raise ValueError(f"c must be [H={H}, M={M}, D={D}, 2]; got {tuple(c.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, M, 2, D):
        raise ValueError(f"initial_state must be [B, H, M, 2, D] = {(B, H, M, 2, D)}; got "
                         f"{tuple(initial_state.shape)}")


def s4d_contraction_naive(x, decay, b, c, initial_state=None, output_final_state=False):
    """The defining token loop in complex64. x [B, T, H, D]; decay, b [H, M, 2]; c [H, M, D, 2];
    initial_state [B, H, M, 2, D] fp32. Returns y [B, T, H, D] in x's dtype and the final state (or None)."""
    check_s4d_inputs(x, decay, b, c, initial_state)
    B, T, H, D = x.shape
    lam = torch.exp(_complex(decay))[None, :, :, None]
    bc = _complex(b)[None, :, :, None]
    cc = _complex(c)[None]
    s = (_state_complex(initial_state) if initial_state is not None
         else torch.zeros(B, H, decay.shape[1], D, dtype=torch.complex64, device=x.device))
    ys = []
    for t in range(T):
        s = lam * s + bc * x[:, t, :, None, :].float()
        ys.append((cc * s).real.sum(2))
    y = torch.stack(ys, 1).to(x.dtype)
    return y, (_state_pairs(s) if output_final_state else None)


def s4d_contraction_step(x, decay, b, c, state):
    """One decoding token. x [B, H, D]; state [B, H, M, 2, D] fp32 (not modified). Returns y [B, H, D] in x's
    dtype and the new state. Fixed shapes and no host syncs, so it can be captured in a CUDA graph."""
    lam = torch.exp(_complex(decay))[None, :, :, None]
    s = lam * _state_complex(state) + _complex(b)[None, :, :, None] * x[:, :, None, :].float()
    y = (_complex(c)[None] * s).real.sum(2)
    return y.to(x.dtype), _state_pairs(s)


def _powers(decay: torch.Tensor, n: int, reverse: bool = False) -> torch.Tensor:
    """lambda^tau for tau = 0..n-1 (reverse: n-1..0) as complex64 [n, H, M]."""
    tau = torch.arange(n, device=decay.device, dtype=torch.float64)
    return _lambda_to(decay, n - 1 - tau if reverse else tau)


def _lambda_to(decay: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """lambda^tau for float64 exponents tau [n] as complex64 [n, H, M], formed in float64: at tau in the thousands
    a float32 tau * arg(lambda) would already be off by ~1e-3 rad."""
    log_lam = torch.complex(decay[..., 0].double(), decay[..., 1].double())
    return torch.exp(tau[:, None, None] * log_lam).to(torch.complex64)


class _Tf32Sum(torch.autograd.Function):
    """s[b, h, k, d] = sum_t w[t, h, k] x[b, t, h, d] for fp32 w and 16-bit x on the GPU's TF32 tensor cores,
    forward and both gradients (x is exact in TF32; w rounds to 1e-3 relative, the precision the ops' fp32
    intermediates take in 16-bit runs). As plain fp32 products (cuBLAS's non-tensor-core kernels) the CP shard
    summary of the 350M `I` model took 50 ms of its 423 ms step at a 32K shard on the H200 (bench_cp --profile)."""

    @staticmethod
    def forward(ctx, w, x):
        B, T, H, D = ctx.x_shape = x.shape
        x_HTN = x.permute(2, 1, 0, 3).reshape(H, T, B * D)  # N = (b, d): one product per head
        ctx.save_for_backward(w, x_HTN)  # the backward's layout too: saved instead of x, not copied again
        return tf32_bmm(w.permute(1, 2, 0), x_HTN).reshape(H, -1, B, D).permute(2, 0, 1, 3)

    @staticmethod
    def backward(ctx, ds):
        w, x_HTN = ctx.saved_tensors
        B, T, H, D = ctx.x_shape
        dw = dx = None
        if ctx.needs_input_grad[0]:
            dw = tf32_bmm(x_HTN, ds.permute(1, 0, 3, 2).reshape(H, B * D, -1)).permute(1, 0, 2)
        if ctx.needs_input_grad[1]:
            dx_HTN = tf32_bmm(w.permute(1, 0, 2), ds.permute(1, 2, 0, 3).reshape(H, -1, B * D))
            dx = dx_HTN.reshape(H, T, B, D).permute(2, 1, 0, 3).to(x_HTN.dtype)
        return dw, dx


def _stack(z: torch.Tensor, dim: int) -> torch.Tensor:
    """complex -> (re, im) stacked along `dim` (real products of complex operands: re(a b) = a_re b_re - a_im b_im
    is one real product of (a_re, a_im) with (b_re, -b_im))."""
    return torch.cat((z.real, z.imag), dim)


def zero_start_state(x, decay, b, powers=None) -> torch.Tensor:
    """The state after x [B, T, H, D] from a zero start, s = sum_s b lambda^(T-1-s) x_s, as complex [B, H, M, D]:
    one real product per head (also a CP shard's summary). powers: lambda^tau for tau < T if already formed.
    Without them, T a multiple of SUMMARY_BLOCK above one block takes the blocked form (_blocked_zero_start_state)."""
    T = x.shape[1]
    if powers is None and T % SUMMARY_BLOCK == 0 and T > SUMMARY_BLOCK:
        return _blocked_zero_start_state(x, decay, b)
    reversed_powers = _powers(decay, T, reverse=True) if powers is None else powers[:T].flip(0)
    weights = _stack(reversed_powers * _complex(b), -1)  # b lambda^(T-1-s) as (re, im) [T, H, 2M]
    return _pairs_complex(_weighted_sum(weights, x))


SUMMARY_BLOCK = 64


def _blocked_zero_start_state(x, decay, b) -> torch.Tensor:
    """zero_start_state in two levels: for s = C c + j (C = SUMMARY_BLOCK), lambda^(T-1-s) =
    lambda^(C (n-1-c)) lambda^(C-1-j). The blocks are summed with the [n, H, M] table of block powers (one real
    product per head, the offsets j kept apart), then the offsets with b lambda^(C-1-j) [C, H, M]. No [T, H, M]
    tensor is formed: the direct form's powers (a float64 complex exp over T x H x M) and their backward are the
    exp, conj and complex-reduction kernels, 19 ms, of a 350M `I` CP rank's step at a 32K shard on the H200 that
    the same shard without CP does not run (tools/results/bench_cp.md, eager, c7dda94)."""
    B, T, H, D = x.shape
    C, n = SUMMARY_BLOCK, T // SUMMARY_BLOCK
    blocks = _lambda_to(decay, C * torch.arange(n - 1, -1, -1, dtype=torch.float64, device=decay.device))
    by_offset = x.reshape(B, n, C, H, D).transpose(1, 2).reshape(B * C, n, H, D)  # offsets j as batch rows
    y = _weighted_sum(_stack(blocks, -1), by_offset).reshape(B, C, H, 2, -1, D)  # [B, C, H, (re, im), M, D]
    offsets = _powers(decay, C, reverse=True) * _complex(b)  # b lambda^(C-1-j) [C, H, M]
    re, im = offsets.real, offsets.imag
    sum_j = lambda w, z: torch.einsum("jhm,bjhmd->bhmd", w, z)  # noqa: E731
    y_re, y_im = y[:, :, :, 0], y[:, :, :, 1]
    return torch.complex(sum_j(re, y_re) - sum_j(im, y_im), sum_j(re, y_im) + sum_j(im, y_re))


def _weighted_sum(w, x) -> torch.Tensor:
    """sum_t w[t, h, k] x[b, t, h, d] -> [B, H, K, D] fp32 (on the TF32 tensor cores for 16-bit x on a GPU)."""
    if x.is_cuda and x.dtype != torch.float32:
        return _Tf32Sum.apply(w, x)
    return torch.einsum("thk,bthd->bhkd", w, x.float())


def _pairs_complex(s: torch.Tensor) -> torch.Tensor:
    """[B, H, 2M, D] with (re, im) halves along dim 2 -> complex [B, H, M, D]."""
    M = s.shape[2] // 2
    return torch.complex(s[:, :, :M], s[:, :, M:])


def s4d_contraction(x, decay, b, c, initial_state=None, output_final_state=False):
    """S4D contraction by FFT convolution (same arguments and results as `s4d_contraction_naive`).

    Each channel's output is the causal convolution of its input with K[tau, h, d] = Re(sum_m c b lambda^tau), the
    S4D kernel, taken by FFT in O(T log T) (how S4D trains); an initial state adds Re(sum_m c lambda^(t+1) s0), and
    the final state is lambda^T s0 + sum_s b lambda^(T-1-s) x_s. The kernel, the initial-state term and the final
    state are each one real matrix product per head (cuBLAS's complex kernels are several times slower)."""
    check_s4d_inputs(x, decay, b, c, initial_state)
    B, T, H, D = x.shape
    powers = _powers(decay, T + 1)  # [T + 1, H, M]
    bc, cc = _complex(b), _complex(c)  # [H, M], [H, M, D]
    cb = cc * bc[..., None]
    kernel = torch.einsum("thk,hkd->thd", _stack(powers[:T], -1), _stack(cb.conj(), 1))  # [T, H, D]
    n = 1 << (2 * T - 1).bit_length()  # no wrap-around of the causal product
    xf = x.float()
    spectrum = torch.fft.rfft(xf, n=n, dim=1) * torch.fft.rfft(kernel, n=n, dim=0)
    y = torch.fft.irfft(spectrum, n=n, dim=1)[:, :T]
    s0 = _state_complex(initial_state) if initial_state is not None else None
    if s0 is not None:  # Re(sum_m c lambda^(t+1) s0)
        y = y + torch.einsum("thk,bhkd->bthd", _stack(powers[1:], -1), _stack((cc * s0).conj(), 2))
    y = y.to(x.dtype)
    if not output_final_state:
        return y, None
    s = zero_start_state(xf, decay, b, powers)
    if s0 is not None:
        s = s + powers[T][None, :, :, None] * s0
    return y, _state_pairs(s)
