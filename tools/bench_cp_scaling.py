"""Weak scaling of context parallelism through `megahybrid train` itself (issue #19; 2 GPUs, NCCL).

Per model: one GPU at S tokens per sequence (cp=1) against two GPUs at 2S over cp=2, the same tokens per GPU
(one sequence per step); for comparison tp=2 at 2S; and the correctness check, the first steps' losses of cp=2
against one rank at 2S (same synthetic batches). Step time is the median `time/step_s` of the timed steps in the
run's metrics.jsonl (warm-up steps dropped). The bytes each rank sends per step are the mixer records' count
(`cp_bytes`, printed at start by the trainer too); the target is cp=2 within 1.1x of cp=1 for `I` and `G`.

    python tools/bench_cp_scaling.py          # 2 GPUs: 350m-interdomain, natsl-340m@G, natsl-340m, 32K vs 64K
    python tools/bench_cp_scaling.py --models tiny@I --seq 128 --steps 2 --warmup 1 --results-dir /tmp/r  # CPU
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.benchutil import format_table, save_results  # noqa: E402

DEFAULT_MODELS = ["350m-interdomain", "natsl-340m@G", "natsl-340m"]
LAYOUTS = {"cp1": (1, {}, 1), "cp2": (2, {"cp": 2}, 2), "tp2": (2, {"tp": 2}, 2), "check": (1, {}, 2)}
LOSS_TOL = {"gpu": 2e-2, "cpu": 1e-4}  # relative, per step: bf16 on GPUs, fp32 on CPU (reordered reductions)


def run_config(model: str, seq: int, parallel: dict, steps: int, run_dir: str) -> dict:
    preset, _, pattern = model.partition("@")
    return {
        "run_dir": run_dir,
        "model": {"preset": preset, **({"pattern": pattern} if pattern else {}), "seq_length": seq},
        "parallel": parallel,
        "data": {"synthetic": True},
        "batch": {"global_batch_size": 1, "micro_batch_size": 1},
        "optimizer": {"warmup_steps": 1},
        "train": {"steps": steps},
        "logging": {"interval": 1, "tensorboard": False},
        "eval": {"iters": 0},
        "checkpoint": {"interval": steps + 1},
    }


def launch(model: str, layout: str, args, workdir: str) -> dict:
    """One `megahybrid train` run; its per-step records, or the failure line."""
    world, parallel, scale = LAYOUTS[layout]
    run_dir = os.path.join(workdir, f"{model.replace('@', '_')}-{layout}")
    steps = args.check_steps if layout == "check" else args.warmup + args.steps
    config = os.path.join(workdir, f"{model.replace('@', '_')}-{layout}.yaml")
    Path(config).write_text(json.dumps(run_config(model, args.seq * scale, parallel, steps, run_dir)))
    ranks = ["--nproc-per-node", str(world)] if world > 1 else []
    cmd = [sys.executable, "-m", "megahybrid", "train", *ranks, "--config", config]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {args.run_timeout_s:.0f} s"}
    if out.returncode:
        lines = [line for line in (out.stderr + out.stdout).splitlines() if "rror" in line] or ["no output"]
        return {"status": f"exit {out.returncode}: {lines[-1][:300]}"}
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return {"status": "ok", "records": records}


def step_ms(result: dict, warmup: int) -> float | str:
    if result["status"] != "ok":
        return ""
    return 1e3 * statistics.median(r["time/step_s"] for r in result["records"] if r["step"] > warmup
                                   and "time/step_s" in r)


def losses(result: dict) -> list[float]:
    return [r["train/loss"] for r in result.get("records", []) if "train/loss" in r]


def model_row(model: str, args, workdir: str, tol: float) -> dict:
    from megahybrid.model.config import preset
    from megahybrid.model.mixers import cp_bytes_per_layer

    results = {layout: launch(model, layout, args, workdir) for layout in LAYOUTS}
    name, _, pattern = model.partition("@")
    cfg = preset(name, **({"pattern": pattern} if pattern else {}), seq_length=2 * args.seq)
    per_layer = cp_bytes_per_layer(cfg, 2, 2)
    times = {layout: step_ms(results[layout], args.warmup) for layout in ("cp1", "cp2", "tp2")}
    cp2, ref = losses(results["cp2"])[:args.check_steps], losses(results["check"])
    gaps = [abs(a - b) / abs(b) for a, b in zip(cp2, ref)]
    ok = len(gaps) == args.check_steps and max(gaps) <= tol
    return {"model": model, "S": args.seq, "cp1_ms": times["cp1"], "cp2_ms@2S": times["cp2"],
            "tp2_ms@2S": times["tp2"],
            "cp2_over_cp1": times["cp2"] / times["cp1"] if "" not in (times["cp1"], times["cp2"]) else "",
            "MiB_sent_per_rank": sum(per_layer[c] for c in cfg.layer_pattern) / 2**20,
            "max_loss_gap": max(gaps) if gaps else "", "check": "ok" if ok else "FAILED",
            "status": "; ".join(f"{k}: {v['status']}" for k, v in results.items() if v["status"] != "ok") or "ok"}


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="PRESET or PRESET@PATTERN")
    parser.add_argument("--seq", type=int, default=32768, help="S: tokens per sequence at cp=1")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped from the timing")
    parser.add_argument("--check-steps", type=int, default=3, help="steps of the loss check at 2S")
    parser.add_argument("--run-timeout-s", type=float, default=300.0)
    parser.add_argument("--results-dir", default=None, help="default tools/results")
    args = parser.parse_args(argv)
    tol = LOSS_TOL["gpu" if torch.cuda.is_available() else "cpu"]
    with tempfile.TemporaryDirectory() as workdir:
        rows = [model_row(model, args, workdir, tol) for model in args.models]
    print(format_table(rows))
    print("saved", save_results("bench_cp_scaling", rows, {"loss_tol": tol, "timed": "median time/step_s after "
                                                           f"{args.warmup} warm-up steps"}, args.results_dir))
    return 0 if all(r["status"] == "ok" and r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
