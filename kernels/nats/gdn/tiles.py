"""Shared pieces of the chunk-selected GDN kernels: the chunk length, autotuning, masked tile loads and stores, the
per-chunk selection scalars, and the chunk-parallel kernels' tile widths."""
import torch
import triton
import triton.language as tl

from megahybrid_kernels._triton import interpreting, next_pow2

BT = 64


def _tuned(key, configs):
    """Autotune (num_warps, num_stages) on a GPU; the interpreter runs the kernel untuned (it ignores both, and the
    autotuner times configs with CUDA events). Decided at decoration, as triton.jit itself decides there whether a
    kernel is interpreted (TRITON_INTERPRET at import): choosing per launch would gain nothing.

    Configs that exceed shared memory (fp32 inputs at high num_stages) are dropped by the autotuner. The choices are
    kept in Triton's cache directory (cache_results), which the trainer puts under the run directory
    (train.compile_cache): a resumed run does not time the configs again.
    """
    def wrap(fn):
        if interpreting():
            return fn
        configs_ = [triton.Config({}, num_warps=w, num_stages=s) for w, s in configs]
        return triton.autotune(configs_, key=key, cache_results=True)(fn)
    return wrap


@triton.jit
def _ld(ptr, r, c, nr, nc, stride):
    """Tile x[i, j] = ptr[r[i] * stride + c[j]], zero where r >= nr or c >= nc."""
    return tl.load(ptr + r[:, None] * stride + c[None, :], mask=(r < nr)[:, None] & (c < nc)[None, :], other=0.0)


@triton.jit
def _ld_t(ptr, r, c, nr, nc, stride):
    """Transposed tile x[j, i] = ptr[r[i] * stride + c[j]] (a strided load instead of tl.trans)."""
    return tl.load(ptr + r[None, :] * stride + c[:, None], mask=(r < nr)[None, :] & (c < nc)[:, None], other=0.0)


@triton.jit
def _st(ptr, r, c, nr, nc, stride, x):
    tl.store(ptr + r[:, None] * stride + c[None, :], x.to(ptr.dtype.element_ty),
             mask=(r < nr)[:, None] & (c < nc)[None, :])


@triton.jit
def _ld_vec(ptr, r, nr, stride):
    return tl.load(ptr + r * stride, mask=r < nr, other=0.0).to(tl.float32)


@triton.jit
def _chunk_scalars(G, keep, t0, T, i_keep, stride_g, DECAY_DROPPED: tl.constexpr):
    """(m, G_L, a) of one chunk: keep flag, total log decay and the state's multiplier after the commit.
    Callers form e^{G_L - G_t} in one exp: e^{G_L} * e^{-G_t} overflows (inf * 0 = NaN) once a chunk's decay
    passes e^-88, which the layer's gates (A up to 16) reach."""
    m = tl.load(keep + i_keep).to(tl.float32)
    g_last = tl.load(G + (tl.minimum(t0 + 64, T) - 1) * stride_g)
    decay = tl.exp(g_last)
    base = decay if DECAY_DROPPED else 1.0
    return m, g_last, m * decay + (1.0 - m) * base


def _chunk_bk(K: int, device: torch.device) -> int:
    """K tile of the chunk-parallel kernels: up to 64 wide, the loops cover larger K. On the GPU always 64: the
    tiny model's K = 32 (32-wide tiles) faulted with an illegal address on the H200 (Triton 3.6 sm_90, as the
    narrow state tile of _state_bk); columns >= K are masked to zero."""
    return 64 if device.type == "cuda" else min(64, next_pow2(K))


def _loop_bv(V: int, dtype: torch.dtype) -> int:
    """V tile of the chunk-parallel kernels: 64 for 16-bit inputs, 32 for fp32 (bounds the pipelined tiles)."""
    return min(64 if dtype.itemsize == 2 else 32, next_pow2(V))
