"""Which part of a mixer's own torch code faults when compiled on the GPU (issue #15). Each run is one process
(a CUDA fault poisons its context): a few compiled `megahybrid train` steps with the mixer module compiled in
full except one piece kept eager (torch.compiler.disable). A piece whose eager run passes while `none` faults is
where the fault is. `module` is the default of `train.compile` (the whole mixer module eager).

    python tools/compile_bisect.py                         # I and G, every piece, in parallel
    python tools/compile_bisect.py --patterns I --preset tiny --seq 128    # CPU
"""
import argparse
import importlib
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.train_smoke import MARK, outcome, spawn  # noqa: E402

# "module:attr" or "module:Class.method", kept eager in turn
PIECES = {
    "I": ["fresh-op-io", "interdomain:S4DCore._discretize", "interdomain:rope", "interdomain:feature_map", "interdomain:HeadNorm.forward",
          "interdomain:causal_depthwise_conv", "interdomain:_Input.forward", "interdomain:InterdomainMixer.mix"],
    "G": ["fresh-op-io", "nats:NatsLayer._conv", "nats:NatsLayer._inputs", "nats:NatsLayer._merge", "nats:_rms",
          "nats:NatsLayer._mix", "nats:NatsLayer.forward"],
}


def fresh_op_io() -> None:
    """Our ops' inputs, outputs and gradients as fresh (16-byte aligned, contiguous) copies: tests whether the
    fault is an inductor graph assuming aligned tensors that an op hands it as views (compiled backward graphs
    take the ops' input gradients as tangents)."""
    import torch

    import megahybrid_kernels.interdomain as interdomain_ops
    from megahybrid.model.mixers import nats

    class Fresh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone(memory_format=torch.contiguous_format)

        @staticmethod
        def backward(ctx, grad):
            return grad.clone(memory_format=torch.contiguous_format)

    def fresh(x):
        return Fresh.apply(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def wrap(op):
        @torch.compiler.disable
        def call(*args, **kwargs):
            out = op(*map(fresh, args), **{k: fresh(v) for k, v in kwargs.items()})
            return tuple(map(fresh, out)) if isinstance(out, tuple) else fresh(out)
        return call

    for owner, name in ((nats, "chunk_selected_gdn"), (nats, "chunk_selected_attention"),
                        (interdomain_ops, "interdomain_attention")):
        setattr(owner, name, wrap(getattr(owner, name)))


def keep_eager(piece: str) -> None:
    import torch

    module_name, attr = piece.split(":")
    owner = importlib.import_module(f"megahybrid.model.mixers.{module_name}")
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, torch.compiler.disable(getattr(owner, name)))


def child(pattern: str, piece: str, preset: str, seq: int) -> None:
    from tests.test_train_gpu import _train

    if piece == "fresh-op-io":
        fresh_op_io()
    elif piece not in ("none", "module", "eager"):
        keep_eager(piece)
    with tempfile.TemporaryDirectory() as run_dir:
        steps = _train(0, 1, pattern, piece != "eager", run_dir, preset, seq, force=piece != "module")
    print(MARK + json.dumps([round(s["loss"], 4) for s in steps]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", nargs="+", default=["I", "G"])
    parser.add_argument("--also", nargs="*", default=["D", "N", "INSG", "S"],
                        help="patterns run only eager and with the default (whole mixer module eager)")
    parser.add_argument("--pieces", nargs="+", default=None, help="of --patterns (default: eager, none, module, "
                        "then each piece kept eager in turn)")
    parser.add_argument("--also-pieces", nargs="+", default=["eager", "module"], help="of --also")
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--timeout-s", type=float, default=300, help="for all runs together")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.preset, args.seq)
        return 0
    runs = [(p, piece) for p in args.patterns for piece in args.pieces or ["eager", "none", "module", *PIECES[p[0]]]]
    runs += [(p, piece) for p in args.also for piece in args.also_pieces]
    procs = {run: spawn(__file__, list(run), args) for run in runs}
    deadline = time.monotonic() + args.timeout_s
    for (pattern, piece), proc in procs.items():
        result = outcome(proc, max(1.0, deadline - time.monotonic()))
        print(f"{pattern:5s} {piece:36s} {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
