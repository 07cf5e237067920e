"""Which kernel and launch setting of the selected-attention op goes wrong at a head-dim pair (issue #14: bf16 at
q/k 96, v 192 failed the GPU test while fp32 passed). For each setting, changed for one kernel at a time, prints
the relative RMS error of o (forward kernel), dq (dq kernel) and dk, dv, dkeep (dk/dv kernel) against the fp32
reference, so a wrong value points at one kernel and one setting that serves it. Usage (GPU):
    python tools/probe_nats_attention.py --dims 96x192 128x256 64x128
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megahybrid_kernels.nats.attention import chunk as attn  # noqa: E402
from megahybrid_kernels.nats.attention import naive_chunk_selected_attention  # noqa: E402
from tools.bench_nats_attention import rel_err  # noqa: E402
from tools.benchutil import format_table  # noqa: E402

VARIANTS = [("base", {})] + [
    (f"{kernel}:{name}", {kernel: change})
    for kernel in ("fwd", "dkdv", "dq")
    for name, change in (("w8", {"num_warps": 8}), ("s2", {"num_stages": 2}), ("s1", {"num_stages": 1}))
]


def make_inputs(Dk, Dv, dtype, B=2, T=300, H=3, C=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, H, d, generator=g).cuda().to(dtype) for d in (Dk, Dk, Dv, Dv))
    keep = (torch.rand(B, H, -(-T // C), generator=g) < 0.4).float().cuda()
    return q, k, v, keep, do


def outputs(fn, q, k, v, keep, do):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, keep)]
    o = fn(*leaves)
    return (o, *torch.autograd.grad(o, leaves, do))


def probe(Dk, Dv, dtype):
    inputs = make_inputs(Dk, Dv, dtype)
    ref = outputs(naive_chunk_selected_attention, *(x.float() for x in inputs))
    base = {k: dict(v) for k, v in attn.GPU_CONFIG.items()}
    rows = []
    for name, change in VARIANTS:
        for kernel, opt in base.items():
            attn.GPU_CONFIG[kernel] = {**opt, **change.get(kernel, {})}
        row = {"dims": f"{Dk}x{Dv}", "dtype": str(dtype).split(".")[-1], "variant": name}
        try:
            out = outputs(attn.chunk_selected_attention, *inputs)
            torch.cuda.synchronize()
            row.update({n: f"{rel_err(a, b):.1e}" for n, a, b in zip(("o", "dq", "dk", "dv", "dkeep"), out, ref)})
        except Exception as e:  # a setting that does not compile or fit is reported, not fatal
            row["o"] = f"{type(e).__name__}: {str(e)[:60]}"
        rows.append(row)
        print(row, flush=True)
    attn.GPU_CONFIG.update(base)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", default=["96x192"], help="DKxDV pairs")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    args = parser.parse_args()
    rows = []
    for dims in args.dims:
        Dk, Dv = map(int, dims.split("x"))
        for dtype in args.dtypes:
            rows += probe(Dk, Dv, getattr(torch, dtype))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
