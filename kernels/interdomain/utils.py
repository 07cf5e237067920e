"""What the Interdomain modules share: the tuning plan, the readout's P, where a call runs, and the two Triton
helpers (complex product, power-table read) that both the scans and the readout kernels use."""
import dataclasses
import hashlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megahybrid_kernels._triton import use_torch_path


PLANS: dict = {}  # every distinct InterdomainPlan made, by its plan_id


def _source_digest() -> str:
    """A digest of this package's source files."""
    here, digest = os.path.dirname(os.path.abspath(__file__)), hashlib.sha256()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


SOURCE_DIGEST = _source_digest()


def plan_key(fields: tuple, source: str = SOURCE_DIGEST) -> int:
    """A plan's key: 60 bits (an int64 argument of the custom ops) of a digest of its fields and of the op's source.
    The source is in it because inductor's on-disk cache keys a graph on the ops it calls, not on their schemas: a
    graph compiled against an earlier version of the op (one with four more outputs) was served to the new one and
    failed with a schema error, as a resumed run would after an upgrade."""
    return int(hashlib.sha256((repr(fields) + source).encode()).hexdigest()[:15], 16)


@dataclass(frozen=True)
class InterdomainPlan:
    """Tuning knobs of the chunk kernels, defaulted from what was measured on the H200 (pass another plan to
    `interdomain_attention(plan=...)` to sweep them; nothing here changes what the op computes).

    warps_*: 4 everywhere. 8 warps measured slower for the whole op (17.1 vs 14.3 ms at 8K,
    f1e3960:tools/results/interdomain-v2-2026-11-30.md) and for every kernel alone (interdomain-sweep.md: fwd 1.92
    vs 1.13 ms, bwd_a 4.77 vs 2.56, dq / dk / dv 1.14 / 1.91 / 1.91 vs 0.62 / 1.32 / 1.32); capping registers at
    128 or 168 per thread spilled more (22.4, 18.1 ms).

    hoist_const, hoist_per_token: scans with the full-chunk decay tables hoisted out of the chunk loop and the next
    chunk's features (and per-token coefficients) loaded one chunk ahead. Measured (ms per scan, M = 32, T = 2K /
    64K unsegmented): per-token reverse 0.315 / 1.437 plain, 0.260 / 0.931 hoisted; constant-b forward 0.239 /
    0.686 plain, 0.194 / 0.838 hoisted: hoisting lost only on 1024-chunk loops, which segmented scans no longer run.

    gpu_min_tile: smallest (mode, feature) tiles of the readout kernels on the GPU. Triton 3.6 on sm_90 builds the
    dq, dk and dv kernels with 32-wide feature tiles wrongly (tools/results/interdomain-tile-probe.md:
    relative RMS 1.2-4.7 against 64-wide tiles; illegal addresses in earlier builds), so features pad (masked) to 64.
    32-mode tiles run correctly in every kernel but the plain forward (relative RMS 3.6; an illegal address on Triton
    3.5.1) and save registers at M = 32: bwd_a 0.023 against 0.032 ms, dk 0.016 / 0.022, dv 0.016 / 0.022, dq
    0.013 / 0.013 in the probe; full-size numbers in kernels/interdomain/README.md.

    fwd_stack_below: the forward with a mode tile narrower than this takes its products over the modes on operands
    of 2 BM interleaved real / imaginary columns (readout.py STACK), which builds correctly at BM = 32 and ran faster
    than the plain forward padded to 64 modes (0.017 against 0.019 ms); at 64 modes the plain one is faster (0.019
    against 0.021 ms stacked). Stacked bwd_a / dq ran no faster than plain 32-mode tiles (0.025 / 0.012 ms) and the
    stacked dk / dv did not build on the GPU, so the backward has no stacked form.

    scan_segment, scan_segment_below, scan_segment_above: scans over fewer than scan_segment_below (b, h, state
    tile) rows and more than scan_segment_above chunks run in segments of scan_segment chunks (0: never). Measured
    at B*T = 64K, H = 16, D = 128, M = 32: one const / per-token reverse scan at 64K tokens per row 0.81 / 0.86 ms
    unsegmented, 0.36 / 0.47 in segments of 32 (0.20 for the backward's const scans from the forward's starts); at
    8K unsegmented with narrower tiles 0.26 / 0.37 against 0.33 / 0.45 (interdomain-scan-sweep.md). The
    whole op forward+backward, segmenting above 64 / 128 / 256 / 512 chunks: 8K 6.39 / 6.22 / 6.22 / 6.22 ms, 16K
    6.40 / 6.40 / 6.77 / 6.78, 32K 6.43 / 6.43 / 6.43 / 7.30.

    scan_tile: a scan's (mode, feature) state tile per program, before narrowing for few rows.

    readout_on_gpu: the readout kernels (_fwd_mixed_kernel, _bwd_a_mixed_kernel) passed the H200 tests against the
    fp32 reference (fp32 and bf16, forward and every gradient) except bf16 with the normalized readout, where dq was
    4.2e-2 off (tolerance 4e-2; the torch path passed): a normalized readout on the GPU takes the torch path
    (`uses_torch_path`). Off: every readout on the GPU takes the torch path.

    fused_readout: the fused recurrent kernel applies the readout (a P per token, P [M, M] complex in registers);
    off, a readout decodes on the chunk op's torch path instead.

    keep_states: the forward keeps its chunk-boundary states U, G for the backward, which then skips its two
    recomputing scans (bitwise the states it would recompute); off, it keeps only the scans' segment starts and
    rescans. The cost is memory, linear in T: 2 M (K + V) / chunk_size numbers per token and head in the inputs'
    dtype (256 at M = K = V = chunk = 64, where q, k, v hold 192). Measured on an H100 (cb126b0, the paper's
    shapes, full readout, bf16, tools/results/interdomain-keep-states.md): fwd+bwd 7.44 against 7.91 ms at 12 x 64
    and 4K, 7.83 / 8.10 at 16K, 18.8 / 19.4 and 20.3 / 20.9 at 32 x 64 (3-6 % faster; the scans 0.98 against 1.46
    ms of kernels at 12 x 64, 4K), peak memory 2.46 against 2.08 GiB at 12 x 64 (+18 %).

    mix_in_input_dtype: the readout kernels multiply the per-token a and d(a P) [C, M] by P [M, M] (the four real
    products of _mix_modes) on operands cast to the inputs' dtype, as every other product there, instead of fp32
    at tf32 (half the tensor-core rate of bf16, twice the operand bytes). No change for fp32 inputs. Measured on an
    H100 (0056fcb, the paper's shapes, full readout, bf16, tools/results/interdomain-mix-dtype.md): fwd+bwd 7.04
    against 7.46 ms at 12 x 64 and 4K, 7.42 / 7.85 at 16K, 17.7 / 18.8 and 19.2 / 20.3 at 32 x 64 (5-6 %;
    _bwd_a_mixed_kernel 2.55 against 2.99 ms, _fwd_mixed_kernel 1.21 against 1.18); the bf16 and fp32 readout tests
    on the GPU passed with it against the fp32 reference at the same tolerances (test_readout_gpu_*[kernels-lowmix]).
    """

    warps_scan: int = 4
    warps_fwd: int = 4
    warps_bwd_a: int = 4
    warps_bwd_dq: int = 4
    warps_bwd_dk: int = 4
    warps_bwd_dv: int = 4
    hoist_const: bool = True
    hoist_per_token: bool = True
    gpu_min_tile: tuple = (32, 64)
    fwd_stack_below: int = 64
    scan_segment: int = 32
    scan_segment_below: int = 512
    scan_segment_above: int = 128
    scan_tile: tuple = (32, 64)
    readout_on_gpu: bool = True
    fused_readout: bool = True
    keep_states: bool = True
    mix_in_input_dtype: bool = True

    def __post_init__(self):
        # The custom ops take a plan as an int, its key in PLANS, read here as a plain attribute so that it also
        # traces under torch.compile: torch 2.11's dynamo cannot hand a frozen dataclass to an
        # assume_constant_result function, which failed every compiled `I` layer on the H200. The key is a digest
        # of the plan's fields, not an index: a compiled graph bakes it in, and inductor's on-disk cache (shared
        # across processes and code versions) must not hand a graph built for one plan to another, as an index
        # would when plans are made in another order or a default changes (the fake outputs' shapes depend on it).
        plan_id = plan_key(dataclasses.astuple(self))
        object.__setattr__(self, "plan_id", plan_id)
        PLANS.setdefault(plan_id, self)

    def warps(self, launch: str) -> int:
        """num_warps of one launch kind: scan, fwd, bwd_a, bwd_dq, bwd_dk or bwd_dv."""
        return getattr(self, f"warps_{launch}")


