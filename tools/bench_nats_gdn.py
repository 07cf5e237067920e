"""Benchmark chunk-selected Gated DeltaNet (bf16, H200) against flash-linear-attention's chunk_gated_delta_rule.

B*T = 65,536 tokens, H = 8, K = 128, V = 256; kept fraction 0/10/25/50/100 %; T in 4K/16K/64K; forward and
forward+backward. Usage: python tools/bench_nats_gdn.py  (writes tools/results/nats-gdn.{json,md}).
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megahybrid_kernels.nats import chunk_selected_gdn  # noqa: E402
from tools.benchutil import format_table, peak_memory_mib, save_results, time_ms  # noqa: E402

TOKENS, H, K, V = 65536, 8, 128, 256
LENGTHS = (4096, 16384, 65536)
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)


def make_inputs(T: int, frac: float):
    B, NT = TOKENS // T, T // 64
    dev, bf = "cuda", torch.bfloat16
    q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
    v = torch.randn(B, T, H, V, device=dev, dtype=bf)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev) + 3.0)
    beta = torch.rand(B, T, H, device=dev).to(bf)
    # exactly round(frac * NT) kept chunks per (batch, head), at random positions
    rank = torch.rand(B, H, NT, device=dev).argsort(-1).argsort(-1)
    keep = (rank < round(frac * NT)).float()
    return [q, k, v, g, beta, keep]


def fwd_bwd_fn(op, inputs):
    xs = [x.detach().requires_grad_() for x in inputs]
    do = torch.randn_like(inputs[2])

    def run():
        o = op(*xs)[0]
        torch.autograd.grad(o, xs, do)
    return run


def fla_op():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        print(f"fla not importable: {e}")
        return None
    return lambda q, k, v, g, beta, keep=None: chunk_gated_delta_rule(q, k, v, g, beta)


def time_or_none(fn):
    try:
        return time_ms(fn)
    except Exception as e:  # fla 0.6 refuses its gated backward on some Hopper/Triton combinations
        print(f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return None


def bench_length(T: int, fla) -> list[dict]:
    rows, fla_fwd, fla_fb = [], None, None
    if fla is not None:
        base = make_inputs(T, 1.0)
        with torch.no_grad():
            fla_fwd = time_or_none(lambda: fla(*base))
        fla_fb = time_or_none(fwd_bwd_fn(fla, base[:5]))
    for frac in FRACTIONS:
        inputs = make_inputs(T, frac)
        with torch.no_grad():
            fwd = time_ms(lambda: chunk_selected_gdn(*inputs))
        fb = fwd_bwd_fn(chunk_selected_gdn, inputs)
        rows.append({"T": T, "B": TOKENS // T, "kept_%": int(100 * frac), "fwd_ms": fwd, "fwd_bwd_ms": time_ms(fb),
                     "fla_fwd_ms": fla_fwd or "-", "fla_fwd_bwd_ms": fla_fb or "-",
                     "fwd/fla_fwd": fwd / fla_fwd if fla_fwd else "-", "peak_MiB": peak_memory_mib(fb)})
        print(rows[-1], flush=True)
    return rows


def kernel_breakdown(T: int = 4096, frac: float = 0.25, reps: int = 5) -> None:
    """Per-kernel CUDA time of forward+backward (torch.profiler), to show where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    run = fwd_bwd_fn(chunk_selected_gdn, make_inputs(T, frac))
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    print(f"per-kernel CUDA time, T={T}, kept {frac:.0%}, {reps} fwd+bwd calls:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))


def main():
    rows, fla = [], fla_op()
    extra = {"shape": f"B*T={TOKENS}, H={H}, K={K}, V={V}, bf16, chunk 64", "op": "megahybrid_kernels.nats.chunk_selected_gdn"}
    for T in LENGTHS:
        rows += bench_length(T, fla)
        path = save_results("nats-gdn", rows, extra)  # after every length, so a cut-off run still reports
    print(f"saved {path}")
    kernel_breakdown()
    print(format_table(rows))


if __name__ == "__main__":
    main()
