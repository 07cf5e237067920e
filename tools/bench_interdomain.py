"""Interdomain Attention on the GPU: forward and forward+backward tokens/s and peak memory at B*T = 65,536 tokens,
H = 16, K = V = 128, bf16, next to causal SDPA (flash, cuDNN) and fla's chunk_gated_delta_rule forward.

Also prints the op's dot FLOPs and HBM bytes per token-head (model of the kernels as written) and the floor they
give at the measured matmul and copy peaks, and the decode step's time per token. Settings other than the
defaults run as `InterdomainPlan`s passed to the op (nothing here changes module state). Usage:
python tools/bench_interdomain.py [--quick] [--only-ours] [--paper]; `--paper` runs the paper's shapes (12 and 32 heads
x 64, M = 64, a full complex readout) against SDPA at the same heads, `--paper --plan warps_bwd_a=8` the same
under a changed plan (interdomain-paper-plan.*); `--compile-report` needs no GPU: it compiles every
scan.py and readout.py kernel for sm_90 and prints registers, local memory, shared memory and wgmma / mma counts.
"""
import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megahybrid_kernels.interdomain import DEFAULT_PLAN, interdomain_attention, interdomain_step  # noqa: E402
from megahybrid_kernels.interdomain import readout as ro  # noqa: E402
from megahybrid_kernels.interdomain import scan as sc  # noqa: E402
from megahybrid_kernels.interdomain.chunk import interdomain_bwd, interdomain_fwd  # noqa: E402
from tools.benchutil import (  # noqa: E402
    format_table, kernel_ms, matmul_peak_tflops, peak_memory_mib, save_results, time_ms)

TOKENS, H, D = 65536, 16, 128


def cost_model(M, K=D, V=D, C=64):
    """(fwd FLOPs, fwd+bwd FLOPs, fwd bytes, fwd+bwd bytes) per token and head for the scan and readout kernels.

    Tensor-core FLOPs only (2 m n k per dot, per token = per chunk / C; modes padded to BM); bf16 bytes with the
    chunk-boundary states (2 M D per chunk) and the per-token a, da (2 M each) counted once per read or write."""
    BM = max(16, 1 << (M - 1).bit_length())
    scan = lambda Dz: 4 * BM * Dz  # noqa: E731  [M, C] x [C, D], re and im
    readout_a = lambda Dx: 2 * C * Dx + 4 * Dx * BM + 4 * C * BM  # noqa: E731
    fwd_k = readout_a(K) + 4 * C * BM + 4 * BM * V + 2 * C * V
    bwd_a = readout_a(K) + readout_a(V) + 8 * C * BM
    bwd_grads = 12 * C * BM + (2 * C * K + 4 * BM * K) + (2 * C * K + 8 * BM * K) + (2 * C * V + 8 * BM * V)
    fwd = scan(K) + scan(V) + fwd_k
    bwd = 2 * scan(K) + 2 * scan(V) + bwd_a + bwd_grads
    st = lambda Dz: 2 * M * Dz * 2 / C  # noqa: E731  one bf16 boundary-state set, per token
    tok, coef = 2, 2 * M * 2  # bytes of one feature of one token; of a per-token a or da
    scan_b = lambda Dz, per_tok: tok * Dz + st(Dz) + (coef if per_tok else 0)  # noqa: E731
    fwd_b = scan_b(K, False) + scan_b(V, False) + tok * (2 * K + 2 * V) + st(K) + st(V)
    bwd_a_b = tok * (2 * K + 2 * V) + st(K) + st(V) + 2 * coef
    main_b = tok * (3 * K + 2 * V) + 4 * coef + 2 * st(K) + 3 * st(K) + 3 * st(V) + tok * (2 * K + V)
    bwd_b = scan_b(K, False) + scan_b(V, False) + bwd_a_b + scan_b(K, True) + scan_b(V, True) + main_b
    return fwd, fwd + bwd, fwd_b, fwd_b + bwd_b


