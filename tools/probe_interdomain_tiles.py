"""Which Interdomain kernels run correctly on this GPU with tiles narrower than 64 (issue #3).

Triton 3.6 on the H200 builds some narrow-tile variants wrongly, silently or with an illegal address (the plain
forward at 32-mode tiles, the dq / dk / dv kernels at 32-wide feature tiles), so `InterdomainPlan.gpu_min_tile`
and `.fwd_stack_below` keep the kernels off them. This probe launches each readout.py kernel (the forward in
both forms) alone with a mode tile BM and a feature tile BD of 32 or 64, each in its own process (a fault poisons
the CUDA context), and compares its outputs with the same launch at 64-wide tiles (relative RMS); then, one process
at a time (the builds are cached by then), times the variants that passed. Run it again on a new Triton or GPU
before changing those settings. Usage on the device machine: python tools/probe_interdomain_tiles.py
"""
import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("fwd", "fwd stacked", "bwd_a", "bwd_dq", "bwd_dk", "bwd_dv")
TILES = {"": ((32, 64), (64, 32), (64, 64)), " stacked": ((32, 64), (64, 64))}  # (BM, BD), 64 x 64 the control


def launch_all(kernel, bm, bd, timed=False):
    """Run one kernel with the given tiles after preparing its inputs with the default ones; return its outputs
    (and with `timed`, its milliseconds)."""
    import torch
    import triton

    sys.path.insert(0, str(ROOT))
    from megahybrid_kernels.interdomain import readout as ch
    from megahybrid_kernels.interdomain.scan import powers, scan

    B, T, H, D, M, C = 2, 1000, 3, 128, 32, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", generator=g).bfloat16() for _ in range(4))
    decay = torch.stack((-torch.rand(H, M, device="cuda", generator=g), torch.rand(H, M, device="cuda",
                                                                                  generator=g)), -1)
    b = torch.randn(H, M, 2, device="cuda", generator=g) / M**0.5
    NC = triton.cdiv(T, C)
    pw = powers(decay, C)
    ub, _, _ = scan(k, b, pw, decay, C)
    gb, _, _ = scan(v, b, pw, decay, C)
    a, da = (q.new_zeros(B, T, H, 2, M) for _ in range(2))
    part = q.new_zeros(B, H, NC, 4, M, dtype=torch.float32)
    wide = dict(ch.tiles(q, v, b), BM=64, BK=64, BV=64)
    sizes = dict(wide, BM=bm, BK=bd, BV=bd)
    grid = (NC, B * H)
    ch._bwd_a_kernel[grid](q, k, v, do, ub, gb, b, pw, a, da, part, T, NC, H, M, C=C, **wide)
    rub, _, _ = scan(q, b, pw, decay, C, c=da, rev=True)
    rgb, _, _ = scan(do, b, pw, decay, C, c=a, rev=True)
    if kernel.startswith("fwd"):
        outs = {"o": torch.zeros_like(v)}
        fn = lambda: ch._fwd_kernel[grid](q, k, v, ub, gb, b, pw, outs["o"], T, NC, H, M, C=C, **sizes,  # noqa
                                          STACK=kernel == "fwd stacked")
    elif kernel.startswith("bwd_a"):
        outs = {"a": torch.zeros_like(a), "da": torch.zeros_like(da), "partials": torch.zeros_like(part)}
        fn = lambda: ch._bwd_a_kernel[grid](q, k, v, do, ub, gb, b, pw, *outs.values(), T, NC, H, M, C=C,  # noqa
                                            **sizes)
    else:
        outs = {"dq": torch.zeros_like(q), "dk": torch.zeros_like(k), "dv": torch.zeros_like(v),
                "partials": torch.zeros_like(part)}
        pt = {"bwd_dq": 1, "bwd_dk": 2, "bwd_dv": 4}[kernel.split()[0]]
        fn = lambda: ch._bwd_part_kernel[grid](q, k, v, do, a, da, ub, gb, rub, rgb, b, pw, *outs.values(), T,  # noqa
                                               NC, H, M, C=C, **sizes, PART=pt)
    fn()
    torch.cuda.synchronize()
    if timed:
        from tools.benchutil import time_ms

        return outs, time_ms(fn)
    return outs


def one(kernel, bm, bd, timed):
    """Child process: relative RMS of each output against the 64-wide launch (and milliseconds), as JSON."""
    ref = launch_all(kernel, 64, 64)
    got, ms = launch_all(kernel, bm, bd, timed=True) if timed else (launch_all(kernel, bm, bd), float("nan"))
    err = {}
    for name, x in got.items():
        r = ref[name].double()
        err[name] = float((x.double() - r).norm() / r.norm().clamp_min(1e-30)) if r.norm() > 0 else 0.0
    print(json.dumps({"err": err, "ms": ms}))


def run(kernel, bm, bd, timed=False):
    cmd = [sys.executable, __file__, "--one", kernel, str(bm), str(bd)] + (["--time"] if timed else [])
    row = {"kernel": kernel, "BM": bm, "BD": bd}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return dict(row, result=f"FAILED: {last[:120]}", ms=float("nan"))
    out = json.loads(p.stdout.strip().splitlines()[-1])
    worst = max(out["err"].values()) if out["err"] else 0.0
    return dict(row, result=f"{'ok' if worst < 1e-2 else 'WRONG'} (max rel RMS {worst:.1e})", ms=out["ms"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=3, metavar=("KERNEL", "BM", "BD"))
    ap.add_argument("--time", action="store_true", help="(with --one) also time the launch")
    ap.add_argument("--jobs", type=int, default=12, help="processes of the correctness pass")
    args = ap.parse_args()
    if args.one:
        one(args.one[0], int(args.one[1]), int(args.one[2]), args.time)
        return
    jobs = [(k, bm, bd) for k in KERNELS for bm, bd in TILES[" stacked" if k.endswith("stacked") else ""]]
    with ThreadPoolExecutor(args.jobs) as ex:
        rows = list(ex.map(lambda j: run(*j), jobs))
    for i, r in enumerate(rows):  # timed one at a time: parallel processes would share the GPU
        if r["result"].startswith("ok"):
            rows[i] = run(r["kernel"], r["BM"], r["BD"], timed=True)
    sys.path.insert(0, str(ROOT))
    from tools.benchutil import format_table, save_results

    print(format_table(rows))
    print(save_results("interdomain-tile-probe", rows, {"shape": "B=2, T=1000, H=3, K=V=128, M=32, bf16"}))


if __name__ == "__main__":
    main()
