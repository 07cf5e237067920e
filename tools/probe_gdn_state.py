"""One change at a time to the selected-GDN forward state kernel (issue #14), each in its own process (a fault on
the H200 poisons the CUDA context), checked against the stock kernel and timed.

`_fwd_h_kernel` (kernels/nats/gdn/chunk.py) runs one chunk after another per (V tile, batch x head): at the 128K
prefill of natsl-340m (B x H = 6, 96 programs) it took 111 of the compiled Hybrid's 415 ms of kernels. Two tries
that changed several things at once faulted on the H200 while passing the interpreter (kernels/nats/README.md), so
each variant here changes one thing:
  stock        the autotuned kernel as shipped (the reference for values and time);
  base         this file's copy of its program, no switch on (must equal stock in values and time);
  nobranch     the state update without the `keep != 0` branch (m folded into the weights);
  hoist        the k tile and the chunk's decays loaded at the top of the loop body;
  loop-s2      the chunk loop as tl.range(NT, num_stages=2) (Triton's software pipelining of the loads);
each at num_warps 4 and stages 1 / 2 / 3 (launch settings; the kernel's autotune list has (4, 1), (4, 2), (8, 2)).

    python tools/probe_gdn_state.py                      # GPU: every variant, prefill and training shapes, bf16
    TRITON_INTERPRET=1 python tools/probe_gdn_state.py --shapes tiny --dtypes fp32   # CPU: the values only
Results: tools/results/gdn-state-probe.{json,md}.
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)
from megahybrid_kernels._triton import dot_precision, interpreting  # noqa: E402
from megahybrid_kernels.nats.gdn import chunk as gdn  # noqa: E402
from megahybrid_kernels.nats.gdn.tiles import _chunk_scalars, _ld, _ld_t, _ld_vec, _st  # noqa: E402
from megahybrid_kernels.nats.gdn.wy import _recompute_wu, _wy_fwd  # noqa: E402

# name: (B, T, H, K, V); prefill = natsl-340m's GDN heads at 128K, train = its 4 x 4K micro-batch
SHAPES = {"prefill": (1, 131072, 6, 128, 256), "train": (4, 4096, 6, 128, 256), "tiny": (1, 300, 2, 32, 64)}
VARIANTS = {"base": {}, "nobranch": {"NO_BRANCH": True}, "hoist": {"HOIST": True}, "loop-s2": {"LOOP_STAGES": 2}}
STAGES = (1, 2, 3)
TOL = {"fp32": 1e-5, "bf16": 1e-2}  # relative RMS against the stock kernel: same math, another instruction order


@triton.jit
def _probe_fwd_h_kernel(k, w, u, G, keep, h, v_new, ht, T, NT: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY_DROPPED: tl.constexpr,
                        PREC: tl.constexpr, NO_BRANCH: tl.constexpr, HOIST: tl.constexpr,
                        LOOP_STAGES: tl.constexpr):
    """kernels/nats/gdn/chunk.py's _fwd_h_program without an initial state, always storing the final state, with
    the switches above; LOOP_STAGES 0 leaves the loop's stages to the launch's num_stages."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    v_new += (bos * H + i_h) * V
    G += bos * H + i_h
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    b_h = tl.zeros([BK, BV], tl.float32)
    for i_t in tl.range(NT, num_stages=LOOP_STAGES if LOOP_STAGES > 0 else None):
        _st(h + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V, ck, cv, K, V, V, b_h)
        r = i_t * 64 + tl.arange(0, 64)
        if HOIST:
            b_kt = _ld_t(k, r, ck, T, K, H * K)
            b_G = _ld_vec(G, r, T, H)
        b_w = _ld(w, r, ck, T, K, H * K)
        b_vn = _ld(u, r, cv, T, V, H * V).to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)
        _st(v_new, r, cv, T, V, H * V, b_vn)
        m, g_last, a = _chunk_scalars(G, keep, i_t * 64, T, i_bh.to(tl.int64) * NT + i_t, H, DECAY_DROPPED)
        b_h *= a
        if NO_BRANCH:
            if not HOIST:
                b_kt = _ld_t(k, r, ck, T, K, H * K)
                b_G = _ld_vec(G, r, T, H)
            b_vd = b_vn * tl.where(r < T, m * tl.exp(g_last - b_G), 0.0)[:, None]
            b_h += tl.dot(b_kt, b_vd.to(b_w.dtype), input_precision=PREC)
        else:
            if m != 0:
                if not HOIST:
                    b_kt = _ld_t(k, r, ck, T, K, H * K)
                    b_G = _ld_vec(G, r, T, H)
                b_vd = b_vn * tl.where(r < T, m * tl.exp(g_last - b_G), 0.0)[:, None]
                b_h += tl.dot(b_kt, b_vd.to(b_w.dtype), input_precision=PREC)
    _st(ht + i_bh.to(tl.int64) * K * V, ck, cv, K, V, V, b_h)


