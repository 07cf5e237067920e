"""The `D` mixer's S4D contraction on the GPU: the FFT form (s4d.py, the default) against the chunked form
(s4d_chunk.py) at 64 and 128 tokens per chunk, eager and compiled, next to the Interdomain op at the same heads
(issue #12: `D` as fast as `I`). fwd+bwd at B*T = 65,536 tokens, bf16 inputs, M = 64 modes, D = R + d_h = 128
channels per head (every preset), 12 heads (125M) and 32 (1.3B), at 4K and 16K.

First a check: the chunked form against the fp32 FFT on this GPU (output, final state, every gradient; the same
case as tests/kernels/test_s4d_chunk.py's GPU test); a failed check marks every chunked row. Usage:
python tools/bench_s4d.py [--quick] [--budget-s S]; results in tools/results/bench_s4d.{md,json}.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megahybrid_kernels.interdomain import interdomain_attention  # noqa: E402
from megahybrid_kernels.interdomain.s4d import s4d_contraction  # noqa: E402
from megahybrid_kernels.interdomain.s4d_chunk import s4d_contraction_chunked  # noqa: E402
from tools.benchutil import format_table, peak_memory_mib, save_results, time_ms  # noqa: E402

TOKENS, M, CHANNELS = 65536, 64, 128
HEADS = (12, 32)


def check() -> dict:
    """Relative RMS errors of the bf16 chunked contraction against the fp32 FFT (T = 1000: a partial chunk)."""
    from tests.kernels.test_s4d_chunk import _gpu_case, _run
    from tests.utils import rel_rms_error

    inputs = _gpu_case(torch.bfloat16, 1000)
    got = _run(s4d_contraction_chunked, inputs)
    want = _run(s4d_contraction, [inputs[0].float()] + inputs[1:])
    names = ("y", "state", "dx", "ddecay", "db", "dc", "ds0")
    errs = {n: rel_rms_error(a, e) for n, a, e in zip(names, (got[0], got[1], *got[2]), (want[0], want[1], *want[2]))}
    return {"errors": {k: f"{v:.2e}" for k, v in errs.items()}, "ok": max(errs.values()) < 3e-2}


def _s4d_case(T, heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    B = TOKENS // T
    x = torch.randn(B, T, heads, CHANNELS, device="cuda", generator=g).bfloat16().requires_grad_()
    decay = torch.stack((-torch.rand(heads, M, device="cuda") * 0.1 - 1e-3, torch.randn(heads, M, device="cuda")), -1)
    b = torch.randn(heads, M, 2, device="cuda") / M ** 0.5
    c = torch.randn(heads, M, CHANNELS, 2, device="cuda") / M ** 0.5
    leaves = [x, decay.requires_grad_(), b.requires_grad_(), c.requires_grad_()]
    return leaves, torch.randn_like(x)


def _interdomain_case(T, heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    B = TOKENS // T
    q, k, v = (torch.randn(B, T, heads, 64, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(3))
    decay = torch.stack((-torch.rand(heads, M, device="cuda") * 0.1 - 1e-3, torch.randn(heads, M, device="cuda")), -1)
    b = torch.randn(heads, M, 2, device="cuda") / M ** 0.5
    c = torch.randn(heads, M, M, 2, device="cuda") / (2 * M) ** 0.5
    leaves = [q, k, v, decay.requires_grad_(), b.requires_grad_(), c.requires_grad_()]
    fwd = lambda q, k, v, decay, b, c: interdomain_attention(q, k, v, decay, b, chunk_size=64, readout=c,  # noqa: E731
                                                             check_values=False)[0]
    return fwd, leaves, torch.randn_like(v)


def _variants():
    """name -> (contraction, compiled)."""
    chunked = {f"chunked-{L}": (lambda *a, L=L: s4d_contraction_chunked(*a, chunk_size=L)) for L in (64, 128)}
    forms = {"fft": s4d_contraction, **chunked}
    return {**{n: (f, False) for n, f in forms.items()}, **{f"{n} compiled": (f, True) for n, f in forms.items()}}


def _time(fwd, leaves, dy) -> tuple[float, float]:
    step = lambda: torch.autograd.backward(fwd(*leaves), dy)  # noqa: E731
    step()
    ms = time_ms(step, grad_to_none=leaves)
    return ms, peak_memory_mib(step)


def rows_at(T, heads, names, checked) -> list[dict]:
    rows = []
    fwd, leaves, dy = _interdomain_case(T, heads)
    ms, mib = _time(fwd, leaves, dy)
    rows.append({"op": "I (interdomain op, 64 + 64)", "heads": heads, "T": T, "fwdbwd_ms": ms, "peak_MiB": mib})
    leaves, dy = _s4d_case(T, heads)
    for name in names:
        contraction, compiled = _variants()[name]
        fn = lambda *a, f=contraction: f(*a)[0]  # noqa: E731
        torch._dynamo.reset()
        fwd = torch.compile(fn) if compiled else fn
        try:
            ms, mib = _time(fwd, leaves, dy)
            row = {"op": f"D {name}", "heads": heads, "T": T, "fwdbwd_ms": ms, "peak_MiB": mib}
        except Exception as err:  # one form failing (memory, a build) leaves the others' rows
            row = {"op": f"D {name}", "heads": heads, "T": T, "error": f"{type(err).__name__}: {str(err)[:80]}"}
        if "chunked" in name and not checked:
            row["note"] = "check failed"
        rows.append(row)
        torch.cuda.empty_cache()
    base = rows[0]["fwdbwd_ms"]
    for row in rows:
        if "fwdbwd_ms" in row:
            row["I/this"] = base / row["fwdbwd_ms"]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="12 heads only, eager fft and chunked-64 and compiled")
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip the remaining shapes after this many seconds")
    args = ap.parse_args()
    start = time.time()
    checked = check()
    print("check (bf16 chunked vs fp32 FFT, T = 1000):", checked, flush=True)
    names = list(_variants())
    if args.quick:
        names = ["fft", "chunked-64", "fft compiled", "chunked-64 compiled"]
    rows = []
    for heads in HEADS[:1] if args.quick else HEADS:
        for T in (4096, 16384):
            if time.time() - start > args.budget_s:
                print(f"skipped {heads} heads T={T}: over the time budget", flush=True)
                continue
            rows += rows_at(T, heads, names, checked["ok"])
            print(format_table(rows[-len(names) - 1:]), flush=True)
    extra = {"shape": f"B*T={TOKENS}, M={M}, D={CHANNELS} channels per head, bf16 x, fp32 parameters; "
                      "I: K=V=64, full readout C", "check": checked}
    print(save_results("bench_s4d", rows, extra))


if __name__ == "__main__":
    main()
