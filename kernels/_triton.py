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


def next_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= n and >= lo (tile widths; tl.dot needs at least 16)."""
    return max(lo, triton.next_power_of_2(n))
