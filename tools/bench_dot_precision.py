"""The fp32 dot precision every op's Triton kernels use (issue #11): tf32, tf32x3 and ieee compared per op.

Each op runs fp32 forward + backward at one shape with MEGAHYBRID_FP32_DOT set to each choice, in a fresh process
with an empty Triton cache (so that build_s is the cold compile and autotune time a user's first step pays):
  err_max   the largest relative RMS error among the output and every gradient, against the op's fp32 reference
            (naive.py on the same GPU, torch matmuls without TF32);
  fwd_bwd_ms  median forward + backward time (CUDA events);
  build_s   the first call's wall time.
kernels/_triton.py's FP32_DOT_DEFAULT holds the choice per op these rows justify. fp32 inputs are what the kernel
tests and a model.precision=fp32 run pass; bf16 training is unaffected (its dots keep Triton's default).

    python tools/bench_dot_precision.py                 # GPU: three ops x three choices, writes dot-precision.{json,md}
    python tools/bench_dot_precision.py --ops gdn --choices tf32x3 --T 128    # one row
"""
import argparse
import os
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)

OPS = ("interdomain", "attention", "gdn")


def _rand(*shape, scale=1.0, device):
    import torch

    return (torch.randn(*shape, device=device) * scale).requires_grad_()


def interdomain_case(B, T, H, D, device):
    """The layer's call: a complex readout C near the identity, decays with memories of 5-1000 tokens."""
    import torch
    from megahybrid_kernels.interdomain import interdomain_attention, interdomain_attention_naive

    M = 32
    q, k = _rand(B, T, H, D, scale=D ** -0.5, device=device), _rand(B, T, H, D, scale=D ** -0.5, device=device)
    v = _rand(B, T, H, D, device=device)
    decay = torch.stack((-torch.logspace(-3, -0.7, M, device=device).expand(H, M), torch.rand(H, M, device=device)),
                        -1).contiguous().requires_grad_()
    b = _rand(H, M, 2, device=device)
    eye = torch.eye(M, device=device).expand(H, M, M)
    readout = (torch.stack((eye, torch.zeros_like(eye)), -1) + 0.05 * torch.randn(H, M, M, 2, device=device))
    readout = readout.contiguous().requires_grad_()
    inputs = [q, k, v, decay, b, readout]
    return (inputs, lambda: interdomain_attention(q, k, v, decay, b, readout=readout)[0],
            lambda: interdomain_attention_naive(q, k, v, decay, b, readout=readout)[0])


def _keep(B, H, T, device):
    import torch

    keep = (torch.rand(B, H, -(-T // 64), device=device) < 0.5).float()
    keep[..., 0] = 1.0
    return keep


def attention_case(B, T, H, D, device):
    from megahybrid_kernels.nats.attention import chunk_selected_attention, naive_chunk_selected_attention

    q, k, v = (_rand(B, T, H, D, device=device) for _ in range(3))
    keep = _keep(B, H, T, device)
    return ([q, k, v], lambda: chunk_selected_attention(q, k, v, keep),
            lambda: naive_chunk_selected_attention(q, k, v, keep))


def gdn_case(B, T, H, D, device):
    import torch
    import torch.nn.functional as F
    from megahybrid_kernels.nats.gdn import chunk_selected_gdn, naive_chunk_selected_gdn

    q, k, v = (_rand(B, T, H, D, device=device) for _ in range(3))
    g = (-torch.rand(B, T, H, device=device) * 0.1).requires_grad_()
    beta = torch.rand(B, T, H, device=device).requires_grad_()
    keep = _keep(B, H, T, device)

    def unit(x):
        return F.normalize(x, dim=-1)

    return ([q, k, v, g, beta], lambda: chunk_selected_gdn(unit(q), unit(k), v, g, beta, keep)[0],
            lambda: naive_chunk_selected_gdn(unit(q), unit(k), v, g, beta, keep)[0])


CASES = {"interdomain": interdomain_case, "attention": attention_case, "gdn": gdn_case}


def fwd_bwd(inputs, run, do):
    for x in inputs:
        x.grad = None
    out = run()
    out.backward(do)
    return [out.detach()] + [x.grad.detach().clone() for x in inputs]


def run_child(op: str, args) -> dict:
    """One (op, choice) row in this process; the choice is MEGAHYBRID_FP32_DOT."""
    import torch

    from benchutil import time_ms
    from megahybrid_kernels._triton import dot_precision

    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32-exact reference
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    inputs, run, naive = CASES[op](args.B, args.T, args.H, args.D, device)
    with torch.no_grad():
        do = torch.randn_like(run())
    t0 = time.perf_counter()
    got = fwd_bwd(inputs, run, do)
    if device == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    ref = fwd_bwd(inputs, naive, do)
    errors = [((a.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30)).item()
              for a, e in zip(got, ref)]
    ms = time_ms(lambda: fwd_bwd(inputs, run, do), grad_to_none=inputs) if device == "cuda" else float("nan")
    names = ["o"] + [f"d{i}" for i in range(len(inputs))]
    return {"op": op, "choice": dot_precision(inputs[0].detach(), op), "shape": f"{args.B}x{args.T}x{args.H}x{args.D}",
            "err_max": max(errors), "fwd_bwd_ms": ms, "build_s": build_s,
            "errors": " ".join(f"{n}={e:.1e}" for n, e in zip(names, errors))}


def run_row(op: str, choice: str, argv: list, timeout: float) -> dict:
    """A fresh process with an empty Triton cache, so that build_s is a cold build."""
    from benchutil import child_row

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, MEGAHYBRID_FP32_DOT=choice, TRITON_CACHE_DIR=cache)
        found, status, _ = child_row([sys.executable, os.path.abspath(__file__), *argv, "--child", op], timeout, env)
    return {**found, "status": "ok"} if found else {"op": op, "choice": choice, "status": status}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"a subset of {','.join(OPS)}")
    parser.add_argument("--choices", default="tf32,tf32x3,ieee", help="MEGAHYBRID_FP32_DOT values to compare")
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--T", type=int, default=512, help="tokens (the fp32 references run token by token)")
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=64, help="head dim of q, k and v")
    parser.add_argument("--row-timeout-s", type=float, default=240.0)
    parser.add_argument("--results-dir", default=None, help="default tools/results")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        from benchutil import print_row

        print_row(run_child(args.child, args))
        return 0
    from benchutil import format_table, save_results
    from megahybrid_kernels._triton import FP32_DOT_CHOICES, FP32_DOT_DEFAULT

    ops, choices = args.ops.split(","), args.choices.split(",")
    if set(ops) - set(OPS) or set(choices) - set(FP32_DOT_CHOICES):
        print(f"error: --ops {args.ops} --choices {args.choices}: choose ops from {','.join(OPS)} and choices from "
              f"{','.join(FP32_DOT_CHOICES)}", file=sys.stderr)
        return 2
    shared = ["--B", str(args.B), "--T", str(args.T), "--H", str(args.H), "--D", str(args.D)]
    rows = []
    for op in ops:
        for choice in choices:
            rows.append(run_row(op, choice, shared, args.row_timeout_s))
            print(format_table(rows[-1:]), flush=True)
            # after every row: a device call that ends mid-way keeps the rows it measured
            path = save_results("dot-precision", rows, {"default": FP32_DOT_DEFAULT}, args.results_dir)
    print(format_table(rows))
    print(f"written {path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
