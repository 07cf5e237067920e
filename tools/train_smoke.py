"""A few `megahybrid train` steps per mixer pattern, eager and compiled, all at once (one process each): the
losses, or the error line of a run that fails. The quick look before tests/test_train_gpu.py's assertions.

    python tools/train_smoke.py                       # S I D N G INSG at the 125M head dims, 1024 tokens
    python tools/train_smoke.py --patterns N --preset tiny --seq 128     # CPU
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "SMOKE "


def child(pattern: str, compile_: bool, preset: str, seq: int) -> None:
    sys.path.insert(0, ROOT)
    from tests.test_train_gpu import _train

    with tempfile.TemporaryDirectory() as run_dir:
        steps = _train(0, 1, pattern, compile_, run_dir, preset, seq)
    print(MARK + json.dumps([[round(s["loss"], 4), s["skip"]] for s in steps]), flush=True)


def spawn(script: str, child: list[str], args) -> subprocess.Popen:
    """`script --child CHILD... --preset --seq` as a one-rank process of its own (a CUDA fault stays in it)."""
    from tests.dist import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.abspath(script), "--child", *child, "--preset", args.preset, "--seq", str(args.seq)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def launch(pattern: str, compile_: bool, args) -> subprocess.Popen:
    return spawn(__file__, [pattern, str(int(compile_))], args)


def outcome(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return f"timeout after {timeout:.0f} s"
    for line in out.splitlines():
        if line.startswith(MARK):
            return line[len(MARK):]
    errors = [line for line in out.splitlines() if "Error" in line or "error:" in line]
    return "FAILED: " + (errors or out.strip().splitlines()[-1:] or ["no output"])[-1][:400]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", nargs="+", default=["S", "I", "D", "N", "G", "INSG"])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1] == "1", args.preset, args.seq)
        return 0
    sys.path.insert(0, ROOT)
    procs = {(p, c): launch(p, c, args) for p in args.patterns for c in (False, True)}
    results = {key: outcome(proc, args.timeout_s) for key, proc in procs.items()}
    for (pattern, compile_), result in results.items():
        print(f"{pattern:6s} compile={str(compile_):5s} {result}")
    return 0 if not any(r.startswith(("FAILED", "timeout")) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
