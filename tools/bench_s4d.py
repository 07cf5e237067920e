"""The `D` mixer's S4D contraction on the GPU: the FFT form (s4d.py) against the chunked form (s4d_chunk.py, the
default) at 64 and 128 tokens per chunk (--chunk-sizes), eager and compiled, next to the Interdomain op at the same
heads (issue #12: `D` as fast as `I`). fwd+bwd at B*T = 65,536 tokens, bf16 inputs, M = 64 modes, D = R + d_h = 128
channels per head (every preset), 12 heads (125M) and 32 (1.3B), at 4K and 16K.

First a check: the chunked form against the fp32 FFT on this device (output, final state, every gradient; the
case of tests/kernels/test_s4d_chunk.py's GPU test); a failed check marks every chunked row. Usage:
python tools/bench_s4d.py [--quick] [--chunk-sizes 32,64] [--profile] [--budget-s S]; results in
tools/results/bench_s4d.{md,json}; --profile adds the compiled chunked form's kernels at 12 heads, 4K (where its
time goes). Without a GPU
(`--smoke`, tests/test_bench_s4d.py): tiny fp32 shapes, eager only, timed with perf_counter.
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megahybrid_kernels.interdomain import interdomain_attention  # noqa: E402
from megahybrid_kernels.interdomain.s4d import s4d_contraction  # noqa: E402
from megahybrid_kernels.interdomain.s4d_chunk import s4d_contraction_chunked  # noqa: E402
from tools.benchutil import format_table, peak_memory_mib, save_results, time_ms  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Setup:
    tokens: int = 65536
    heads: tuple[int, ...] = (12, 32)
    contexts: tuple[int, ...] = (4096, 16384)
    modes: int = 64
    channels: int = 128  # R + d_h of a `D` head
    head_dim: int = 64  # K = V of the `I` rows
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16


SMOKE = Setup(tokens=512, heads=(2,), contexts=(256,), modes=8, channels=16, head_dim=16, device="cpu",
              dtype=torch.float32)


def check(setup: Setup) -> dict:
    """Relative RMS errors of the chunked contraction in setup's dtype against the fp32 FFT (T = 1000: a partial
    chunk), every gradient included."""
    from tests.kernels.test_s4d_chunk import _gpu_case, _run
    from tests.utils import rel_rms_error

    inputs = _gpu_case(torch.float32, 1000, M=setup.modes, D=setup.channels, device=setup.device)
    got = _run(s4d_contraction_chunked, [inputs[0].to(setup.dtype)] + inputs[1:])
    want = _run(s4d_contraction, inputs)
    names = ("y", "state", "dx", "ddecay", "db", "dc", "ds0")
    errs = {n: rel_rms_error(a, e) for n, a, e in zip(names, (got[0], got[1], *got[2]), (want[0], want[1], *want[2]))}
    return {"errors": {k: f"{v:.2e}" for k, v in errs.items()}, "ok": max(errs.values()) < 3e-2}


def _parameters(setup: Setup, heads: int, width: int):
    dev, M = setup.device, setup.modes
    decay = torch.stack((-torch.rand(heads, M, device=dev) * 0.1 - 1e-3, torch.randn(heads, M, device=dev)), -1)
    b = torch.randn(heads, M, 2, device=dev) / M ** 0.5
    c = torch.randn(heads, M, width, 2, device=dev) / M ** 0.5
    return [t.requires_grad_() for t in (decay, b, c)]


def _s4d_case(setup: Setup, T: int, heads: int):
    x = torch.randn(setup.tokens // T, T, heads, setup.channels, device=setup.device).to(setup.dtype)
    return [x.requires_grad_(), *_parameters(setup, heads, setup.channels)], torch.randn_like(x)


def _interdomain_case(setup: Setup, T: int, heads: int):
    shape = (setup.tokens // T, T, heads, setup.head_dim)
    q, k, v = (torch.randn(shape, device=setup.device).to(setup.dtype).requires_grad_() for _ in range(3))
    decay, b, c = _parameters(setup, heads, setup.modes)
    c.data.mul_(0.5 ** 0.5)  # readout C [H, M, M, 2] at variance 1 / (2M)
    fwd = lambda q, k, v, decay, b, c: interdomain_attention(q, k, v, decay, b, chunk_size=64, readout=c,  # noqa: E731
                                                             check_values=False)[0]
    return fwd, [q, k, v, decay, b, c], torch.randn_like(v)


def variants(compiled: bool = True, chunk_sizes: tuple[int, ...] = (64, 128)) -> dict:
    """name -> (contraction, compiled)."""
    chunked = {f"chunked-{L}": (lambda *a, L=L: s4d_contraction_chunked(*a, chunk_size=L)) for L in chunk_sizes}
    forms = {"fft": s4d_contraction, **chunked}
    out = {n: (f, False) for n, f in forms.items()}
    return {**out, **{f"{n} compiled": (f, True) for n, f in forms.items()}} if compiled else out


def _time(setup: Setup, fwd, leaves, dy) -> tuple[float, float | str]:
    step = lambda: torch.autograd.backward(fwd(*leaves), dy)  # noqa: E731
    step()
    if setup.device == "cuda":
        return time_ms(step, grad_to_none=leaves), peak_memory_mib(step)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), "n/a"


def profile(setup: Setup, contraction) -> dict:
    """Milliseconds per fwd+bwd call of a contraction's top kernels at the first heads and context (kernel_ms),
    compiled on the GPU (the smoke run: eager, the ops' CPU time)."""
    from tools.benchutil import kernel_ms

    leaves, dy = _s4d_case(setup, setup.contexts[0], setup.heads[0])
    torch._dynamo.reset()
    fn = lambda *a: contraction(*a)[0]  # noqa: E731
    fn = torch.compile(fn) if setup.device == "cuda" else fn
    step = lambda: torch.autograd.backward(fn(*leaves), dy)  # noqa: E731
    step()
    return kernel_ms(step, top=20)


def rows_at(setup: Setup, T: int, heads: int, names, checked: bool, forms: dict) -> list[dict]:
    fwd, leaves, dy = _interdomain_case(setup, T, heads)
    ms, mib = _time(setup, fwd, leaves, dy)
    rows = [{"op": f"I (op, {setup.head_dim} + {setup.head_dim}, readout C)", "heads": heads, "T": T,
             "fwdbwd_ms": ms, "peak_MiB": mib}]
    leaves, dy = _s4d_case(setup, T, heads)
    for name in names:
        contraction, compiled = forms[name]
        fn = lambda *a, f=contraction: f(*a)[0]  # noqa: E731
        torch._dynamo.reset()
        row = {"op": f"D {name}", "heads": heads, "T": T}
        try:
            ms, mib = _time(setup, torch.compile(fn) if compiled else fn, leaves, dy)
            row.update(fwdbwd_ms=ms, peak_MiB=mib, **{"I/this": rows[0]["fwdbwd_ms"] / ms})
        except Exception as err:  # one form failing (memory, a build) leaves the others' rows
            row["error"] = f"{type(err).__name__}: {str(err)[:80]}"
        if "chunked" in name and not checked:
            row["note"] = "check failed"
        rows.append(row)
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="12 heads only; fft and the first chunk size, eager and compiled")
    ap.add_argument("--smoke", action="store_true", help="no GPU: tiny fp32 shapes on the CPU, eager forms only")
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip the remaining shapes after this many seconds")
    ap.add_argument("--chunk-sizes", default="64,128", help="the chunked form's tokens per chunk, comma-separated")
    ap.add_argument("--profile", action="store_true", help="also the kernels of the first chunk size, compiled")
    ap.add_argument("--results-dir", default=None, help="default tools/results")
    args = ap.parse_args()
    setup = SMOKE if args.smoke else Setup()
    start = time.time()
    checked = check(setup)
    print("check (chunked vs fp32 FFT, T = 1000):", checked, flush=True)
    sizes = tuple(int(s) for s in args.chunk_sizes.split(","))
    forms = variants(compiled=not args.smoke, chunk_sizes=sizes)
    names = list(forms)
    if args.quick:
        names = ["fft", f"chunked-{sizes[0]}", "fft compiled", f"chunked-{sizes[0]} compiled"]
    rows = []
    for heads in setup.heads[:1] if args.quick else setup.heads:
        for T in setup.contexts:
            if time.time() - start > args.budget_s:
                print(f"skipped {heads} heads T={T}: over the time budget", flush=True)
                continue
            rows += rows_at(setup, T, heads, names, checked["ok"], forms)
            print(format_table(rows[-len(names) - 1:]), flush=True)
    extra = {"shape": f"B*T={setup.tokens}, M={setup.modes}, D={setup.channels} channels per head, "
                      f"{str(setup.dtype).removeprefix('torch.')} x, fp32 parameters; I: K=V={setup.head_dim}, "
                      "full readout C", "check": checked}
    if args.profile:
        where = f"{setup.heads[0]} heads, T = {setup.contexts[0]}{', compiled' if setup.device == 'cuda' else ''}"
        extra[f"kernels of chunked-{sizes[0]}, {where} (ms per call)"] = profile(setup, forms[f"chunked-{sizes[0]}"][0])
    print(save_results("bench_s4d", rows, extra, args.results_dir))


if __name__ == "__main__":
    main()
