"""Interdomain Attention on the GPU: forward and forward+backward tokens/s and peak memory at B*T = 65,536 tokens,
H = 16, K = V = 128, bf16, next to causal SDPA (flash, cuDNN) and fla's chunk_gated_delta_rule forward.

Also prints the op's dot FLOPs and HBM bytes per token-head (model of the kernels as written) and the floor they
give at the measured matmul and copy peaks. Usage: python tools/bench_interdomain.py [--quick]
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels.interdomain import chunk as ch  # noqa: E402
from kernels.interdomain import interdomain_attention  # noqa: E402
from tools.benchutil import format_table, matmul_peak_tflops, peak_memory_mib, save_results, time_ms  # noqa: E402

TOKENS, H, D = 65536, 16, 128
SUB = 16


def cost_model(M, K=D, V=D, C=64):
    """(fwd FLOPs, fwd+bwd FLOPs, fwd bytes, fwd+bwd bytes) per token and head for the kernels in chunk.py."""
    def readout_a(Dx, deriv):
        tiles = max(1, M // (16 if deriv else 32))
        f = (4 if deriv else 2) * 2 * Dx * M + SUB * Dx * tiles + (16 if deriv else 8) * SUB * M
        return 2 * f

    def readout_o(Dz):
        return 2 * (4 * M * Dz + 8 * SUB * M * max(1, Dz // 64) + SUB * Dz)

    def scan(Dz, deriv=False):
        return 2 * (4 if deriv else 2) * M * Dz

    fwd = scan(K) + readout_a(K, False) + scan(V) + readout_o(V)
    bwd = (scan(K, True) + readout_a(K, True) + scan(V, True) + readout_a(V, True) + scan(K) + readout_o(K)
           + scan(K) + readout_o(K) + scan(V) + readout_o(V))
    st = lambda Dz: 2 * M * Dz * 2 / C  # noqa: E731  one bf16 chunk-boundary state set, per token
    per_tok = 8 * M  # one fp32 complex [T, M] coefficient tensor
    fwd_b = (2 * K + st(K)) + (4 * K + st(K) + per_tok) + (2 * V + st(V)) + (2 * V + st(V) + per_tok * V // 64 + 2 * V)
    bwd_b = ((2 * K + 2 * st(K)) + (4 * K + 2 * st(K) + 3 * per_tok) + (2 * V + 2 * st(V))
             + (4 * V + 2 * st(V) + 4 * per_tok) + (2 * K + st(K)) + (2 * K + st(K) + 2 * per_tok + 2 * K)
             + 2 * ((2 * K + st(K) + per_tok) + (2 * K + st(K) + per_tok + 2 * K)))
    return fwd, fwd + bwd, fwd_b, fwd_b + bwd_b


def copy_peak_tbps():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (time_ms(lambda: y.copy_(x)) * 1e-3) / 1e12


def ours(T, M, C):
    B = TOKENS // T
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.rand(B, T, H, D, device="cuda", generator=g).bfloat16().requires_grad_()
    k = (torch.rand(B, T, H, D, device="cuda", generator=g) / D).bfloat16().requires_grad_()
    v = torch.randn(B, T, H, D, device="cuda", generator=g).bfloat16().requires_grad_()
    decay = torch.stack((-torch.rand(H, M, device="cuda") * 0.2, torch.rand(H, M, device="cuda")), -1)
    decay.requires_grad_()
    b = torch.randn(H, M, 2, device="cuda").requires_grad_()
    do = torch.randn_like(v)
    fwd = lambda: interdomain_attention(q, k, v, decay, b, chunk_size=C)[0]  # noqa: E731
    fb = lambda: torch.autograd.backward(fwd(), do)  # noqa: E731
    return _measure(fwd, fb)


def breakdown(T, M, C=64):
    """Milliseconds of each forward kernel launch (scan U, readout_a, scan G, readout_o) and of the backward."""
    B = TOKENS // T
    q, k, v = (torch.rand(B, T, H, D, device="cuda").bfloat16() for _ in range(3))
    decay = torch.stack((-torch.rand(H, M, device="cuda") * 0.2, torch.rand(H, M, device="cuda")), -1)
    b = torch.randn(H, M, 2, device="cuda")
    tabs = ch.Tables(decay, T, C, rev=False)
    ub, _ = ch.scan_fwd(k, b, tabs, C)
    a = ch.readout_a(q, k, ub, b, tabs, C)
    gb, _ = ch.scan_fwd(v, b, tabs, C, coef=ch.CONST_B)
    out = {"tables": time_ms(lambda: ch.Tables(decay, T, C, rev=False)),
           "scan": time_ms(lambda: ch.scan_fwd(k, b, tabs, C)),
           "scan_deriv": time_ms(lambda: ch.scan_fwd(k, b, tabs, C, deriv=True)),
           "readout_a": time_ms(lambda: ch.readout_a(q, k, ub, b, tabs, C)),
           "readout_o": time_ms(lambda: ch.readout_o(v, gb, b, tabs, C, r=a)),
           "bwd_total": time_ms(lambda: ch.interdomain_bwd(q, k, v, decay, b, None, None, v, None, None, C))}
    return {k: round(x, 3) for k, x in out.items()}


def _with_warps(warps, fn):
    saved = dict(ch.NUM_WARPS)
    ch.NUM_WARPS.update(warps)
    try:
        return fn()
    finally:
        ch.NUM_WARPS.update(saved)


def _measure(fwd, fb):
    with torch.no_grad():
        t_f = time_ms(fwd)
    t_fb = time_ms(fb) if fb is not None else float("nan")
    mem = peak_memory_mib(fb if fb is not None else fwd)
    return t_f, t_fb, mem


def sdpa(T, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B = TOKENS // T
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def fwd():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    return _measure(fwd, lambda: torch.autograd.backward(fwd(), do))


def fla_gdn(T):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B = TOKENS // T
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3)
    beta = torch.rand(B, T, H, device="cuda").bfloat16()

    def fwd():
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    return _measure(fwd, None)


def row(name, T, M, res):
    t_f, t_fb, mem = res
    return {"op": name, "T": T, "M": M, "fwd_ms": t_f, "fwdbwd_ms": t_fb, "fwd_Mtok/s": TOKENS / t_f / 1e3,
            "fwdbwd_Mtok/s": TOKENS / t_fb / 1e3, "peak_MiB": mem}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T in {2K, 8K} only")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip the remaining rows after this many seconds")
    ap.add_argument("--only-ours", action="store_true", help="skip the SDPA and fla rows")
    args = ap.parse_args()
    start = time.time()
    Ts = [2048, 8192] if args.quick else [2048, 4096, 8192, 16384, 65536]
    mine = lambda M, C, Ts=Ts: [(f"interdomain C={C}", T, M, lambda T=T: ours(T, M, C)) for T in Ts]  # noqa: E731
    jobs = mine(32, 64) + [("breakdown", T, 32, lambda T=T: breakdown(T, 32)) for T in (2048, 65536)]
    if not args.only_ours:
        jobs += [(f"sdpa-{be}", T, "-", lambda T=T, be=be: sdpa(T, be)) for be in ("flash", "cudnn") for T in Ts]
        jobs += [("fla-gdn fwd", T, "-", lambda T=T: fla_gdn(T)) for T in Ts]
    jobs += mine(64, 64)
    default = dict(ch.NUM_WARPS)
    for warps in ({"scan": 4, "readout_a": 4, "readout_o": 4}, {"scan": 8, "readout_a": 8, "readout_o": 8}):
        jobs.append((f"interdomain C=64 warps={warps['scan']}/{warps['readout_a']}/{warps['readout_o']}", 8192, 32,
                     lambda w=warps: _with_warps(w, lambda: ours(8192, 32, 64))))
    jobs += mine(32, 128, [2048, 8192, 65536])
    rows = []
    for name, T, M, fn in jobs:
        if time.time() - start > args.budget_s:
            print(f"skipped {name} T={T} M={M}: over the time budget", flush=True)
            continue
        try:
            res = fn()
            if name == "breakdown":
                print(f"breakdown ms T={T} M={M}:", res, flush=True)
                continue
            rows.append(row(name, T, M, res))
            print(format_table(rows[-1:]), flush=True)
        except Exception as e:  # a backend missing on this GPU must not lose the other rows
            print(f"{name} T={T} M={M} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()
    ch.NUM_WARPS.update(default)
    mm_peak, bw_peak = matmul_peak_tflops(), copy_peak_tbps()
    for M in (32, 64):
        f_f, f_fb, b_f, b_fb = cost_model(M)
        th = TOKENS * H
        floor_f = max(th * f_f / (mm_peak * 1e12), th * b_f / (bw_peak * 1e12)) * 1e3
        floor_fb = max(th * f_fb / (mm_peak * 1e12), th * b_fb / (bw_peak * 1e12)) * 1e3
        rows.append({"op": "model C=64", "T": "any", "M": M, "fwd_ms": floor_f, "fwdbwd_ms": floor_fb,
                     "fwd_Mtok/s": TOKENS / floor_f / 1e3, "fwdbwd_Mtok/s": TOKENS / floor_fb / 1e3,
                     "peak_MiB": float("nan"), "kflop_fwd": f_f / 1e3, "kflop_fb": f_fb / 1e3,
                     "kB_fwd": b_f / 1e3, "kB_fb": b_fb / 1e3})
    model = {f"M={M}": [round(x / 1e3, 1) for x in cost_model(M)] for M in (32, 64)}
    extra = {"num_warps of the main rows": default,
             "cost_model_kflop_kB_per_token_head (fwd, fwd+bwd FLOP; fwd, fwd+bwd bytes)": model,
             "matmul_peak_tflops": round(mm_peak, 1), "copy_peak_tbps": round(bw_peak, 2),
             "shape": f"B*T={TOKENS}, H={H}, K=V={D}, bf16; model rows = max(FLOP, byte) floor per token-head"}
    print(format_table(rows))
    print(extra)
    print(save_results("interdomain", rows, extra))


if __name__ == "__main__":
    main()
