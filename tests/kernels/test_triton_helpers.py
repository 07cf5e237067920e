"""kernels/_triton.py: the shared-memory stage fallback, with a stand-in for a Triton kernel; the one fp32 dot
precision every op's kernels take."""
import glob
import os
import re

import pytest
import torch
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


def test_dot_precision_per_op(monkeypatch):
    """Half inputs keep Triton's default; fp32 gets exact products in the interpreter and each op's measured choice
    on the GPU, which MEGAHYBRID_FP32_DOT overrides (how tools/bench_dot_precision.py compares the choices), except
    with a choice measured to fault that op's kernels."""
    half, full = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert (_triton.dot_precision(half, "gdn"), _triton.dot_precision(full, "gdn")) == ("tf32", "ieee")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(_triton.FP32_DOT_ENV, raising=False)
    assert [_triton.dot_precision(full, op) for op in ("interdomain", "attention", "gdn")] == \
        ["tf32x3", "tf32x3", "tf32"]
    monkeypatch.setenv(_triton.FP32_DOT_ENV, "ieee")
    assert (_triton.dot_precision(full, "gdn"), _triton.dot_precision(half, "gdn")) == ("ieee", "tf32")
    monkeypatch.setenv(_triton.FP32_DOT_ENV, "tf32x3")
    assert _triton.dot_precision(full, "attention") == "tf32x3"
    with pytest.raises(ValueError, match="MEGAHYBRID_FP32_DOT=tf32x3: the gdn kernels fault .*choose tf32$"):
        _triton.dot_precision(full, "gdn")
    monkeypatch.setenv(_triton.FP32_DOT_ENV, "fp64")
    with pytest.raises(ValueError, match="MEGAHYBRID_FP32_DOT='fp64': choose one of tf32, tf32x3, ieee"):
        _triton.dot_precision(full, "interdomain")


def test_every_kernel_dot_names_its_precision():
    """A tl.dot without input_precision takes Triton's default (TF32 for fp32 operands, ~1e-3): the GDN kernels
    did, while the other ops used fp32-exact products."""
    root = os.path.dirname(os.path.abspath(_triton.__file__))
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    unnamed = []
    for path in files:
        text = open(path).read()
        for match in re.finditer(r"tl\.dot\(", text):
            depth, end = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            if "input_precision=" not in text[match.end():end]:
                unnamed.append(f"{os.path.relpath(path, root)}:{text.count(chr(10), 0, match.start()) + 1}")
    assert len(files) > 10 and not unnamed, unnamed
