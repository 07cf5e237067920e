"""kernels/_triton.py: the shared-memory stage fallback, with a stand-in for a Triton kernel."""
import pytest
from triton.runtime.errors import OutOfResources

from megahybrid_kernels import _triton


class FakeKernel:
    """kernel[grid](*args, **kw) that needs at most `fits` stages, recording each launch's stages."""

    def __init__(self, name: str, fits: int):
        self.fn = type("Fn", (), {"__name__": name})
        self.fits, self.launches = fits, []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kw):
            self.launches.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(300_000, 232_448, "shared memory")
        return launch


def test_falls_back_to_the_deepest_pipeline_that_fits_and_remembers_it(monkeypatch):
    monkeypatch.setattr(_triton, "_FITTING_STAGES", {})
    kernel = FakeKernel("wide", fits=2)
    for _ in range(2):
        _triton.launch_fitting_stages(kernel, (1,), (), {"num_stages": 4, "BD": 256}, (256, "bf16"), "op")
    assert kernel.launches == [4, 3, 2, 2]  # the second launch of that shape goes straight to 2 stages


def test_no_fitting_pipeline_is_a_one_line_value_error(monkeypatch):
    monkeypatch.setattr(_triton, "_FITTING_STAGES", {})
    with pytest.raises(ValueError, match=r"^op: head dims \(512, 'fp32'\) do not fit this GPU's shared memory") as e:
        _triton.launch_fitting_stages(FakeKernel("huge", fits=0), (1,), (), {"num_stages": 2}, (512, "fp32"), "op")
    assert "\n" not in str(e.value)
