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


class tf32_products:
    """torch's TF32 switch for float32 matrix products (cuBLAS on the GPU), on inside the block only: the host-side
    products of the CP shard summaries (tf32_bmm), whose 16-bit inputs are exact in TF32 (megahybrid.model.cp)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


@torch.library.custom_op("megahybrid::tf32_bmm", mutates_args=())
def tf32_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [N, I, K] @ b [N, K, J] in fp32 (either may be 16-bit: cast first) on the TF32 tensor cores. A custom op
    because torch.compile traces tf32_products' switch only while tracing: the compiled products ran in full fp32
    (cuBLAS's non-tensor-core kernels), whatever the block said; as an op the switch is set where it runs."""
    with tf32_products():
        return torch.bmm(a.float(), b.float())


@tf32_bmm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)


# tl.dot's input_precision for fp32 operands on the GPU, per op, chosen by tools/bench_dot_precision.py on the H200
# (tools/results/dot-precision.md: error of the output and every gradient against the op's fp32 reference, time,
# cold build time). tf32x3 (three TF32 products per dot) matches "ieee" to ~1e-5 for interdomain and ~6e-7 for the
# selected attention, runs as fast or faster and builds 4x sooner; plain "tf32" errs ~2e-3. The GDN kernels keep
# "tf32", Triton's default, the build every earlier GPU check verified: with tf32x3, Triton 3.6 on Hopper builds
# _fwd_h_kernel into an illegal memory access at every head size (measured at 6e98327).
FP32_DOT_DEFAULT = {"interdomain": "tf32x3", "attention": "tf32x3", "gdn": "tf32"}
FP32_DOT_CHOICES = ("tf32", "tf32x3", "ieee")
FP32_DOT_FAULTS = {"gdn": ("tf32x3",)}  # choices measured to fault on the GPU, refused with a one-line error
FP32_DOT_ENV = "MEGAHYBRID_FP32_DOT"  # a process-wide override, so that the benchmark compares the choices


def dot_precision(t: torch.Tensor, op: str) -> str:
    """tl.dot input_precision for `op`'s operands of t's dtype. Half types: "tf32", Triton's default, which only
    affects the dots whose operands are fp32 intermediates (kept as they were built and measured). fp32 inputs:
    exact "ieee" in the interpreter (numpy computes it anyway), FP32_DOT_DEFAULT[op] on the GPU unless
    MEGAHYBRID_FP32_DOT names another choice."""
    if t.dtype != torch.float32:
        return "tf32"
    if interpreting():
        return "ieee"
    choice = os.environ.get(FP32_DOT_ENV, FP32_DOT_DEFAULT[op])
    if choice not in FP32_DOT_CHOICES:
        raise ValueError(f"{FP32_DOT_ENV}={choice!r}: choose one of {', '.join(FP32_DOT_CHOICES)}")
    if choice in FP32_DOT_FAULTS.get(op, ()):
        raise ValueError(f"{FP32_DOT_ENV}={choice}: the {op} kernels fault on the GPU with it (Triton 3.6, "
                         f"tools/results/dot-precision.md); unset it or choose {FP32_DOT_DEFAULT[op]}")
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
