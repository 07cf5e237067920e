"""Chunked Interdomain Attention in torch ops: the op on CPU tensors, and on any tensor with a full readout C.

The same algebra as the Triton kernels (README.md, "Chunkwise algorithm"), vectorized over chunks of L tokens:
intra-chunk terms through the lag tensor b lam^(t-s) ([H, L, L, M], zero above the diagonal, only powers n >= 0 so
strong decay stays exact), inter-chunk terms from the chunk-start states, which a loop over the chunks carries by
lam^L. Complex factors are kept as stacked real [re | im] mode columns wherever they meet a real matrix, so every
large product is a real batched matmul. Autograd gives the backward.
"""
import torch

__all__ = ["interdomain_torch", "interdomain_readout"]


def interdomain_torch(q, k, v, decay, b, u0=None, g0=None, chunk_size=64, readout=None):
    """The op on checked inputs, in the Triton op's layout (chunk.py): q, k [B, T, H, K], v [B, T, H, V]; u0, g0
    [B, H, 2, M, K / V] fp32 or None; readout [H, M, M, 2] or None. Returns o [B, T, H, V] in v's dtype and the
    final U, G [B, H, 2, M, K / V] fp32."""
    T = q.shape[1]
    core = _Core(decay, b, T, min(chunk_size, T))
    qc, kc, vc = (core.chunks(x) for x in (q, k, v))
    us, uf = core.states(kc, u0)
    gs, gf = core.states(vc, g0)
    a = core.coefficients(qc, kc, us)
    if readout is not None:
        c = _complex(readout)
        a = torch.einsum("bhctn,hnk->bhctk", a, torch.einsum("hmn,hmk->hnk", c, c.conj()))
    return core.unchunk(core.read(a, vc, gs), v.dtype), _pairs(uf), _pairs(gf)


def interdomain_readout(coef, v, decay, b, readout=None, initial_state=None, output_final_state=False,
                        chunk_size=64):
    """The value side of the op alone: o_t = sum_m Re(coef_{m,t} conj(Gamma'_{m,t})) with Gamma' = C Gamma (C the
    readout, None: identity) and Gamma_t = lam Gamma_{t-1} + b v_t, for readouts whose coefficients are not q_t U'_t
    (the S4D baseline's learned contraction). coef [B, T, H, M, 2] (re, im; expand a per-head weight over B and
    T); v [B, T, H, V]; decay, b [H, M, 2] fp32; initial_state None or G [B, H, M, 2, V] fp32. Differentiable in
    every input. Returns o [B, T, H, V] in v's dtype and the final G [B, H, M, 2, V] (or None)."""
    T = v.shape[1]
    core = _Core(decay, b, T, min(chunk_size, T))
    g0 = None if initial_state is None else initial_state.transpose(2, 3)
    gs, gf = core.states(core.chunks(v), g0)
    a = _complex(core.chunks(coef.flatten(-2)).unflatten(-1, (-1, 2)))
    if readout is not None:
        a = torch.einsum("bhctm,hmn->bhctn", a, _complex(readout).conj())
    o = core.unchunk(core.read(a, core.chunks(v), gs), v.dtype)
    return o, _pairs(gf).transpose(2, 3).contiguous() if output_final_state else None


class _Core:
    """Decay tables of one call: lam^n (n = 0..L), the lag tensor, and the chunk-end weights and transitions."""

    def __init__(self, decay, b, T, L):
        self.T, self.L, self.NC = T, L, -(-T // L)
        log_lam = torch.complex(decay[..., 0].double(), decay[..., 1].double())  # [H, M]
        n = torch.arange(L + 1, dtype=torch.float64, device=decay.device)
        self.pw = torch.exp(n[None, :, None] * log_lam[:, None, :]).to(torch.complex64)  # [H, L + 1, M]
        self.b = _complex(b)
        t = torch.arange(L, device=decay.device)
        lag = self.b[:, None, None] * self.pw[:, (t[:, None] - t[None, :]).clamp(min=0)]
        self.lag2 = _stack(lag * (t[:, None] >= t[None, :])[None, :, :, None], -1)  # [H, L, L, 2M]
        # chunk c holds e_c tokens (only the last can be short): its end state weights token j by b lam^(e_c-1-j)
        ends = (T - L * torch.arange(self.NC, device=decay.device)).clamp(max=L)
        lags = ends[:, None] - 1 - t[None, :]
        self.end2 = _stack(self.b[:, None, None] * self.pw[:, lags.clamp(min=0)] * (lags >= 0)[None, :, :, None], -1)
        self.trans = self.pw[:, ends]  # [H, NC, M]

    def chunks(self, x):
        """[B, T, H, D] -> [B, H, NC, L, D] fp32, zero past T."""
        B, T, H, D = x.shape
        x = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, self.NC * self.L - T))
        return x.view(B, self.NC, self.L, H, D).permute(0, 3, 1, 2, 4)

    def unchunk(self, o, dtype):
        B, H, _, _, V = o.shape
        return o.reshape(B, H, self.NC * self.L, V)[:, :, : self.T].transpose(1, 2).to(dtype).contiguous()

    def states(self, z, x0):
        """States before each chunk [B, H, NC, M, D] and the final one [B, H, M, D] (complex) of
        X_t = lam X_{t-1} + b z_t from x0 [B, H, 2, M, D] (None: zero)."""
        delta = _unstack(torch.einsum("hcjm,bhcjd->bhcmd", self.end2, z), -2)
        x = torch.zeros_like(delta[:, :, 0]) if x0 is None else torch.complex(x0[:, :, 0], x0[:, :, 1])
        starts = []
        for c in range(self.NC):
            starts.append(x)
            x = self.trans[:, c, :, None] * x + delta[:, :, c]
        return torch.stack(starts, 2), x

    def coefficients(self, qc, kc, us):
        """a_{m,t} = q_t . U_t[m]: intra-chunk sum_s (q_t . k_s) b lam^(t-s) plus lam^(j+1) q_t . U_c."""
        intra = torch.einsum("bhcts,htsm->bhctm", qc @ kc.transpose(-1, -2), self.lag2)
        inter = _unstack(qc @ _stack(us, -2).transpose(-1, -2), -1) * self.pw[:, None, 1:]
        return _unstack(intra, -1) + inter

    def read(self, a, vc, gs):
        """o_t = sum_m Re(a_{m,t} conj(Gamma_t[m])): intra-chunk weights W[t, s] = Re sum_m a_t conj(b lam^(t-s))
        times v, plus the chunk-start Gamma_c read by a conj(lam^(j+1))."""
        w = torch.einsum("bhctm,htsm->bhcts", _stack(a, -1), self.lag2)
        inter = _stack(a * self.pw[:, None, 1:].conj(), -1) @ _stack(gs, -2)
        return w @ vc + inter


def _complex(x):
    """[..., 2] real pairs -> complex64."""
    return torch.complex(x[..., 0].float(), x[..., 1].float())


def _stack(z, dim):
    """Complex -> real with the real and imaginary parts stacked along `dim` (twice as long)."""
    return torch.cat((z.real, z.imag), dim)


def _unstack(x, dim):
    re, im = x.chunk(2, dim)
    return torch.complex(re, im)


def _pairs(z):
    """[B, H, M, D] complex -> [B, H, 2, M, D] fp32."""
    return torch.stack((z.real, z.imag), 2)
