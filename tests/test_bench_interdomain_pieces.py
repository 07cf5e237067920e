"""tools/bench_interdomain_pieces.py as a CPU smoke run (the tiny preset, eager): every piece of the `I` mixer runs
forward and backward and gets a time; the numbers that matter come from the GPU."""
import json
import os
import subprocess
import sys

from tests.dist import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *extra):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TRITON_INTERPRET="0")
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench_interdomain_pieces.py"), "--preset", "tiny", "--batch",
           "1", "--seq", "128", "--eager", "--results-dir", str(tmp_path), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_piece_runs_forward_and_backward_on_cpu(tmp_path):
    _run(tmp_path)
    record = json.load(open(tmp_path / "interdomain-pieces.json"))
    assert record["meta"]["compiled"] is False and record["meta"]["seq"] == 128
    pieces = {r["piece"]: r["fwd+bwd ms"] for r in record["rows"]}
    assert len(pieces) == 10 and all(ms > 0 for ms in pieces.values()), pieces
    assert "input path, fused kernel" in pieces
    assert pieces["mixer (all of it)"] > pieces["input projection alone"]


def test_every_piece_of_the_s4d_mixer_runs_on_cpu(tmp_path):
    """--pattern D: the S4D baseline's pieces, its contraction both ways."""
    _run(tmp_path, "--pattern", "D")
    record = json.load(open(tmp_path / "s4d-pieces.json"))
    assert record["meta"]["pattern"] == "D"
    pieces = {r["piece"]: r["fwd+bwd ms"] for r in record["rows"]}
    assert len(pieces) == 8 and all(ms > 0 for ms in pieces.values()), pieces
    assert {"op (contraction chunked)", "op (contraction fft)", "short conv of a and b"} <= set(pieces), pieces