def compile_report(Ms=(32,), warps=(4,), plan=DEFAULT_PLAN):
    """Offline sm_90 build of every scan / readout kernel at K = V = 128, C = 64, bf16: resource rows (no GPU
    needed)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    fp32 = {"b_ptr", "decay_ptr", "pw_ptr", "part_ptr", "xf_ptr", "x0_ptr"}
    rows = []

    def build(name, fn, consts, nw):
        sig = {n: "constexpr" if n in consts else ("*fp32" if n in fp32 else "*bf16") if n.endswith("_ptr")
               else "i32" for n in fn.arg_names}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
        k = triton.compile(src, target=triton.backends.compiler.GPUTarget("cuda", 90, 32), options={"num_warps": nw})
        path = Path("/tmp") / f"interdomain_{os.getpid()}.cubin"
        path.write_bytes(k.asm["cubin"])
        res = subprocess.run([cuobjdump, "-res-usage", str(path)], capture_output=True, text=True).stdout
        path.unlink()
        ptx = k.asm["ptx"]
        rows.append({"kernel": name, "warps": nw, "regs": int(re.search(r"REG:(\d+)", res).group(1)),
                     "local_B": int(re.search(r"LOCAL:(\d+)", res).group(1)), "smem_B": k.metadata.shared,
                     "wgmma": ptx.count("wgmma.mma_async"), "mma.sync": ptx.count("mma.sync")})
        print(format_table(rows[-1:]), flush=True)

    for M in Ms:
        # tiles as the GPU runs them (readout.tiles)
        bm = max(plan.gpu_min_tile[0], 1 << (M - 1).bit_length())
        common = dict(K=D, V=D, C=64, BM=bm, BK=64, BV=64, PREC="tf32")
        for nw in warps:
            build(f"fwd M={M}", ro._fwd_kernel, dict(common, STACK=bm < plan.fwd_stack_below), nw)
            build(f"bwd_a M={M}", ro._bwd_a_kernel, common, nw)
            for part in (1, 2, 4):
                build(f"bwd_part {part} M={M}", ro._bwd_part_kernel, dict(common, PART=part), nw)
    for bm, bd in ((32, 64), (16, 32)):
        for per_token in (False, True):
            for hoist in (False, True):
                consts = dict(C=64, BM=bm, BD=bd, PER_TOKEN=per_token, HAS_INIT=True, REV=per_token, PREC="tf32",
                              HOIST=hoist, STORE=True, INTERPRET=False)
                build(f"scan BM={bm} BD={bd} {'rev per-token' if per_token else 'fwd const-b'}"
                      f"{' hoist' if hoist else ''}", sc._scan_kernel, consts, 4)
    build("powers M=32", sc._powers_kernel, dict(C=64, BN=8, BM=32), 4)
    print(format_table(rows))
    return rows


def copy_peak_tbps():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (time_ms(lambda: y.copy_(x)) * 1e-3) / 1e12


def _inputs_and_fwd(T, M, C=64, plan=DEFAULT_PLAN, heads=H, dim=D, readout=False, device="cuda"):
    """Random inputs at B*T = TOKENS: the op's forward closure and the leaves that take gradients. readout: a full
    complex C [H, M, M, 2] too (random, scaled so that C^T conj(C) stays near the identity's size)."""
    B = TOKENS // T
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.rand(B, T, heads, dim, device=device, generator=g).bfloat16().requires_grad_()
    k = (torch.rand(B, T, heads, dim, device=device, generator=g) / dim).bfloat16().requires_grad_()
    v = torch.randn(B, T, heads, dim, device=device, generator=g).bfloat16().requires_grad_()
    decay = torch.stack((-torch.rand(heads, M, device=device) * 0.2, torch.rand(heads, M, device=device)), -1)
    decay.requires_grad_()
    b = torch.randn(heads, M, 2, device=device).requires_grad_()
    c = (torch.randn(heads, M, M, 2, device=device) / (2 * M) ** 0.5).requires_grad_() if readout else None
    leaves = [q, k, v, decay, b] + ([c] if readout else [])
    return (lambda: interdomain_attention(q, k, v, decay, b, chunk_size=C, readout=c, plan=plan)[0]), leaves


def ours(T, M, C=64, accumulate=False, plan=DEFAULT_PLAN, heads=H, dim=D, readout=False):
    """(fwd ms, fwd+bwd ms, peak MiB) of the op on random inputs (_inputs_and_fwd)."""
    fwd, leaves = _inputs_and_fwd(T, M, C, plan, heads=heads, dim=dim, readout=readout)
    do = torch.randn(TOKENS // T, T, heads, dim, device="cuda", dtype=torch.bfloat16)
    return _measure(fwd, lambda: torch.autograd.backward(fwd(), do), None if accumulate else leaves)


def _launches(T, M, C=64):
    """One closure per kernel launch of fwd+bwd on random inputs, each taking the plan to launch with: the readout
    launches (name -> fn(plan), returning Triton's kernel handle), the scans and the fwd / bwd totals."""
    B = TOKENS // T
    q, k, v, do = (torch.rand(B, T, H, D, device="cuda").bfloat16() for _ in range(4))
    decay = torch.stack((-torch.rand(H, M, device="cuda") * 0.2, torch.rand(H, M, device="cuda")), -1)
    b = torch.randn(H, M, 2, device="cuda")
    pw = sc.powers(decay, C)
    ub, _, _ = sc.scan(k, b, pw, decay, C)
    gb, _, _ = sc.scan(v, b, pw, decay, C)
    a, da = (q.new_empty(B, T, H, 2, M) for _ in range(2))
    part = q.new_empty(B, H, T // C, 4, M, dtype=torch.float32)
    rub, _, _ = sc.scan(q, b, pw, decay, C, c=da, rev=True)
    rgb, _, _ = sc.scan(do, b, pw, decay, C, c=a, rev=True)
    o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    grads = dict(a=a, da=da, ub=ub, gb=gb, rub=rub, rgb=rgb, dq=dq, dk=dk, dv=dv, part=part)
    out = {"fwd": lambda plan: ro.readout_fwd(q, k, v, ub, gb, b, pw, o, C, plan=plan),
           "bwd_a": lambda plan: ro.readout_bwd_a(q, k, v, do, ub, gb, b, pw, C, a=a, da=da, part=part, plan=plan)}
    for which in ro.GRAD_PARTS:
        out[f"bwd_{which}"] = lambda plan, which=which: ro.readout_grad(which, q, k, v, do, b, pw, C, **grads,
                                                                        plan=plan)
    _, _, _, fwd_starts, kept = interdomain_fwd(q, k, v, decay, b, chunk_size=C,
                                                plan=dataclasses.replace(DEFAULT_PLAN, keep_states=True))
    totals = {"fwd total": lambda plan: interdomain_fwd(q, k, v, decay, b, chunk_size=C, plan=plan),
              "bwd total": lambda plan: interdomain_bwd(q, k, v, decay, b, None, None, do, None, None, C, fwd_starts,
                                                        plan=plan, kept=kept if plan.keep_states else (None, None))}
    starts = sc.scan(k, b, pw, decay, C)[2]
    scans = {"scan": lambda plan: sc.scan(k, b, pw, decay, C, plan=plan),
             "scan from starts": lambda plan: sc.scan(k, b, pw, decay, C, starts=starts, plan=plan),
             "scan rev per-token": lambda plan: sc.scan(q, b, pw, decay, C, c=da, rev=True, plan=plan)}
    return out, scans, totals


def breakdown(T, M, C=64, plan=DEFAULT_PLAN):
    """Milliseconds of each launch of fwd+bwd under `plan` (the scans segmented and not), and the totals."""
    launches, scans, totals = _launches(T, M, C)
    out = {name: time_ms(lambda fn=fn: fn(plan)) for name, fn in launches.items()}
    for seg in (plan.scan_segment, 0):
        seg_plan = dataclasses.replace(plan, scan_segment=seg)
        for name, fn in scans.items():
            if seg == 0 and name == "scan from starts":
                continue
            out[f"{name} segment={seg}"] = time_ms(lambda fn=fn: fn(seg_plan))
    out.update({name: time_ms(lambda fn=fn: fn(plan)) for name, fn in totals.items()})
    return {k: round(x, 3) for k, x in out.items()}


def sweep(T=2048, M=32, plan=DEFAULT_PLAN):
    """Each launch once more: milliseconds, and the registers and spilled bytes of the GPU's own build (the offline
    --compile-report build differs from it)."""
    rows = []
    launches, _, _ = _launches(T, M)
    for name, fn in launches.items():
        r = {"T": T, "kernel": name, "warps": plan.warps(name), "ms": round(time_ms(lambda: fn(plan)), 3)}
        kern = fn(plan)  # Triton returns the compiled kernel it launched
        rows.append(dict(r, regs=kern.n_regs, spills=kern.n_spills))
    print(format_table(rows), flush=True)
    return rows


def scan_sweep(M=32, C=64, Ts=(4096, 8192, 16384, 65536)):
    """Milliseconds of one const-b forward scan and one per-token reverse scan against T, segment length (0:
    unsegmented) and state tile, segmentation forced on whatever the row count."""
    rows = []
    for T in Ts:
        B = TOKENS // T
        z = torch.rand(B, T, H, D, device="cuda").bfloat16()
        c = torch.rand(B, T, H, 2, M, device="cuda").bfloat16()
        decay = torch.stack((-torch.rand(H, M, device="cuda") * 0.2, torch.rand(H, M, device="cuda")), -1)
        b = torch.randn(H, M, 2, device="cuda")
        pw = sc.powers(decay, C)
        for seg in (0, 8, 16, 32, 64):
            for tile in ((32, 64), (32, 32), (16, 64)):
                plan = dataclasses.replace(DEFAULT_PLAN, scan_tile=tile, scan_segment=seg,
                                           scan_segment_below=1 << 30, scan_segment_above=0)
                const = time_ms(lambda: sc.scan(z, b, pw, decay, C, plan=plan))
                rev = time_ms(lambda: sc.scan(z, b, pw, decay, C, c=c, rev=True, plan=plan))
                rows.append({"T": T, "seg": seg, "tile": f"{tile[0]}x{tile[1]}", "const_ms": round(const, 3),
                             "rev_ms": round(rev, 3)})
    print(format_table(rows), flush=True)
    return rows


PAPER_SHAPES = ((12, 64), (32, 64))  # (heads, head dim): the paper's 125M and 1.3B, K = V = R = M = 64
PAPER_M = 64


def paper_rows(Ts, budget_s, start, plan=DEFAULT_PLAN):
    """Ours (full readout, M = 64) against causal SDPA (cuDNN, flash) at each paper shape and T, fwd+bwd; each row
    also shows SDPA-cuDNN's time over ours (>= 1: ours faster) and the cost model's floor."""
    rows, mm_peak, bw_peak = [], matmul_peak_tflops(), copy_peak_tbps()
    for heads, dim in PAPER_SHAPES:
        f_f, f_fb, b_f, b_fb = cost_model(PAPER_M, K=dim, V=dim)
        f_fb += 2 * 12 * PAPER_M**2  # the readout: 4 M^2 forward and 8 M^2 bwd_a multiply-adds per token and head
        floor = max(TOKENS * heads * f_fb / (mm_peak * 1e12), TOKENS * heads * b_fb / (bw_peak * 1e12)) * 1e3
        for T in Ts:
            if time.time() - start > budget_s:
                print(f"skipped {heads}x{dim} T={T}: over the time budget", flush=True)
                continue
            ours_ms = ours(T, PAPER_M, heads=heads, dim=dim, readout=True, plan=plan)
            cudnn = sdpa(T, "cudnn", heads, dim)
            flash = sdpa(T, "flash", heads, dim)
            rows.append({"shape": f"{heads}x{dim}", "T": T, "ours_fwd_ms": ours_ms[0], "ours_fwdbwd_ms": ours_ms[1],
                         "ours_peak_MiB": ours_ms[2], "cudnn_fwdbwd_ms": cudnn[1], "flash_fwdbwd_ms": flash[1],
                         "cudnn/ours": cudnn[1] / ours_ms[1], "floor_fwdbwd_ms": floor,
                         "ours/floor": ours_ms[1] / floor})
            print(format_table(rows[-1:]), flush=True)
            torch.cuda.empty_cache()
    return rows, {"matmul_peak_tflops": round(mm_peak, 1), "copy_peak_tbps": round(bw_peak, 2)}


def paper_breakdown(T=4096, heads=12, dim=64, iters=5, plan=DEFAULT_PLAN):
    """Milliseconds per fwd+bwd of each kernel (benchutil.kernel_ms: CUDA time by kernel name, summed over its
    launches in one step, averaged over `iters` steps) at a paper shape: where the time of the readout path goes."""
    fwd, leaves = _inputs_and_fwd(T, PAPER_M, plan=plan, heads=heads, dim=dim, readout=True)
    do = torch.randn_like(fwd())

    def step():
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(fwd(), do)

    return kernel_ms(step, iters)


def plan_from(pairs: list):
    """DEFAULT_PLAN with KEY=VALUE fields changed (ints, or true / false)."""
    fields = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        known = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else None)
        if not hasattr(DEFAULT_PLAN, key) or known is None:
            raise SystemExit(f"--plan {pair}: write FIELD=VALUE with an int or bool field of InterdomainPlan")
        fields[key] = known
    return dataclasses.replace(DEFAULT_PLAN, **fields)


def _measure(fwd, fb, leaves=None):
    """Forward and forward+backward milliseconds and the peak memory. The inputs' .grad is reset before each timed
    backward: in a model q, k, v come out of projections and nothing accumulates into them, while adding into the
    leaves' .grad costs three 256 MiB read-add-writes, for SDPA's as for ours (the "grads accumulated" row)."""
    with torch.no_grad():
        t_f = time_ms(fwd)
    t_fb = time_ms(fb, grad_to_none=leaves) if fb is not None else float("nan")
    mem = peak_memory_mib(fb if fb is not None else fwd)
    return t_f, t_fb, mem


def sdpa(T, backend, heads=H, dim=D):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B = TOKENS // T
    q, k, v = (torch.randn(B, heads, T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def fwd():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    do = torch.randn(B, heads, T, dim, device="cuda", dtype=torch.bfloat16)
    return _measure(fwd, lambda: torch.autograd.backward(fwd(), do), [q, k, v])


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


def decode_step(B, M):
    """Microseconds of one interdomain_step call (one token, B rows, H heads, K = V = 128, bf16), and of its kernel
    replayed from a CUDA graph (no host work: what a graph-captured decode loop pays)."""
    from megahybrid_kernels.interdomain.recurrent import interdomain_recurrent_fwd

    q, k, v = (torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    decay = torch.stack((-torch.rand(H, M, device="cuda") * 0.2, torch.rand(H, M, device="cuda")), -1)
    b = torch.randn(H, M, 2, device="cuda")
    state = (torch.zeros(B, H, M, 2, D, device="cuda"), torch.zeros(B, H, M, 2, D, device="cuda"))
    call = time_ms(lambda: interdomain_step(q[:, 0], k[:, 0], v[:, 0], decay, b, state)) * 1e3
    interdomain_recurrent_fwd(q, k, v, decay, b, state, False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        interdomain_recurrent_fwd(q, k, v, decay, b, state, False)
    return round(call, 1), round(time_ms(graph.replay) * 1e3, 1)


def jobs_for(Ts, only_ours):
    jobs = [("interdomain C=64", T, 32, lambda T=T: ours(T, 32)) for T in Ts]
    jobs += [("breakdown", T, 32, lambda T=T: breakdown(T, 32)) for T in (2048, 65536)]
    # the previous build: every tile padded to 64 (the plain forward)
    wide = dataclasses.replace(DEFAULT_PLAN, gpu_min_tile=(64, 64))
    jobs += [("interdomain C=64 64-mode tiles", T, 32, lambda T=T: ours(T, 32, plan=wide))
             for T in Ts if T in (2048, 8192)]
    jobs += [("interdomain C=64 grads accumulated", 2048, 32, lambda: ours(2048, 32, accumulate=True))]
    jobs += [("breakdown 64-mode tiles", 2048, 32, lambda: breakdown(2048, 32, plan=wide))]
    unseg = dataclasses.replace(DEFAULT_PLAN, scan_segment=0)
    jobs += [("interdomain C=64 unsegmented scans", T, 32, lambda T=T: ours(T, 32, plan=unseg))
             for T in Ts if T >= 65536]
    jobs += [("interdomain C=64", T, 64, lambda T=T: ours(T, 64)) for T in Ts]
    if not only_ours:
        jobs += [(f"sdpa-{be}", T, "-", lambda T=T, be=be: sdpa(T, be)) for be in ("flash", "cudnn") for T in Ts]
        jobs += [("fla-gdn fwd", T, "-", lambda T=T: fla_gdn(T)) for T in Ts]
    return jobs


def model_rows():
    mm_peak, bw_peak = matmul_peak_tflops(), copy_peak_tbps()
    rows, model = [], {}
    for M in (32, 64):
        f_f, f_fb, b_f, b_fb = cost_model(M)
        model[f"M={M}"] = [round(x / 1e3, 1) for x in (f_f, f_fb, b_f, b_fb)]
        th = TOKENS * H
        floor_f = max(th * f_f / (mm_peak * 1e12), th * b_f / (bw_peak * 1e12)) * 1e3
        floor_fb = max(th * f_fb / (mm_peak * 1e12), th * b_fb / (bw_peak * 1e12)) * 1e3
        rows.append({"op": "model C=64", "T": "any", "M": M, "fwd_ms": floor_f, "fwdbwd_ms": floor_fb,
                     "fwd_Mtok/s": TOKENS / floor_f / 1e3, "fwdbwd_Mtok/s": TOKENS / floor_fb / 1e3,
                     "peak_MiB": float("nan")})
    extra = {"cost_model_kflop_kB_per_token_head (fwd, fwd+bwd FLOP; fwd, fwd+bwd bytes)": model,
             "matmul_peak_tflops": round(mm_peak, 1), "copy_peak_tbps": round(bw_peak, 2)}
    return rows, extra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T in {2K, 8K} only (with --paper: 4K, 16K)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip the remaining rows after this many seconds")
    ap.add_argument("--only-ours", action="store_true", help="skip the SDPA and fla rows")
    ap.add_argument("--compile-report", action="store_true",
                    help="offline sm_90 resources of the scan and readout kernels (no GPU)")
    ap.add_argument("--scan-sweep", action="store_true", help="scan time against segment length and state tile")
    ap.add_argument("--sweep", action="store_true", help="each launch with the GPU build's registers and spills")
    ap.add_argument("--once", action="store_true", help="one fwd+bwd at T = 2K, M = 32 (profile_interdomain.sh)")
    ap.add_argument("--paper", action="store_true",
                    help="the paper's shapes (12 x 64 and 32 x 64, M = 64, full readout) against SDPA, 2K to 64K")
    ap.add_argument("--plan", nargs="*", default=[], metavar="KEY=VALUE",
                    help="with --paper: InterdomainPlan fields to change (results in interdomain-paper-plan.*)")
    args = ap.parse_args()
    if args.paper:
        plan = plan_from(args.plan)
        rows, extra = paper_rows([4096, 16384] if args.quick else [2048, 4096, 16384, 65536], args.budget_s,
                                 time.time(), plan)
        extra["shape"] = f"B*T={TOKENS}, K=V=R=M=64, bf16, full readout C; SDPA causal at the same heads"
        extra["kernel ms per fwd+bwd, 12 x 64, T = 4096 (torch.profiler)"] = paper_breakdown(plan=plan)
        if args.plan:
            extra["plan"] = " ".join(args.plan)
        print(extra)
        print(save_results("interdomain-paper-plan" if args.plan else "interdomain-paper", rows, extra))
        return
    if args.once:
        torch.autograd.backward(_inputs_and_fwd(2048, 32)[0](), torch.ones(TOKENS // 2048, 2048, H, D, device="cuda",
                                                                         dtype=torch.bfloat16))
        torch.cuda.synchronize()
        return
    if args.compile_report:
        compile_report()
        return
    if args.scan_sweep:
        print(save_results("interdomain-scan-sweep", scan_sweep(), {"shape": f"B*T={TOKENS}, H={H}, D={D}, M=32"}))
        return
    if args.sweep:
        shape = {"shape": f"B*T={TOKENS}, H={H}, K=V={D}, M=32, bf16"}
        print(save_results("interdomain-sweep", sweep(), shape))
        return
    start = time.time()
    Ts = [2048, 8192] if args.quick else [2048, 4096, 8192, 16384, 65536]
    rows, extra = [], {}
    for name, T, M, fn in jobs_for(Ts, args.only_ours):
        if time.time() - start > args.budget_s:
            print(f"skipped {name} T={T} M={M}: over the time budget", flush=True)
            continue
        try:
            res = fn()
            if name.startswith("breakdown"):
                print(f"{name} ms T={T} M={M}:", res, flush=True)
                extra[f"{name} ms T={T} M={M}"] = res
                continue
            rows.append(row(name, T, M, res))
            print(format_table(rows[-1:]), flush=True)
        except Exception as e:  # a backend missing on this GPU must not lose the other rows
            print(f"{name} T={T} M={M} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()
    extra["decode step us, call and graph replay (B=1, 16, 128; M=32)"] = [decode_step(B, 32) for B in (1, 16, 128)]
    more_rows, more = model_rows()
    rows += more_rows
    extra.update(more, plan=dataclasses.asdict(DEFAULT_PLAN),
                 shape=f"B*T={TOKENS}, H={H}, K=V={D}, bf16; model rows = max(FLOP, byte) floor per token-head")
    print(format_table(rows))
    print(extra)
    print(save_results("interdomain", rows, extra))


if __name__ == "__main__":
    main()
