"""Host-side helpers every op in kernels/ shares: where a call runs, fp32 dot precision, and tile sizes.

Three places a call can run: the Triton kernels on a GPU; the same kernels in Triton's interpreter on the CPU
(`TRITON_INTERPRET=1`, what the kernel tests use); or an op's torch chunk implementation, which plain CPU
tensors get (Triton has no CPU backend, and the interpreter is far too slow to train with).
"""
import os

import torch
import triton


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in the interpreter (read per call, so tests can switch it)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_torch_path(x: torch.Tensor) -> bool:
    """CPU tensors run the op's torch chunk implementation unless the interpreter is asked for."""
    return x.device.type == "cpu" and not interpreting()


def absent(like: torch.Tensor) -> torch.Tensor:
    """The stand-in a custom op returns for a tensor a case has not (a custom op cannot return None): a fresh empty
    fp32 tensor on like's device (fresh each time: an op's returns may not alias one another)."""
    return like.new_empty(0, dtype=torch.float32)


def present(t: torch.Tensor | None) -> torch.Tensor | None:
    """None for None or an `absent` stand-in, else t."""
    return None if t is None or t.numel() == 0 else t


# tl.dot's input_precision for fp32 operands on the GPU, in every op. tf32x3 (three TF32 products per dot, error
# ~1e-6 relative) runs on tensor cores; "ieee" (full fp32 FMA) took minutes to build for the Interdomain readout
# kernels; plain "tf32" (~1e-3) is too coarse for the fp32 reference checks. tools/bench_dot_precision.py measures
# the three per op (error against the fp32 reference, time, build time) into tools/results/dot-precision.md.
FP32_DOT_DEFAULT = "tf32x3"
FP32_DOT_CHOICES = ("tf32", "tf32x3", "ieee")
FP32_DOT_ENV = "MEGAHYBRID_FP32_DOT"  # a process-wide override, so that the benchmark compares the choices


def dot_precision(t: torch.Tensor) -> str:
    """tl.dot input_precision for operands of t's dtype. Half types: "tf32", Triton's default, which only affects
    the dots whose operands are fp32 intermediates (kept as they were built and measured). fp32 inputs: exact
    "ieee" in the interpreter (numpy computes it anyway), FP32_DOT_DEFAULT on the GPU unless MEGAHYBRID_FP32_DOT
    names another choice."""
    if t.dtype != torch.float32:
        return "tf32"
    if interpreting():
        return "ieee"
    choice = os.environ.get(FP32_DOT_ENV, FP32_DOT_DEFAULT)
    if choice not in FP32_DOT_CHOICES:
        raise ValueError(f"{FP32_DOT_ENV}={choice!r}: choose one of {', '.join(FP32_DOT_CHOICES)}")
    return choice


def next_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= n and >= lo (tile widths; tl.dot needs at least 16)."""
    return max(lo, triton.next_power_of_2(n))


# (kernel name, tile widths, dtype) -> the pipeline depth that fits this GPU's shared memory, found by the first
# launch of that shape: each stage keeps one more set of tiles in flight, and wide head dims run out first.
_FITTING_STAGES: dict[tuple, int] = {}


def launch_fitting_stages(kernel, grid, args: tuple, kwargs: dict, key: tuple, op: str) -> None:
    """kernel[grid](*args, **kwargs) with kwargs["num_stages"], or the deepest pipeline below it that fits the
    shared memory (Triton raises OutOfResources when it loads the compiled kernel, before anything runs, so
    retrying is safe); none fitting is a one-line ValueError."""
    from triton.runtime.errors import OutOfResources

    key = (kernel.fn.__name__, *key)
    stages = _FITTING_STAGES.get(key, kwargs["num_stages"])
    while True:
        try:
            kernel[grid](*args, **{**kwargs, "num_stages": stages})
            _FITTING_STAGES[key] = stages
            return
        except OutOfResources as e:
            if stages == 1:
                raise ValueError(f"{op}: head dims {key[1:]} do not fit this GPU's shared memory "
                                 f"({str(e).splitlines()[0]}); use smaller heads") from None
            stages -= 1
