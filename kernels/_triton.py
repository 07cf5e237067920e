"""Host-side helpers every op in kernels/ shares: where a call runs, and tile sizes.

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