DEFAULT_PLAN = InterdomainPlan()


def uses_torch_path(q, readout=None, normalize=False, plan: InterdomainPlan = DEFAULT_PLAN):
    """True where the op runs torch_chunk.py instead of the Triton kernels: a CPU tensor outside the Triton
    interpreter, or on the GPU a readout while plan.readout_on_gpu is off or together with the normalized readout
    (InterdomainPlan says why)."""
    if q.device.type == "cpu":
        return use_torch_path(q)
    return readout is not None and (not plan.readout_on_gpu or normalize)


def readout_p(readout):
    """P = C^T conj(C) [H, M, M, 2] (re, im) for the kernels, differentiable in C; None stays None. In real parts
    (Re P = Cr^T Cr + Ci^T Ci, Im P = Ci^T Cr - Cr^T Ci): a compiled model traces it, and inductor has no complex
    kernels."""
    if readout is None:
        return None
    cr, ci = readout[..., 0], readout[..., 1]
    real = torch.bmm(cr.transpose(1, 2), cr) + torch.bmm(ci.transpose(1, 2), ci)
    cross = torch.bmm(ci.transpose(1, 2), cr)  # Cr^T Ci is its transpose
    imag = cross - cross.transpose(1, 2)
    return torch.stack((real, imag), -1)


@triton.jit
def cmul(ar, ai, br, bi):
    """(ar + i ai)(br + i bi) as (re, im)."""
    return ar * br - ai * bi, ar * bi + ai * br


@triton.jit
def lam_pow(pw, n, om, mm, M):
    """lam^n (re, im) from one head's [C + 1, 2, M] table; n and om broadcast against each other."""
    p = pw + n * 2 * M + om
    return tl.load(p, mask=mm, other=0.0), tl.load(p + M, mask=mm, other=0.0)
