"""tools/check_hopper_compile.py: every op's kernels compile for sm_90 without a GPU (the Triton
interpreter, which runs the other kernel tests here, accepts code the GPU compiler refuses), and a compile error
comes back as a failing case with its one-line cause."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_hopper_compile.py"
# a helper returning [BM, C] and [C, BM] tiles from one constexpr branch: what the GPU refused on 2026-12-06
BROKEN_HELPER = '''
import triton
import triton.language as tl


@triton.jit
def _tile(rows, om, TRANS: tl.constexpr):
    if TRANS:
        return rows[None, :] + om[:, None]
    return rows[:, None] + om[None, :]


@triton.jit
def _kernel(x_ptr, BM: tl.constexpr, C: tl.constexpr):
    offs = _tile(tl.arange(0, C), tl.arange(0, BM), True)
    tl.store(x_ptr + offs, tl.zeros([BM, C], dtype=tl.float32))
'''


def _run(*args, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)


@pytest.mark.timeout(1600)
def test_every_case_compiles_for_hopper():
    r = _run(str(TOOL), "--quick", "--jobs", "2")  # two processes: the same cases and table as one
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    head = r.stdout.splitlines()[0]
    assert head.startswith("sm_90, T = 300: 40 cases"), head
    for kernel in ("readout._fwd_kernel", "readout._fwd_mixed_kernel", "readout._bwd_a_kernel",
                   "readout._bwd_a_mixed_kernel", "readout._bwd_part_kernel", "scan._scan_kernel",
                   "recurrent._fused_recurrent_fwd_kernel", "s4d_chunk._carry_kernel", "fused._fwd_kernel",
                   "fused._bwd_kernel", "chunk._bwd_dkdv_kernel", "chunk._fwd_h_kernel",
                   "chunk._fwd_h_one_chunk_kernel", "wy._kkt_inv_kernel", "wy._bwd_wy_kernel"):
        assert kernel in r.stdout, f"{kernel} was not compiled:\n{r.stdout}"


def test_a_compile_error_is_reported_as_a_failed_case(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN_HELPER)
    script = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT / 'tools')!r}]\n"
              "import torch, check_hopper_compile as c, broken\n"
              "c.OPS = {'broken': lambda *a: broken._kernel[(1,)](torch.empty(64 * 32), BM=32, C=64)}\n"
              "sys.exit(c.main(['--quick']))\n")
    r = _run("-c", script)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED broken bf16 K=64 V=64 M=64: CompilationError at `offs = _tile(" in r.stdout, r.stdout
    assert "Inconsistent return types" in r.stdout


def test_refuses_the_interpreter():
    r = _run(str(TOOL), interpret=True)
    assert r.returncode == 1 and "unset TRITON_INTERPRET" in r.stderr, r.stderr
