"""Where an `I` layer call's time goes: each piece of the 125M `I` mixer timed alone, forward + backward, compiled as
`megahybrid train` compiles it, at one training micro-batch (bf16, 8 x 4096 tokens by default).

The 125M training profile (tools/results/bench_train.md, session 9) puts `I`'s layer call 2.0 ms above `S`'s in the
op and 2.7 ms above it in elementwise work (short conv, RoPE, feature map, head norms, casts). These rows split the
latter: the whole mixer, the input path (projection to the op's q, k~, v~), the same with the fused Triton input
kernels (kernels/interdomain_input: projection, then one op for conv, RoPE, xi and norms), the projection alone,
and each elementwise piece on tensors of the shape it sees (q and k together where both take it), plus the op.
Each row: median ms of forward + backward with CUDA events, gradients reset between runs (not timed).
`--pattern D` splits the S4D baseline's mixer the same way (issue #12: `D` as fast as `I`; at 1440cd6 125M `D`
trained at 180.2K tok/s against `I`'s 227.9K): its input path (projection, short conv of a and b, head norms; no
RoPE, no feature map), the contraction chunked (the default) and by FFT, and the output projection.

    python tools/bench_interdomain_pieces.py [--pattern I|D] [--preset 125m] [--batch 8] [--seq 4096] [--eager]
    python tools/bench_interdomain_pieces.py --preset tiny --batch 1 --seq 128 --eager   # CPU smoke run
Results: tools/results/interdomain-pieces.{json,md} (`D`: s4d-pieces; date, GPU, commit).
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from benchutil import format_table, save_results, time_ms  # noqa: E402
from megahybrid.distributed import init_distributed, shutdown  # noqa: E402
from megahybrid.model.config import preset  # noqa: E402
from megahybrid.model.gpt import build_model  # noqa: E402
from megahybrid.model.mixers.interdomain import InterdomainMixer, feature_map, rope  # noqa: E402
from megahybrid.model.mixers.shortconv import causal_depthwise_conv  # noqa: E402
from megahybrid.parallel import ParallelLayout  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run (tests), timed with perf_counter


def leaf(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_()


def timed_ms(step, leaves) -> float:
    if DEVICE == "cuda":
        return time_ms(step, grad_to_none=leaves)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fwd_bwd(fn, inputs, params=()):
    """A step that runs fn(*inputs) and backpropagates random output gradients (drawn once)."""
    outs = fn(*inputs)  # with autograd: which outputs have a gradient (the graph is dropped unused)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    grads = [torch.randn_like(o) for o in outs if torch.is_tensor(o) and o.requires_grad]
    del outs

    def step():
        got = fn(*inputs)
        got = got if isinstance(got, (tuple, list)) else (got,)
        torch.autograd.backward([o for o in got if torch.is_tensor(o) and o.requires_grad], grads)

    return step, [*inputs, *params]


def fused_input_path(inputs, hidden):
    """The `I` input path through the fused kernels (model.interdomain.fused_input), whatever the layer's option;
    CPU tensors run the op's torch definition (kernels/interdomain_input/naive.py)."""
    x, _ = inputs.proj(hidden)
    x = x.transpose(0, 1).reshape(x.shape[1], x.shape[0], inputs.dims.n_local, -1)
    return inputs._fused(x, None, 0)[0]


