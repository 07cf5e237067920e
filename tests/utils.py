"""Shared test helpers: relative-RMS comparison, NaN-poisoned buffers, device selection."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none found)")


def rel_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| computed in float64 (0 when both are all zero)."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().item()
    num = (a - e).norm().item()
    if denom == 0.0:
        return num
    return num / denom


def assert_close(actual, expected, tol: float, name: str = "tensor") -> None:
    """Fail when the relative RMS error exceeds `tol` (NaN or Inf in `actual` always fails)."""
    err = rel_rms_error(actual, expected)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > tolerance {tol:.1e}"


def test_device() -> str:
    """'cuda' when present, else 'cpu' (Triton kernels then run under TRITON_INTERPRET=1)."""
    return "cuda" if HAS_CUDA else "cpu"


test_device.__test__ = False


class nan_poisoned_empty:
    """Within this context torch.empty / empty_like / new_empty return NaN-filled float tensors.

    Kernels allocate their outputs with these, so any element a kernel forgets to write stays NaN and
    the comparison fails. Integer and bool tensors are returned unchanged (they cannot hold NaN).
    """

    def __enter__(self):
        self._saved = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
        empty, empty_like, new_empty = self._saved

        def _fill(t):
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            return t

        torch.empty = lambda *a, **k: _fill(empty(*a, **k))
        torch.empty_like = lambda *a, **k: _fill(empty_like(*a, **k))
        torch.Tensor.new_empty = lambda self, *a, **k: _fill(new_empty(self, *a, **k))
        return self

    def __exit__(self, *exc):
        torch.empty, torch.empty_like, torch.Tensor.new_empty = self._saved
        return False


@pytest.fixture
def nan_empty():
    with nan_poisoned_empty():
        yield


def subprocess_pythonpath() -> str:
    """The repository first, then what the caller's PYTHONPATH already holds (the GPU machine's wheels and the
    megahybrid_kernels link live there: tools/gpu_env.sh)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
