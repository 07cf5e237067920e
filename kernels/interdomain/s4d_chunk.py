"""S4D contraction in chunks: the `D` mixer's state without the FFT (same definition as s4d.py's token loop).

For token t = n L + i (chunk n of L tokens, position i), with xb[n] the state before chunk n:

    S_t = lambda^(i+1) xb[n] + sum_{j <= i} lambda^(i-j) b x_{nL+j}
    y_t = sum_m Re(c S_t) = Re(sum_m lambda^(i+1) c xb[n])  +  sum_{j <= i} K[i-j] x_{nL+j}
          (inter: one real product per head)                   (intra: per channel, K[tau] = Re(sum_m c b lambda^tau))
    xb[n+1] = lambda^L xb[n] + u[n],   u[n] = sum_j b lambda^(L-1-j) x_{nL+j}   (one real product per head)

Everything but the chunk-to-chunk recurrence is a dense product (tensor cores) with autograd's own gradients; the
recurrence is the custom op `s4d_carry` (Triton on the GPU, a torch loop on the CPU) whose backward is the same
walk in reverse with conj(lambda^L), plus the gradient of lambda^L. Against the FFT (s4d.py), nothing depends on
the sequence beyond a chunk: work and memory are linear in T, and powers are needed only up to L.

Names (kernel): u [H, 2, M, B, N, D] the chunks' own end states (re plane, im plane; head-major); xb the states
before each chunk, same layout (u's dtype); x0 / last [B, H, 2, M, D] fp32; part [B, H, ND, 2, 2, M] the reverse walk's
per-tile sums of conj(xb[n]) g[n] (for lambda^L, then for lambda^REST; re, im); L the chunk length, REST the last
chunk's; xr, xi the running state tile [BM, BD]; fr, fi / lr, li lambda^L / lambda^REST (conjugated in reverse).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megahybrid_kernels._triton import absent, interpreting, next_pow2, present

from .s4d import _complex, _powers, _stack, check_s4d_inputs
from .utils import cmul

__all__ = ["s4d_contraction_chunked", "s4d_carry"]

CARRY_TILE = (32, 64)  # (modes, features) per program: a [32, 64] fp32 pair of tiles fits the registers


@triton.jit
def _carry_step(n, xr, xi, ar, ai, rr, ri, u_ptr, s_ptr, xb_ptr, fr, fi, lr, li, N, D, plane, st, mmd,
                REV: tl.constexpr):
    p = st + n * D
    tl.store(xb_ptr + p, xr.to(xb_ptr.dtype.element_ty), mask=mmd)
    tl.store(xb_ptr + p + plane, xi.to(xb_ptr.dtype.element_ty), mask=mmd)
    last = n == N - 1
    if REV:  # conj(xb[n]) g[n], summed over this tile's features, for lambda^REST on the last chunk
        sr = tl.load(s_ptr + p, mask=mmd, other=0.0).to(tl.float32)
        si = tl.load(s_ptr + p + plane, mask=mmd, other=0.0).to(tl.float32)
        gr, gi = tl.sum(sr * xr + si * xi, 1), tl.sum(sr * xi - si * xr, 1)
        ar, ai = ar + tl.where(last, 0.0, gr), ai + tl.where(last, 0.0, gi)
        rr, ri = rr + tl.where(last, gr, 0.0), ri + tl.where(last, gi, 0.0)
    pr = tl.where(last, lr, fr).to(tl.float32)[:, None]
    pi = tl.where(last, li, fi).to(tl.float32)[:, None]
    xr, xi = cmul(pr, pi, xr, xi)
    xr += tl.load(u_ptr + p, mask=mmd, other=0.0).to(tl.float32)
    xi += tl.load(u_ptr + p + plane, mask=mmd, other=0.0).to(tl.float32)
    return xr, xi, ar, ai, rr, ri


@triton.jit
def _carry_kernel(u_ptr, s_ptr, x0_ptr, xb_ptr, last_ptr, part_ptr, decay_ptr, B, N, H, M, D, L, REST,
                  BM: tl.constexpr, BD: tl.constexpr, HAS_INIT: tl.constexpr, REV: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Forward: xb[n] = the state before chunk n from x0, then x = lambda^L x + u[n] (lambda^REST on the last);
    `last` = the state after it. REV: the adjoint from x0 = d(last) back to the first chunk with conj(lambda), u the
    gradient of xb; xb receives the gradient of u, last that of x0, part the sums for the gradient of lambda^L."""
    i_bh, i_d, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    om, od = i_m * BM + tl.arange(0, BM), i_d * BD + tl.arange(0, BD)
    mm, md = om < M, od < D
    mmd = mm[:, None] & md[None, :]
    st = om[:, None] * D + od[None, :]  # the [B, H, 2, M, D] start and last states
    plane = M * (B * N * D)  # u, xb: [H, 2, M, B, N, D]
    sc = (i_h * 2 * M + om[:, None]) * (B * N * D) + i_b * N * D + od[None, :]
    al = tl.load(decay_ptr + (i_h * M + om) * 2, mask=mm, other=0.0).to(tl.float64)
    th = tl.load(decay_ptr + (i_h * M + om) * 2 + 1, mask=mm, other=0.0).to(tl.float64)
    if REV:
        th = -th
    fr, fi = tl.exp(L * al) * tl.cos(L * th), tl.exp(L * al) * tl.sin(L * th)
    lr, li = tl.exp(REST * al) * tl.cos(REST * th), tl.exp(REST * al) * tl.sin(REST * th)
    xr = tl.zeros([BM, BD], dtype=tl.float32)
    xi = tl.zeros([BM, BD], dtype=tl.float32)
    if HAS_INIT:
        xr = tl.load(x0_ptr + i_bh * 2 * M * D + st, mask=mmd, other=0.0)
        xi = tl.load(x0_ptr + i_bh * 2 * M * D + M * D + st, mask=mmd, other=0.0)
    ar = tl.zeros([BM], dtype=tl.float32)
    ai, rr, ri = ar, ar, ar
    j = 0
    # the interpreter (numpy >= 2.4) cannot take a runtime range() bound
    if INTERPRET:
        while j < N:
            n = N - 1 - j if REV else j
            xr, xi, ar, ai, rr, ri = _carry_step(n=n, xr=xr, xi=xi, ar=ar, ai=ai, rr=rr, ri=ri, u_ptr=u_ptr,
                                                 s_ptr=s_ptr, xb_ptr=xb_ptr, fr=fr, fi=fi, lr=lr, li=li, N=N, D=D,
                                                 plane=plane, st=sc, mmd=mmd, REV=REV)
            j += 1
    else:
        for j in range(N):
            n = N - 1 - j if REV else j
            xr, xi, ar, ai, rr, ri = _carry_step(n=n, xr=xr, xi=xi, ar=ar, ai=ai, rr=rr, ri=ri, u_ptr=u_ptr,
                                                 s_ptr=s_ptr, xb_ptr=xb_ptr, fr=fr, fi=fi, lr=lr, li=li, N=N, D=D,
                                                 plane=plane, st=sc, mmd=mmd, REV=REV)
    tl.store(last_ptr + i_bh * 2 * M * D + st, xr, mask=mmd)
    tl.store(last_ptr + i_bh * 2 * M * D + M * D + st, xi, mask=mmd)
    if REV:
        pp = part_ptr + (i_bh * tl.num_programs(1) + i_d) * 4 * M + om
        tl.store(pp, ar, mask=mm)
        tl.store(pp + M, ai, mask=mm)
        tl.store(pp + 2 * M, rr, mask=mm)
        tl.store(pp + 3 * M, ri, mask=mm)


