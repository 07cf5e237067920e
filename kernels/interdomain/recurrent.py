"""Token-by-token Interdomain Attention for decoding."""
import torch


def interdomain_step(q, k, v, decay, b, state):
    """One decoding token; stands for T = 1 of the chunk op with the state carried.

    Args:
        q, k: [B, H, K]; v: [B, H, V]; decay, b: [H, M, 2] fp32.
        state: (U [B, H, M, 2, K], G [B, H, M, 2, V]) fp32, optionally eta [B, H, M, 2] (normalized readout).
    Returns:
        o [B, H, V] in v's dtype and the new state tuple (new tensors; the inputs are not modified).
    """
    lam = torch.exp(torch.complex(decay[..., 0], decay[..., 1]))[None, :, :, None]
    bc = torch.complex(b[..., 0], b[..., 1])[None, :, :, None]
    u = lam * torch.complex(state[0][..., 0, :], state[0][..., 1, :]) + bc * k.float()[:, :, None, :]
    g = lam * torch.complex(state[1][..., 0, :], state[1][..., 1, :]) + bc * v.float()[:, :, None, :]
    a = (q.float()[:, :, None, :] * u).sum(-1, keepdim=True)
    o = (a.real * g.real + a.imag * g.imag).sum(2)
    new = (torch.stack((u.real, u.imag), -2), torch.stack((g.real, g.imag), -2))
    if len(state) == 3:
        from .naive import EPS, sign_nonzero

        eta = lam[..., 0] * torch.complex(state[2][..., 0], state[2][..., 1]) + bc[..., 0]
        den = (a[..., 0].real * eta.real + a[..., 0].imag * eta.imag).sum(2, keepdim=True)
        o = o / (den + EPS * sign_nonzero(den))
        new = new + (torch.stack((eta.real, eta.imag), -1),)
    return o.to(v.dtype), new


def interdomain_recurrent(q, k, v, decay, b, initial_state):
    """Short prompts: the step applied along T. q, k [B, T, H, K], v [B, T, H, V]; returns o [B, T, H, V], state."""
    state, outs = initial_state, []
    for t in range(q.shape[1]):
        o, state = interdomain_step(q[:, t], k[:, t], v[:, t], decay, b, state)
        outs.append(o)
    return torch.stack(outs, 1), state
