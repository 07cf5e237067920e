"""Compile every op's Triton kernels for Hopper (sm_90) on a machine without a GPU.

The Triton interpreter, which runs the kernels' CPU tests, accepts code the GPU compiler refuses: on 2026-12-06 a
helper returning [BM, C] and [C, BM] tiles from one constexpr branch passed every interpreter test and then failed
every GPU test with `Inconsistent return types` where BM != C (tools/results/gpu-tests-2026-12-02.md, row 31).
This check runs the ops' host functions on CPU tensors with Triton's active driver replaced by a stand-in that
names an sm_90 target, and turns each launch into a compile (Triton's warmup: front end, PTX and ptxas to a
cubin): compile errors show here, before a device call. It does not run the kernels, so it checks no numbers and
no resource limit that only loading on a device reports (shared memory); the GPU tests do that.

Covered: the chunked Interdomain op (forward and backward, with and without the full readout), its fused
recurrent forward, the chunked S4D carry (forward and reverse walk), I's fused input path, and NAtS-L's selected
attention and selected Gated DeltaNet (forward and backward; every autotuning config of the GDN kernels), at the
presets' head shapes and odd ones, bf16 and fp32, with the GPU's tile choices (the NAtS host helpers that choose
by device type are rebound to the GPU's choices). The whole set takes about 13 minutes on 2 cores with a cold
Triton cache, --quick about 4.

    python tools/check_hopper_compile.py            # a table of cases and kernels; exit 1 naming each failure
    python tools/check_hopper_compile.py --quick --jobs 2   # what the test suite runs (test_hopper_compile)
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass, field

if os.environ.get("TRITON_INTERPRET", "0") == "1":  # triton.jit reads it at decoration: interpreted kernels
    sys.exit("unset TRITON_INTERPRET: this check compiles the kernels, which the interpreter does not")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from megahybrid_kernels.interdomain.chunk import interdomain_bwd, interdomain_fwd  # noqa: E402
from megahybrid_kernels.interdomain.recurrent import interdomain_recurrent_fwd  # noqa: E402
from megahybrid_kernels.interdomain.s4d_chunk import _carry_triton  # noqa: E402
from megahybrid_kernels.interdomain_input.fused import interdomain_input_bwd, interdomain_input_fwd  # noqa: E402
from megahybrid_kernels.nats.attention import chunk as attention  # noqa: E402
from megahybrid_kernels.nats.gdn import chunk as gdn, wy  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class CompileOnlyDriver:
    """What JITFunction.run asks of the active driver before it compiles: the target, a device and a stream."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@dataclass
class Recorder:
    """Every launch becomes a warmup (compile, no run); records the kernels compiled and that each has a cubin."""
    compiled: list = field(default_factory=list)

    def install(self, arch: int) -> None:
        driver.set_active(CompileOnlyDriver(arch))
        launch = JITFunction.run

        def compile_only(fn, *args, grid, warmup, **kwargs):
            kernel = launch(fn, *args, grid=grid, warmup=True, **kwargs)
            if "cubin" not in kernel.asm:
                raise RuntimeError(f"{fn.fn.__name__}: compiled without a cubin ({sorted(kernel.asm)})")
            self.compiled.append(f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}")
            return kernel

        JITFunction.run = compile_only


def _decay(H, M):
    return torch.stack((-torch.rand(H, M) * 0.1, torch.randn(H, M)), -1)


def interdomain_case(dtype, T, H, K, V, M, readout):
    """The chunked op's forward then backward (the default plan), the readout P [H, M, M, 2] or the identity."""
    q, k, v, do = (torch.randn(1, T, H, d, dtype=dtype) for d in (K, K, V, V))
    decay, b = _decay(H, M), torch.randn(H, M, 2)
    p = torch.randn(H, M, M, 2) if readout else None
    o, uf, gf, starts, kept = interdomain_fwd(q, k, v, decay, b, p=p)
    interdomain_bwd(q, k, v, decay, b, None, None, do, uf, gf, starts=starts, p=p, kept=kept)


def recurrent_case(dtype, T, H, K, V, M, readout):
    """The fused recurrent forward (decode and prefill), normalized and not."""
    q, k, v = (torch.randn(1, T, H, d, dtype=dtype) for d in (K, K, V))
    readout_c = torch.randn(H, M, M, 2) if readout else None
    for normalize in (False, True):
        interdomain_recurrent_fwd(q, k, v, _decay(H, M), torch.randn(H, M, 2), None, normalize,
                                  readout=None if normalize else readout_c)