def _carry_triton(u, s, x0, decay, L, rest, rev):
    """One walk of _carry_kernel: (xb or du, last or dx0, part or None)."""
    H, _, M, B, N, D = u.shape
    BM, BD = min(next_pow2(M), CARRY_TILE[0]), min(next_pow2(D), CARRY_TILE[1])
    grid = (B * H, triton.cdiv(D, BD), triton.cdiv(M, BM))
    xb = torch.empty_like(u)
    last = u.new_empty(B, H, 2, M, D, dtype=torch.float32)
    part = u.new_empty(B, H, grid[1], 2, 2, M, dtype=torch.float32) if rev else None
    _carry_kernel[grid](u_ptr=u, s_ptr=s if rev else u, x0_ptr=x0 if x0 is not None else u, xb_ptr=xb,
                        last_ptr=last, part_ptr=part if rev else last, decay_ptr=decay, B=B, N=N, H=H, M=M, D=D, L=L,
                        REST=rest, BM=BM, BD=BD, HAS_INIT=x0 is not None, REV=rev, INTERPRET=interpreting())
    return xb, last, part


def _pairs(z: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.stack((z.real, z.imag), dim)


def _carry_torch(u, s, x0, decay, L, rest, rev):
    """_carry_kernel's walk as a torch loop over chunks (CPU tensors), in complex64."""
    H, _, M, B, N, D = u.shape
    lam = torch.exp(_complex(decay).to(torch.complex128) * torch.tensor([[[L]], [[rest]]], dtype=torch.float64))
    lam = (lam.conj() if rev else lam).to(torch.complex64)[:, None, :, :, None]  # [2, 1, H, M, 1]
    zs = torch.complex(u[:, 0].float(), u[:, 1].float()).permute(2, 3, 0, 1, 4)  # [B, N, H, M, D]
    x = (torch.complex(x0[:, :, 0], x0[:, :, 1]) if x0 is not None
         else torch.zeros(B, H, M, D, dtype=torch.complex64, device=u.device))
    out = torch.empty_like(zs)
    part = torch.zeros(2, B, H, M, dtype=torch.complex64, device=u.device)
    for n in (range(N - 1, -1, -1) if rev else range(N)):
        out[:, n] = x
        last = int(n == N - 1)
        if rev:
            sn = s[:, :, :, :, n].permute(3, 0, 1, 2, 4)  # [B, H, 2, M, D]
            part[last] += (torch.complex(sn[:, :, 0].float(), sn[:, :, 1].float()).conj() * x).sum(-1)
        x = lam[last] * x + zs[:, n]
    parts = _pairs(part.permute(1, 2, 0, 3), 3)[:, :, None] if rev else None  # [B, H, 1, 2, 2, M]
    return _pairs(out, 3).permute(2, 3, 4, 0, 1, 5).contiguous().to(u.dtype), _pairs(x, 2), parts


def _walk(u, s, x0, decay, L, rest, rev):
    run = _carry_torch if u.device.type == "cpu" and not interpreting() else _carry_triton
    return run(u.contiguous(), s, x0, decay.contiguous(), L, rest, rev)


@torch.library.custom_op("megahybrid::s4d_carry", mutates_args=())
def s4d_carry(u: torch.Tensor, decay: torch.Tensor, x0: torch.Tensor | None, L: int, rest: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk-to-chunk recurrence: u [H, 2, M, B, N, D] (each chunk's end state from zero; head-major, the layout
    of the per-head products that make and read it), decay [H, M, 2], x0 [B, H, 2, M, D] fp32 or None ->
    (xb [H, 2, M, B, N, D] in u's dtype: the state before each chunk, last [B, H, 2, M, D] fp32: the state after
    the last chunk, which is REST = rest tokens long)."""
    xb, last, _ = _walk(u, None, x0, decay, L, rest, False)
    return xb, last


@s4d_carry.register_fake
def _(u, decay, x0, L, rest):
    H, _, M, B, N, D = u.shape
    return u.new_empty(u.shape), u.new_empty(B, H, 2, M, D, dtype=torch.float32)


@torch.library.custom_op("megahybrid::s4d_carry_bwd", mutates_args=())
def s4d_carry_bwd(dxb: torch.Tensor, xb: torch.Tensor, decay: torch.Tensor, dlast: torch.Tensor | None, L: int,
                  rest: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(du, ddecay, dx0) from the gradients of xb and last: the reverse walk, then lambda^L's and lambda^REST's
    gradients chained to decay (d lambda^n / d log lambda = n lambda^n)."""
    du, dx0, part = _walk(dxb, xb, present(dlast), decay, L, rest, True)
    g = part.sum((0, 2))  # [H, 2 (lambda^L, lambda^REST), 2 (re, im), M]
    steps = torch.tensor([L, rest], dtype=torch.float64, device=decay.device)[:, None, None]
    lam = torch.exp(_complex(decay).to(torch.complex128)[None] * steps)  # [2, H, M]
    dlog = (torch.complex(g[:, :, 0].double(), g[:, :, 1].double()).transpose(0, 1) * (steps * lam).conj()).sum(0)
    return du, torch.stack((dlog.real, dlog.imag), -1).float(), dx0


@s4d_carry_bwd.register_fake
def _(dxb, xb, decay, dlast, L, rest):
    H, _, M, B, N, D = dxb.shape
    return dxb.new_empty(dxb.shape), decay.new_empty(decay.shape), dxb.new_empty(B, H, 2, M, D, dtype=torch.float32)


def _carry_setup(ctx, inputs, output):
    u, decay, x0, L, rest = inputs
    ctx.save_for_backward(output[0], decay)
    ctx.L, ctx.rest, ctx.has_x0 = L, rest, x0 is not None


def _carry_backward(ctx, dxb, dlast):
    xb, decay = ctx.saved_tensors
    dxb = dxb if dxb is not None else torch.zeros_like(xb)
    dlast = dlast.contiguous().float() if dlast is not None else absent(xb)
    du, ddecay, dx0 = s4d_carry_bwd(dxb.contiguous(), xb, decay, dlast, ctx.L, ctx.rest)
    return du, ddecay, dx0 if ctx.has_x0 else None, None, None


s4d_carry.register_autograd(_carry_backward, setup_context=_carry_setup)


def _toeplitz(kernel: torch.Tensor) -> torch.Tensor:
    """[L, H, D] kernel -> [L, L, H, D] lower-triangular Toeplitz matrices, entry (i, j) = kernel[i - j]."""
    L = kernel.shape[0]
    lag = torch.arange(L, device=kernel.device)
    lag = lag[:, None] - lag[None, :]
    return kernel[lag.clamp(min=0)] * (lag >= 0)[..., None, None]


def _tail_weights(pw: torch.Tensor, bc: torch.Tensor, rest: int) -> torch.Tensor:
    """b lambda^(rest-1-j) for j < rest, zero past it: the last chunk's weights into the final state [L, H, 2M]."""
    L = pw.shape[0] - 1
    w = pw[:rest].flip(0) * bc
    return F.pad(_stack(w, -1), (0, 0, 0, 0, 0, L - rest))


def _intra(xp, pw, bc, cc):
    """Each chunk's own part, sum_{j <= i} K[i - j] x_j with K[tau] = Re(sum_m c b lambda^tau): per-channel
    Toeplitz products, [B, N, L, H, D] in x's dtype."""
    L = xp.shape[2]
    kernel = torch.einsum("thk,hkd->thd", _stack(pw[:L], -1), _stack((cc * bc[..., None]).conj(), 1))
    return torch.einsum("ijhd,bnjhd->bnihd", _toeplitz(kernel).to(xp.dtype), xp)


def _chunk_ends(xp, pw, bc, rest):
    """u[n] = sum_j b lambda^(L-1-j) x_{nL+j} (the last chunk: rest tokens), head-major [H, 2, M, B, N, D]: the
    natural output of this per-head product and the operand layout of _inter's, so neither needs a transposed copy."""
    B, N, L, H, D = xp.shape
    dt = xp.dtype
    u = torch.einsum("jhk,bnjhd->hkbnd", _stack(pw[:L].flip(0) * bc, -1).to(dt), xp)
    if rest < L:
        u_last = torch.einsum("jhk,bjhd->hkbd", _tail_weights(pw, bc, rest).to(dt), xp[:, -1])
        u = torch.cat((u[:, :, :, :-1], u_last[:, :, :, None]), 3)
    return u.reshape(H, 2, -1, B, N, D).contiguous()


def _inter(xb, pw, c):
    """What the states before each chunk add, Re(sum_m lambda^(i+1) c xb[n]): [B, N, L, H, D] in xb's dtype. c xb is
    formed in that dtype, so eager autograd keeps views of xb (which the carry keeps anyway), not fp32 copies of it
    (compiled, inductor computes it in fp32 and rounds once either way)."""
    cr, ci = (c[..., i].to(xb.dtype)[:, :, None, None] for i in (0, 1))  # [H, M, 1, 1, D]
    xr, xi = xb[:, 0], xb[:, 1]
    g = torch.cat((cr * xr - ci * xi, cr * xi + ci * xr), 1)  # (re, im) [H, 2M, B, N, D]
    readout = torch.cat((pw[1:].real, -pw[1:].imag), -1)  # Re(lambda^(i+1) g) = (re, -im) . (g_re, g_im)
    return torch.einsum("ihk,hkbnd->bnihd", readout.to(xb.dtype), g)


def s4d_contraction_chunked(x, decay, b, c, initial_state=None, output_final_state=False, chunk_size=64):
    """S4D contraction in chunks of `chunk_size` tokens (same arguments and results as s4d.s4d_contraction).
    Products run in x's dtype (16-bit x: 16-bit operands, fp32 accumulation, as the Interdomain op's kernels),
    the chunk-to-chunk recurrence in fp32."""
    check_s4d_inputs(x, decay, b, c, initial_state)
    B, T, H, D = x.shape
    L = chunk_size
    N = -(-T // L)
    rest = T - (N - 1) * L
    pw = _powers(decay, L + 1)  # lambda^tau, tau = 0..L, [L + 1, H, M]
    bc, cc = _complex(b), _complex(c)
    xp = (F.pad(x, (0, 0, 0, 0, 0, N * L - T)) if N * L > T else x).reshape(B, N, L, H, D)
    x0 = initial_state.transpose(2, 3).float().contiguous() if initial_state is not None else None
    xb, last = s4d_carry(_chunk_ends(xp, pw, bc, rest), decay.float().contiguous(), x0, L, rest)
    y = _intra(xp, pw, bc, cc).float() + _inter(xb, pw, c).float()
    y = y.reshape(B, N * L, H, D)[:, :T].to(x.dtype)
    return y, (last.transpose(2, 3).contiguous() if output_final_state else None)