def make_inputs(shape: str, dtype: torch.dtype, device: str, kept: float = 0.1, seed: int = 0):
    """k, w, u, G, keep as the op makes them (the stock WY kernels) from random l2-normalized keys and gates."""
    B, T, H, K, V = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(device, dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(device, dtype)
    g = -torch.nn.functional.softplus(torch.randn(B, T, H, generator=gen) - 3).to(device)
    beta = torch.rand(B, T, H, generator=gen).to(device, dtype)
    keep = (torch.rand(B, H, triton.cdiv(T, 64), generator=gen) < kept).float().to(device)
    G, Ai = _wy_fwd(k, v, g, beta)
    w, u = _recompute_wu(k, v, beta, G, Ai)
    return k, w, u, G, keep


def run_stock(inputs):
    k, w, u, G, keep = inputs
    return lambda: gdn._fwd_h(k, w, u, G, keep, None, True, True)


def run_variant(inputs, switches: dict, warps: int, stages: int):
    k, w, u, G, keep = inputs
    B, T, H, K = k.shape
    V, NT = u.shape[-1], triton.cdiv(T, 64)
    BV = gdn._bv(B * H, V, k.device)
    launch = {} if interpreting() else {"num_warps": warps, "num_stages": stages}
    options = {"NO_BRANCH": False, "HOIST": False, "LOOP_STAGES": 0, **switches, **launch}

    def call():
        h = k.new_empty(B, NT, H, K, V)
        v_new = torch.empty_like(u)
        ht = k.new_empty(B, H, K, V, dtype=torch.float32)
        _probe_fwd_h_kernel[(triton.cdiv(V, BV), B * H)](
            k, w, u, G, keep, h, v_new, ht, T, NT=NT, H=H, K=K, V=V, BK=gdn._state_bk(K, k.device), BV=BV,
            DECAY_DROPPED=True, PREC=dot_precision(k, "gdn"), **options)
        return h, v_new, ht
    return call


def rel_rms(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def child(spec: dict) -> dict:
    """One row: a variant (or stock) at one shape, dtype and launch setting: its largest relative RMS error
    against the stock kernel over h, v' and the final state, and its median time."""
    device = "cpu" if interpreting() else "cuda"
    inputs = make_inputs(spec["shape"], {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]], device)
    reference = run_stock(inputs)()
    if spec["variant"] == "stock":
        call = run_stock(inputs)
    else:
        call = run_variant(inputs, VARIANTS[spec["variant"]], spec["warps"], spec["stages"])
    err = max(rel_rms(x, y) for x, y in zip(call(), reference))
    row = {**spec, "rel_rms": err, "ok": err <= TOL[spec["dtype"]]}
    if device == "cuda":
        from benchutil import time_ms

        row["ms"] = time_ms(call)
    return row


def plan(shapes, dtypes) -> list[dict]:
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            rows.append({"shape": shape, "dtype": dtype, "variant": "stock", "warps": 0, "stages": 0})
            rows += [{"shape": shape, "dtype": dtype, "variant": name, "warps": 4, "stages": s}
                     for name in VARIANTS for s in STAGES]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["train", "prefill"])
    # bf16 by default (what the layers train in; one process per row, 26 rows fit a device call); fp32 on demand
    parser.add_argument("--dtypes", nargs="+", choices=sorted(TOL), default=["bf16"])
    parser.add_argument("--variants", nargs="+", choices=["stock", *VARIANTS], default=None)
    parser.add_argument("--row-timeout-s", type=float, default=120.0)
    parser.add_argument("--results-dir", default=None, help="default tools/results")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from benchutil import child_row, format_table, print_row, save_results

    if args.child:
        print_row(child(json.loads(args.child)))
        return 0
    rows = [r for r in plan(args.shapes, args.dtypes) if args.variants is None or r["variant"] in args.variants]
    done = []
    for spec in rows:
        found, status, _ = child_row([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                                     args.row_timeout_s, dict(os.environ))
        done.append(found if found is not None else {**spec, "status": status})
        print(format_table(done[-1:]), flush=True)
    print(format_table(done))
    if not interpreting():
        print(f"written {save_results('gdn-state-probe', done, None, args.results_dir)}")
    return 0 if all(r.get("ok") for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