def carry_case(dtype, T, H, K, V, M, readout):
    """The chunked S4D contraction's carry: the forward walk and the reverse walk of its backward (chunks of 64)."""
    L, N = 64, -(-T // 64)
    u = torch.randn(H, 2, M, 1, N, V, dtype=dtype)
    x0 = torch.randn(1, H, 2, M, V)
    _carry_triton(u, None, x0, _decay(H, M), L, T - (N - 1) * L, False)
    _carry_triton(u, torch.randn_like(u), x0, _decay(H, M), L, T - (N - 1) * L, True)


def input_case(dtype, T, H, K, V, M, readout):
    """I's fused input path (conv 4, RoPE, feature map, head norms), forward and backward, with a decode tail."""
    R, KC = K, 4
    x, w = torch.randn(1, T, H, 2 * R + V, dtype=dtype), torch.randn(H, 2 * R, KC, dtype=dtype)
    wk, bk, wv, bv = torch.ones(R), torch.zeros(H, R), torch.ones(V), torch.zeros(H, V)
    for tail in (None, torch.randn(1, KC - 1, H * 2 * R, dtype=dtype)):
        interdomain_input_fwd(x, w, tail, wk, bk, wv, bv, 0, True, 10000.0, 1e-6)
        grads = (torch.randn(1, T, H, d, dtype=dtype) for d in (R, R, V))
        interdomain_input_bwd(x, w, tail, wk, bk, wv, bv, *grads, 0, True, 10000.0, 1e-6)


def gpu_choices() -> None:
    """The NAtS host functions choose tiles and launch settings by device type (and the GDN V tile by SM count): on
    CPU tensors they would pick the interpreter's. Their helpers are rebound to the GPU's choices (an H100's 132
    SMs), and each autotuned GDN kernel compiles every config it would time."""
    cuda = torch.device("cuda")
    torch.cuda.get_device_properties = lambda device=None: type("Props", (), {"multi_processor_count": 132})
    for module in (attention, gdn, wy):
        for name in ("_head_dims", "_bv", "_state_bk", "_chunk_bk"):
            if hasattr(module, name):
                setattr(module, name, lambda *a, _f=getattr(module, name): _f(*a[:-1], cuda))
    attention._config = lambda q, kernel: dict(attention.GPU_CONFIG[kernel])

    def compile_every_config(tuner, *args, **kwargs):
        for config in tuner.configs:
            kernel = tuner.fn.run(*args, **{**kwargs, **config.all_kwargs()})
        return kernel

    Autotuner.run = compile_every_config


def attention_case(dtype, T, H, K, V, M, readout):
    """The selected attention's forward and backward (half the chunks kept), q/k head dim K, v head dim V."""
    q, k, v = (torch.randn(1, T, H, d, dtype=dtype) for d in (K, K, V))
    keep = (torch.rand(1, H, -(-T // 64)) < 0.5).float()
    o, lse = attention.chunk_selected_attention_fwd(q, k, v, keep, K ** -0.5, 64)
    attention.chunk_selected_attention_bwd(q, k, v, o, lse, torch.randn_like(o), keep, K ** -0.5, 64)


def gdn_case(dtype, T, H, K, V, M, readout):
    """The selected Gated DeltaNet's forward and backward, several chunks and one (a kernel of its own)."""
    for t in (T, 40):
        q, k, v = (torch.randn(1, t, H, d, dtype=dtype) for d in (K, K, V))
        g, beta = -torch.rand(1, t, H), torch.rand(1, t, H, dtype=dtype)
        keep = (torch.rand(1, H, -(-t // 64)) < 0.5).float()
        o, ht, G, Ai = gdn.chunk_selected_gdn_fwd(q, k, v, g, beta, keep, K ** -0.5, None, True, False)
        gdn.chunk_selected_gdn_bwd(q, k, v, beta, keep, G, Ai, K ** -0.5, None, torch.randn_like(o), None, False,
                                   False)


OPS = {"interdomain": interdomain_case, "recurrent": recurrent_case, "s4d-carry": carry_case,
       "interdomain-input": input_case, "nats-attention": attention_case, "nats-gdn": gdn_case}
# (K, V, M): the presets' 64 x 64 heads with M = 64 (the paper's) and 32, then odd ones the tests also take
SHAPES = [(64, 64, 64), (64, 64, 32), (128, 128, 32), (32, 64, 8)]
# NAtS-L (K, V): natsl-340m's GDN heads (128 | 256) and attention heads (64 | 128), the 760M's 192 | 384 GDN head
# and the K = 64 GDN head that once faulted on the H200 (M unused)
NATS_SHAPES = [(128, 256, 0), (64, 128, 0), (192, 384, 0), (32, 64, 0)]


def _shapes(op, dt, quick):
    """--quick: the NAtS ops in bf16 at natsl-340m's shapes only (their fp32 builds take minutes: 138 s for the
    192 | 384 attention), the others' fp32 at the presets' two shapes."""
    if not op.startswith("nats"):
        return SHAPES[:2] if quick and dt == "fp32" else SHAPES
    if quick:
        return NATS_SHAPES[:2] if dt == "bf16" else []
    return NATS_SHAPES


def cases(quick: bool):
    for op in OPS:
        for dt in DTYPES:
            for K, V, M in _shapes(op, dt, quick):
                for readout in ((False, True) if op in ("interdomain", "recurrent") else (False,)):
                    yield op, dt, K, V, M, readout


def _one_line(e: BaseException) -> str:
    """A compile error as one line: the innermost cause (CompilationErrors chain one per inlined helper) and the
    kernel line where the outermost one points."""
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and ln.strip() != "^"]
    where = f" at `{lines[-1]}`" if len(lines) > 1 else ""
    last = ([ln.strip() for ln in str(inner).splitlines() if ln.strip()] or [""])[-1]
    return f"{type(inner).__name__}{where}: {last[:300]}"


SHARD_MARK = "HOPPER_SHARD "  # how a shard process hands its report to the parent


def run_cases(arch: int, T: int, only: str | None, quick: bool, shard: tuple[int, int] = (0, 1)) -> dict:
    """Compile the cases (those whose index is shard[0] modulo shard[1]): their table rows by case index, the
    failures and the kernels compiled."""
    rec = Recorder()
    rec.install(arch)
    gpu_choices()
    torch.manual_seed(0)
    failures, rows = [], {}
    for index, (op, dt, K, V, M, readout) in enumerate(cases(quick)):
        if (only and only not in op) or index % shard[1] != shard[0]:
            continue
        name = f"{op} {dt} K={K} V={V} M={M}{' readout' if readout else ''}"
        start, t0 = len(rec.compiled), time.time()
        try:
            OPS[op](DTYPES[dt], T, 2, K, V, M, readout)
        except Exception as e:  # noqa: BLE001  (one line per failing case, then the others still run)
            failures.append(f"{name}: {_one_line(e)}")
        kernels = sorted(set(rec.compiled[start:]))
        rows[index] = f"{name:<48} {time.time() - t0:6.1f} s  {', '.join(kernels) or '-'}"
    return {"rows": rows, "failures": failures, "kernels": sorted(set(rec.compiled))}


def run_in_processes(argv: list[str], jobs: int) -> dict:
    """run_cases in `jobs` processes side by side (a compile runs on one core), each one shard of the cases; a
    process that fails to report is a failure naming the end of its output."""
    import json
    import subprocess

    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--shard", f"{i}/{jobs}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(jobs)]
    merged = {"rows": {}, "failures": [], "kernels": set()}
    for i, proc in enumerate(procs):
        out = proc.communicate()[0]
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(SHARD_MARK)), None)
        if proc.returncode != 0 or line is None:
            merged["failures"].append(f"shard {i}/{jobs} exited {proc.returncode}: {out.strip()[-300:]}")
            continue
        part = json.loads(line[len(SHARD_MARK):])
        merged["rows"].update({int(k): v for k, v in part["rows"].items()})
        merged["failures"] += part["failures"]
        merged["kernels"] |= set(part["kernels"])
    return merged


def report(arch: int, T: int, result: dict) -> int:
    rows = [result["rows"][i] for i in sorted(result["rows"])]
    print(f"sm_{arch}, T = {T}: {len(rows)} cases, {len(set(result['kernels']))} kernels")
    print("\n".join(rows))
    for f in result["failures"]:
        print(f"FAILED {f}")
    return 1 if result["failures"] or not rows else 0


def main(argv=None) -> int:
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    ap.add_argument("--tokens", type=int, default=300, help="T of every case (not a multiple of the chunk)")
    ap.add_argument("--only", help="run the cases whose op name contains this")
    ap.add_argument("--quick", action="store_true",
                    help="the test suite's set: fp32 at the presets' two shapes, the NAtS ops in bf16 at natsl-340m's")
    ap.add_argument("--jobs", type=int, default=1, help="processes compiling side by side (one core each)")
    ap.add_argument("--shard", help=argparse.SUPPRESS)  # I/N: a --jobs child's part of the cases
    args = ap.parse_args(argv)
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
        result = run_cases(args.arch, args.tokens, args.only, args.quick, (index, count))
        print(SHARD_MARK + json.dumps(result))
        return 0
    if args.jobs > 1:
        child = ["--arch", str(args.arch), "--tokens", str(args.tokens), *(["--only", args.only] if args.only else []),
                 *(["--quick"] if args.quick else [])]
        return report(args.arch, args.tokens, run_in_processes(child, args.jobs))
    return report(args.arch, args.tokens, run_cases(args.arch, args.tokens, args.only, args.quick))


if __name__ == "__main__":
    sys.exit(main())
