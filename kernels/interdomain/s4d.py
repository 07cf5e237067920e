"""S4D with a linear-contraction readout: the state of the `D` mixer and of the contraction ablation cells.

Per head h, mode m and channel d (the channels of a head are its R + d_h input features), with the same complex
lambda [H, M] and b [H, M] as the Interdomain op:

    s_t[m, d] = lambda[m] s_{t-1}[m, d] + b[m] x_t[d]          (complex state [M, D] per head)
    y_t[d]    = sum_m Re(c[m, d] s_t[m, d])                    (c: learned complex readout [M, D] per head)

The state layout is the op's: real pairs [B, H, M, 2, D] fp32. `s4d_contraction` is a torch chunked
implementation (any device, differentiable through autograd): within a chunk the map x -> y is a causal
convolution with the kernel K[tau, d] = Re(sum_m c[m, d] b[m] lambda[m]^tau) (a Toeplitz matmul), and the chunk
boundary states carry the rest. `s4d_contraction_naive` is the token loop that defines it.
"""
import torch

__all__ = ["s4d_contraction", "s4d_contraction_naive", "s4d_contraction_step"]


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


def s4d_contraction(x, decay, b, c, initial_state=None, output_final_state=False, chunk_size=64):
    """Chunked S4D contraction (same arguments and results as `s4d_contraction_naive`)."""
    check_s4d_inputs(x, decay, b, c, initial_state)
    B, T, H, D = x.shape
    L = chunk_size
    N = -(-T // L)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, N * L - T)).view(B, N, L, H, D)
    log_lam = _complex(decay)  # [H, M]
    bc, cc = _complex(b), _complex(c)
    tau = torch.arange(L + 1, device=x.device, dtype=torch.float32)
    powers = torch.exp(tau[:, None, None] * log_lam)  # lambda^tau, [L + 1, H, M]

    kernel = torch.einsum("thm,hmd->thd", powers[:L] * bc, cc).real  # [L, H, D]
    lag = torch.arange(L, device=x.device)
    lag = lag[:, None] - lag[None, :]
    toeplitz = kernel[lag.clamp(min=0)] * (lag >= 0)[..., None, None]  # [t, s, H, D]
    y = torch.einsum("tshd,bnshd->bnthd", toeplitz, xf)

    weights = powers[:L].flip(0) * bc  # b lambda^(L-1-s), [L, H, M]
    inputs = torch.complex(xf, torch.zeros_like(xf))
    contrib = torch.einsum("shm,bnshd->bnhmd", weights, inputs)  # each chunk's own state at its end
    s = (_state_complex(initial_state) if initial_state is not None
         else torch.zeros(B, H, decay.shape[1], D, dtype=torch.complex64, device=x.device))
    starts = []
    for n in range(N):
        starts.append(s)
        s = powers[L][None, :, :, None] * s + contrib[:, n]
    start = torch.stack(starts, 1)  # [B, N, H, M, D]
    carry = powers[1:, :, :, None] * cc[None]  # c lambda^(t+1), [L, H, M, D]
    y = y + torch.einsum("thmd,bnhmd->bnthd", carry, start).real
    y = y.reshape(B, N * L, H, D)[:, :T].to(x.dtype)
    if not output_final_state:
        return y, None
    rest = T - (N - 1) * L  # tokens of the last chunk that are real
    if rest < L:
        tail = torch.einsum("shm,bshd->bhmd", powers[:rest].flip(0) * bc, inputs[:, N - 1, :rest])
        s = powers[rest][None, :, :, None] * starts[-1] + tail
    return y, _state_pairs(s)
