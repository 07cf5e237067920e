"""Reference Interdomain Attention: a per-token fp32 loop that IS the definition (see README.md)."""
import torch

EPS = 1e-6


def interdomain_attention_naive(q, k, v, decay, b, initial_state=None, output_final_state=False,
                                normalize=False, eps=EPS, readout=None):
    """Token-by-token recurrence in complex64 (fp32 parts); differentiable through torch autograd.

    Args:
        q, k: [B, T, H, K] query / key features.
        v: [B, T, H, V] values.
        decay: [H, M, 2] = (log|lambda| <= 0, arg lambda).
        b: [H, M, 2] = (Re b, Im b).
        initial_state: (U [B, H, M, 2, K], G [B, H, M, 2, V]) plus eta [B, H, M, 2] when `normalize`.
        readout: C [H, M, M, 2] = (Re C, Im C) or None (identity): the query reads C U_t and C Gamma_t (and the
            denominator C eta_t); the state stays the unmixed U, Gamma, eta.
    Returns:
        o [B, T, H, V] in v's dtype, and the final state in the same layout (or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    M = decay.shape[1]
    lam = torch.exp(torch.complex(decay[..., 0].float(), decay[..., 1].float()))[None, :, :, None]
    bc = torch.complex(b[..., 0].float(), b[..., 1].float())[None, :, :, None]
    qf, kf, vf = q.float(), k.float(), v.float()
    if initial_state is None:
        u = torch.zeros(B, H, M, K, dtype=torch.complex64, device=q.device)
        g = torch.zeros(B, H, M, V, dtype=torch.complex64, device=q.device)
        eta = torch.zeros(B, H, M, 1, dtype=torch.complex64, device=q.device)
    else:
        u, g = _to_complex(initial_state[0]), _to_complex(initial_state[1])
        eta = _to_complex(initial_state[2][..., None]) if normalize else None
    mix = (lambda x: x) if readout is None else _mixer(readout)
    outs = []
    for t in range(T):
        u = lam * u + bc * kf[:, t, :, None, :]
        g = lam * g + bc * vf[:, t, :, None, :]
        a, gm = (qf[:, t, :, None, :] * mix(u)).sum(-1, keepdim=True), mix(g)  # a [B, H, M, 1]
        o = (a.real * gm.real + a.imag * gm.imag).sum(2)  # [B, H, V]
        if normalize:
            eta = lam * eta + bc
            em = mix(eta)
            den = (a.real * em.real + a.imag * em.imag).sum(2)  # [B, H, 1]
            o = o / (den + eps * sign_nonzero(den))
        outs.append(o)
    o = torch.stack(outs, 1).to(v.dtype)
    if not output_final_state:
        return o, None
    state = (_to_pairs(u), _to_pairs(g))
    if normalize:
        state = state + (torch.stack((eta.real[..., 0], eta.imag[..., 0]), -1),)
    return o, state


def _mixer(readout):
    """x [B, H, M, D] complex -> C x along the mode axis (C [H, M, M] complex from [H, M, M, 2] pairs)."""
    c = torch.complex(readout[..., 0].float(), readout[..., 1].float())
    return lambda x: torch.einsum("hmn,bhnd->bhmd", c, x)


def sign_nonzero(x):
    """sign(x) with sign(0) = +1, so `x + eps * sign_nonzero(x)` is never closer to 0 than eps."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def _to_complex(x):
    """[..., M, 2, D] real pairs -> [..., M, D] complex."""
    return torch.complex(x[..., 0, :].float(), x[..., 1, :].float())


def _to_pairs(z):
    """[..., M, D] complex -> [..., M, 2, D] real pairs."""
    return torch.stack((z.real, z.imag), -2)