def _common(mixer: InterdomainMixer, B: int, T: int, convolved: str, normed: str):
    """The hidden input, a builder of op rows, and the rows both mixers have (the whole mixer, the input projection,
    the short conv, the head norms, the output projection) by kind; convolved / normed name their segments."""
    d, inputs = mixer.dims, mixer.inputs
    hidden = leaf(T, B, mixer.config.hidden_size)
    parts, _ = inputs(hidden, None, 0)
    op_in = [p.detach().requires_grad_() for p in parts.values()]
    decay, b = (t.detach() for t in mixer.core.discretized())
    norms = list(inputs.norms.values())

    def op_row(name, readout):
        return name, lambda *p: readout(dict(zip(parts, p)), decay, b, None)[0], op_in, list(readout.parameters())

    rows = {
        "mixer": ("mixer (all of it)", lambda x: mixer.mix(x)[0], [hidden], list(mixer.parameters())),
        "proj": ("input projection alone", lambda x: inputs.proj(x)[0], [hidden], list(inputs.proj.parameters())),
        "conv": (f"short conv of {convolved}",
                 lambda x: causal_depthwise_conv(x, inputs.conv.reshape(-1, d.conv_size))[0],
                 [leaf(B, T, d.n_local * inputs.conv_width)], [inputs.conv]),
        "norm": (f"head norm + bias of {normed}", lambda x, y: (norms[0](x).to(x.dtype), norms[1](y).to(y.dtype)),
                 [leaf(B, T, d.n_local, d.R), leaf(B, T, d.n_local, d.dh)], [p for n in norms for p in n.parameters()]),
        "out": ("output projection", lambda x: mixer.out(x)[0], [leaf(T, B, d.n_local * mixer.readout.out_width())],
                list(mixer.out.parameters())),
    }
    return hidden, op_row, rows


def pieces(mixer: InterdomainMixer, B: int, T: int):
    """(name, fn, inputs, params) per row: fn takes the inputs and returns tensors to backpropagate through."""
    inputs, H, R = mixer.inputs, mixer.dims.n_local, mixer.dims.R
    hidden, op_row, c = _common(mixer, B, T, "q and k", "k~ and v")
    return [
        c["mixer"],
        ("input path (proj, conv, RoPE, xi, norms)", lambda x: tuple(inputs(x, None, 0)[0].values()), [hidden],
         list(inputs.parameters())),
        ("input path, fused kernel", lambda x: tuple(fused_input_path(inputs, x).values()), [hidden],
         list(inputs.parameters())),
        c["proj"],
        c["conv"],
        ("RoPE of q and k", lambda x: rope(x, 0, inputs.rope_base), [leaf(B, T, 2 * H, R)], []),
        ("feature map of q and k", lambda x: feature_map(x).to(torch.bfloat16), [leaf(B, T, 2 * H, R)], []),
        c["norm"],
        op_row("op (interdomain_attention)", mixer.readout),
        c["out"],
    ]


def s4d_pieces(mixer: InterdomainMixer, B: int, T: int):
    """pieces() for the `D` mixer (GenericInput without a query, ContractionReadout), its contraction both ways."""
    inputs = mixer.inputs
    hidden, op_row, c = _common(mixer, B, T, "a and b", "a and b")
    fft = copy.copy(mixer.readout)  # shares C; only the contraction differs
    fft.contraction = "fft"
    return [
        c["mixer"],
        ("input path (proj, conv, norms)", lambda x: tuple(inputs(x, None, 0)[0].values()), [hidden],
         list(inputs.parameters())),
        c["proj"],
        c["conv"],
        c["norm"],
        op_row(f"op (contraction {mixer.readout.contraction})", mixer.readout),
        op_row("op (contraction fft)", fft),
        c["out"],
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default="I", choices=("I", "D"), help="the mixer to split")
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--eager", action="store_true", help="do not torch.compile the pieces")
    parser.add_argument("--results-dir", default=None, help="default tools/results")
    args = parser.parse_args()
    layout = init_distributed(ParallelLayout()).layout
    cfg = preset(args.preset, pattern=args.pattern, seq_length=args.seq, num_layers=1)
    model = build_model(cfg, layout, "bf16")
    mixer = next(m for m in model.modules() if isinstance(m, InterdomainMixer))
    rows = []
    for name, fn, inputs, params in (pieces if args.pattern == "I" else s4d_pieces)(mixer, args.batch, args.seq):
        step, leaves = fwd_bwd(fn if args.eager else torch.compile(fn), inputs, params)
        ms = timed_ms(step, leaves)
        rows.append({"piece": name, "fwd+bwd ms": ms, "per 65K tokens ms": ms * 65536 / (args.batch * args.seq)})
        print(format_table(rows[-1:]), flush=True)
    print(format_table(rows))
    name = "interdomain-pieces" if args.pattern == "I" else "s4d-pieces"
    print(save_results(name, rows, {"preset": args.preset, "pattern": args.pattern, "batch": args.batch,
                                    "seq": args.seq, "compiled": not args.eager}, args.results_dir))
    shutdown()


if __name__ == "__main__":
    main()
