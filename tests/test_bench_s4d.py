"""tools/bench_s4d.py as a CPU smoke run: the check and every eager form of the S4D contraction run forward and
backward next to the Interdomain op and get a time; the numbers that matter come from the GPU."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_form_runs_on_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench_s4d.py"), "--smoke", "--results-dir", str(tmp_path),
           "--chunk-sizes", "32,64,128", "--profile"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.load(open(tmp_path / "bench_s4d.json"))
    assert record["meta"]["check"]["ok"] is True, record["meta"]["check"]
    ops = {r["op"]: r for r in record["rows"]}
    assert list(ops) == ["I (op, 16 + 16, readout C)", "D fft", "D chunked-32", "D chunked-64", "D chunked-128"]
    assert all(r["fwdbwd_ms"] > 0 and "error" not in r and "note" not in r for r in ops.values()), ops
    kernels = record["meta"]["kernels of chunked-32, 2 heads, T = 256 (ms per call)"]
    assert kernels["all kernels"] > 0 and len(kernels) > 2, kernels
