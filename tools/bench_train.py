"""Training throughput of `megahybrid train`'s own step against a plain-PyTorch Llama of the same shape.

Each row runs in its own process (a clean GPU, one compile cache per model) on random tokens:
  megahybrid  `megahybrid train`'s step (Trainer.queue_step, each step read after the next is queued, as the
              training loop does), DeepSpeed ZeRO-1, fp32 master weights, bf16 on a GPU, data.synthetic=true,
              train.compile=auto, with the row's model.recompute setting;
  baseline    tools/llama_baseline.py: fp32 weights under bf16 autocast, SDPA, fused AdamW, clipping, torch.compile.
Both take `--tokens` tokens per optimizer step (micro-batch x accumulation). `--warmup` steps (which include
torch.compile's compilation) run before the timed window and are reported separately as warmup_s; the window
is `--steps` steps between two device synchronizations. Peak memory is torch's max allocated during the window.

FLOPs per token (megahybrid.train.metrics.flops_per_token, the trainer's own count; recomputation not counted):
    6 * P_matmul + 6 * L_softmax * seq * num_heads * head_dim
P_matmul: q/k/v/o, SwiGLU and LM-head weights (not the embedding lookup); the second term is QK^T and PV over the
causal half of the scores, forward + backward. MFU_989 = TFLOP/s / 989 (H200 bf16 dense datasheet); MFU_meas
uses the bf16 matmul rate measured at the end of the run.

    python tools/bench_train.py                      # GPU: 125m, 350m, 1.3b at 4K + recompute rows at 1.3b
    python tools/bench_train.py --rows tiny:none:2 --seq 128 --tokens 512 --steps 2 --warmup 1   # CPU smoke
    python tools/bench_train.py --rows 125m@I:none:8 --no-baseline --profile 25     # where a row's time goes
    python tools/bench_train.py --rows 125m@I:none:8 125m@I+interdomain.fused_input=true:none:8 --no-baseline
    python tools/bench_train.py --suite mixers --no-baseline    # every mixer at 4K and 16K (MIXER_SUITE)
    python tools/bench_train.py --suite mixers --no-baseline --continue-from tools/results/bench_train.json
    python tools/bench_train.py --compile false --name bench_train-eager    # the eager table, its own file
Rows are PRESET[@PATTERN][+KEY=VALUE...]:RECOMPUTE:MICRO[:SEQ] with KEY=VALUE model-section overrides, or
train-section ones as train.KEY=VALUE (an option compared on and off in one table), RECOMPUTE one of none,
selective, selective_mlp, full and SEQ the row's context (default --seq); every (preset, SEQ) also gets a baseline
row at the micro-batch of its first row. Results: tools/results/NAME.{json,md} (--name, default bench_train; date,
GPU and commit in the meta). --profile N adds two profiled steps per row: the top N kernels (printed) and, as
columns, the profiled step's wall time, its kernel time by group (matmul, attention, optimizer, collectives, copies,
inductor-fused, other: benchutil.KERNEL_GROUPS) and idle_ms, the part of the step no kernel ran (host-bound time),
and one more step's host syncs and allocator retries (benchutil.host_waits; the lines that synced on stderr).
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)

DATASHEET_TFLOPS = 989.0
RECOMPUTE = {
    "none": {},
    "selective": {"recompute": "selective"},
    "selective_mlp": {"recompute": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full": {"recompute": "full"},
}
COLUMNS = ["system", "preset", "recompute", "micro", "gas", "seq", "compile", "tok/s", "TFLOP/s", "MFU_989",
           "MFU_meas", "peak_GiB", "step_s", "warmup_s", "status", "commit", "gpu", "date"]  # where and when measured
# --profile: the profiled steps' wall time, kernel groups per step (benchutil.KERNEL_GROUPS) and time no kernel ran
PROFILE_COLUMNS = ["prof_step_ms", "busy_ms", "idle_ms", "matmul_ms", "attn_ms", "fused_ms", "optim_ms", "copy_ms",
                   "comm_ms", "other_ms", "host_syncs", "alloc_retries"]
DEFAULT_ROWS = ["125m:none:8", "350m:none:8", "1.3b:none:4", "1.3b:selective_mlp:4", "1.3b:full:4"]
# --suite mixers: every mixer in its issue's preset shape, at 4K and 16K (issue #20), 16 x 4096 tokens per step
MIXER_SUITE = [f"{model}:none:{micro}:{seq}" for seq, scale in ((4096, 1), (16384, 4))
               for model, micro4k in (("125m@S", 8), ("125m@I", 8), ("125m@D", 8), ("natsl-340m", 4),
                                      ("natsl-340m@G", 4), ("natsl-340m@N", 4), ("natsl-340m@S", 4))
               for micro in [max(1, micro4k // scale)]]


def plan_rows(specs: list[str], default_seq: int, baseline: bool = True) -> list[dict]:
    """megahybrid rows in the given order, each (preset, seq)'s baseline right after its first row (unless not
    `baseline`). PRESET may carry a pattern, `natsl-340m@G`: the preset's shape with every layer that mixer; SEQ
    (optional, default --seq) is the row's context."""
    rows, seen = [], set()
    for spec in specs:
        fields = spec.split(":")
        if len(fields) not in (3, 4) or fields[1] not in RECOMPUTE:
            raise SystemExit(f"--rows {spec}: want PRESET[@PATTERN]:RECOMPUTE:MICRO[:SEQ], RECOMPUTE one of "
                             f"{', '.join(RECOMPUTE)}")
        preset, recompute, micro, seq = *fields[:3], int(fields[3]) if len(fields) == 4 else default_seq
        rows.append({"system": "megahybrid", "preset": preset, "recompute": recompute, "micro": int(micro),
                     "seq": seq})
        shape = _preset_fields(preset)["preset"]
        if baseline and (shape, seq) not in seen:
            seen.add((shape, seq))
            rows.append({"system": "baseline", "preset": preset, "recompute": "none", "micro": int(micro),
                         "seq": seq})
    return rows


def megahybrid_step(row: dict, args, run_dir: str):
    from megahybrid.train.config import from_dict
    from megahybrid.train.trainer import Trainer, make_plan

    sections = _row_sections(row["preset"])
    # compile_cache torch: each row's warm-up as the suites measured it (the run directory here is temporary)
    cfg = from_dict({
        "run_dir": run_dir,
        "model": {**sections["model"], "seq_length": row["seq"], **RECOMPUTE[row["recompute"]]},
        "data": {"synthetic": True},
        "batch": {"global_batch_size": args.tokens // row["seq"], "micro_batch_size": row["micro"]},
        "optimizer": {"warmup_steps": 1, **sections["optimizer"]},
        "train": {"steps": _total_steps(args), "compile": {"auto": "auto", "true": True, "all": True, "false": False}[
            args.compile], "compile_cache": "torch", **sections["train"]},
        "logging": {"tensorboard": False},
        "eval": {"iters": 0},
    })
    if args.compile == "all":  # the mixers' own torch code compiled too, not kept eager (issue #15)
        import megahybrid.train.trainer as trainer_module

        trainer_module.eager_mixers = lambda pattern: ""
    trainer = Trainer(make_plan(cfg, 1))
    batches = iter(trainer.loader)
    compiled = "all" if args.compile == "all" else trainer.compiled
    return _read_one_late(trainer, batches), trainer.plan.model, compiled, trainer.gas


def _read_one_late(trainer, batches):
    """A step as `megahybrid train` runs one between logging intervals: queued, then the previous step read."""
    pending = []

    def step():
        pending.append(trainer.queue_step(batches))
        if len(pending) > 1:
            trainer.conclude(pending.pop(0))

    return step


def _total_steps(args) -> int:
    return args.warmup + args.steps + (2 if args.profile else 0)


def _preset_fields(spec: str) -> dict:
    """`NAME[@PATTERN][+KEY=VALUE...]` as model-section fields (KEY relative to the model section; `train.` and
    `optimizer.` keys go to those sections, _row_sections)."""
    return _row_sections(spec)["model"]


ROW_SECTIONS = ("train", "optimizer")  # override prefixes a row spec may name; any other key is the model's


def _row_sections(spec: str) -> dict:
    """A row spec's sections: `+train.compile_scope=layers` and `+optimizer.clip_on_device=false` go to their
    sections, any other `+KEY=VALUE` to the model's."""
    from megahybrid.train.config import apply_override

    head, *overrides = spec.split("+")
    name, _, pattern = head.partition("@")
    raw = {"model": {"preset": name, **({"pattern": pattern} if pattern else {})}, "train": {}, "optimizer": {}}
    for item in overrides:
        apply_override(raw, item if item.partition(".")[0] in ROW_SECTIONS else f"model.{item}")
    return raw


def baseline_step(row: dict, args):
    import torch

    from llama_baseline import BaselineTrainer
    from megahybrid.data.loader import MicroBatchLoader
    from megahybrid.model.config import preset
    from megahybrid.train.data import RandomTokens

    cfg = preset(_preset_fields(row["preset"])["preset"], seq_length=row["seq"])
    global_batch = args.tokens // row["seq"]
    gas = global_batch // row["micro"]
    compiled = torch.cuda.is_available() if args.compile == "auto" else args.compile in ("true", "all")
    trainer = BaselineTrainer(cfg, row["micro"], gas, compiled, "cuda" if torch.cuda.is_available() else "cpu")
    data = RandomTokens(global_batch * _total_steps(args), row["seq"], cfg.vocab_size, seed=1234)
    batches = iter(MicroBatchLoader(data, global_batch, row["micro"]))
    return (lambda: trainer.step(batches)), cfg, compiled, gas


def measure(step, warmup: int, steps: int) -> dict:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warm = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {"warmup_s": warm, "step_s": elapsed / steps, "peak_GiB": peak}


def run_child(row: dict, args) -> dict:
    from megahybrid.distributed import shutdown
    from megahybrid.train.metrics import flops_per_token

    with tempfile.TemporaryDirectory() as run_dir:
        if row["system"] == "megahybrid":
            step, cfg, compiled, gas = megahybrid_step(row, args, run_dir)
        else:
            step, cfg, compiled, gas = baseline_step(row, args)
        timing = measure(step, args.warmup, args.steps)
        if args.profile:
            timing.update(print_profile(step, args.profile, f"{row['system']} {row['preset']}"))
        shutdown()
    tok_s = args.tokens // row["seq"] * row["seq"] / timing["step_s"]
    tflops = flops_per_token(cfg) * tok_s / 1e12
    return {**row, "gas": gas, "compile": compiled, "tok/s": tok_s, "TFLOP/s": tflops,
            "MFU_989": tflops / DATASHEET_TFLOPS, **timing, "status": "ok"}


def print_profile(step, top: int, title: str) -> dict:
    """Where the step's time goes: the `top` kernels by device time over two profiled steps (on stderr, which
    the parent prints), so a missed target comes with its profile. Returns the kernel groups per step
    (benchutil.kernel_groups) with the profiled step's wall time and `idle_ms`, the part no kernel ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchutil import host_waits, kernel_groups

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(2):
            step()
        sync()
        wall_ms = (time.perf_counter() - start) / 2 * 1e3
    events = prof.key_averages()
    sort = "device_time_total" if cuda else "self_cpu_time_total"
    print(f"profile of 2 steps: {title}", file=sys.stderr)
    print(events.table(sort_by=sort, row_limit=top, max_name_column_width=70), file=sys.stderr)
    groups = kernel_groups({e.key: e.device_time_total if cuda else e.self_cpu_time_total for e in events}, 2)
    groups.update(prof_step_ms=round(wall_ms, 2), idle_ms=round(wall_ms - groups["busy_ms"], 2))
    print("kernel groups (ms per step): " + ", ".join(f"{k} {v}" for k, v in groups.items()), file=sys.stderr)
    waits = host_waits(step)
    print(f"host waits of one step: {waits}", file=sys.stderr)
    return {**groups, "host_syncs": waits["host_syncs"], "alloc_retries": waits["alloc_retries"]}


def _child_env() -> dict:
    from megahybrid.cli import _free_port, default_torch_extensions_dir

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("TORCH_EXTENSIONS_DIR", default_torch_extensions_dir())
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return env


def run_row(row: dict, argv: list[str], timeout: float) -> dict:
    """One row in a fresh process; a failure or timeout becomes the row's status (the other rows still run)."""
    from benchutil import child_row

    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", json.dumps(row)]
    found, status, stderr = child_row(cmd, timeout, _child_env())
    if found is None:
        if stderr:
            print(stderr[-4000:], file=sys.stderr)
        return {**row, "status": status}
    start = stderr.find("profile of 2 steps")
    if start >= 0:
        print(stderr[start:], file=sys.stderr)
    return found


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="PRESET[@PATTERN]:RECOMPUTE:MICRO[:SEQ] ...")
    parser.add_argument("--suite", choices=["mixers"], default=None, help="instead of --rows: MIXER_SUITE")
    parser.add_argument("--seq", type=int, default=4096, help="context of rows without their own SEQ")
    parser.add_argument("--tokens", type=int, default=16 * 4096, help="tokens per optimizer step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--compile", choices=["auto", "true", "all", "false"], default="auto",
                        help="train.compile; all: also the mixer modules train.compile=true keeps eager")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall time for all rows; later rows skip")
    # 300: a compiled 125m@I row's warm-up (compile and Triton autotuning) took 156-163 s on a fresh H200
    parser.add_argument("--row-timeout-s", type=float, default=300.0, help="wall time for one row")
    parser.add_argument("--results-dir", default=None, help="default tools/results")
    parser.add_argument("--name", default="bench_train",
                        help="the result's family: writes NAME.json and NAME.md there (bench_train-eager, "
                             "bench_train-natsl: the eager tables)")
    parser.add_argument("--continue-from", default=None, metavar="JSON",
                        help="an earlier results file: its ok rows are kept, not run again")
    parser.add_argument("--no-baseline", action="store_true", help="megahybrid rows only")
    parser.add_argument("--profile", type=int, default=0, help="print each row's top-N kernels (2 steps)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _shared_argv(args) -> list[str]:
    return ["--seq", str(args.seq), "--tokens", str(args.tokens), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--compile", args.compile,
            *(["--profile", str(args.profile)] if args.profile else [])]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        from benchutil import print_row

        print_row(run_child(json.loads(args.child), args))
        return 0
    from benchutil import format_table, gpu_model, gpu_name, save_results
    from megahybrid.outputs import git_commit

    here, card, today = git_commit(), gpu_model(gpu_name()), datetime.date.today().isoformat()
    deadline = time.monotonic() + args.budget_s
    specs = MIXER_SUITE if args.suite == "mixers" else args.rows
    earlier = _finished_rows(args.continue_from)
    done = []
    for row in plan_rows(specs, args.seq, baseline=not args.no_baseline):
        if _row_key(row) in earlier:
            done.append(earlier[_row_key(row)])
            continue
        left = deadline - time.monotonic()
        timeout = min(left, args.row_timeout_s)
        result = run_row(row, _shared_argv(args), timeout) if left > 10 else {**row, "status": "skipped: budget"}
        result.update(commit=here, gpu=card, date=today)
        done.append({column: result.get(column, "") for column in COLUMNS + (PROFILE_COLUMNS if args.profile else [])})
        print(format_table([done[-1]]), flush=True)
        save_results(args.name, done, _meta(None), args.results_dir)
    fresh = [r for r in done if _row_key(r) not in earlier]  # kept rows keep the MFU of their own call's peak
    peak = _add_measured_mfu(fresh)
    if peak is not None and len(fresh) < len(done):
        peak = f"{peak} (this call's; kept rows' MFU_meas use their own call's peak: {_kept_peaks(done, fresh)})"
    path = save_results(args.name, done, _meta(peak), args.results_dir)
    print(format_table(done))
    print(f"written {path}")
    return 0 if all(r["status"] == "ok" for r in done) else 1


def _row_key(row: dict) -> tuple:
    return tuple(row[k] for k in ("system", "preset", "recompute", "micro", "seq"))


def _finished_rows(path: str | None) -> dict:
    """The ok rows of an earlier results file (--continue-from), by row: a suite longer than one call's time
    limit runs over several calls, each timing the rows the earlier ones did not. Each keeps the commit, card and
    date it was measured at (rows of files older than those columns: the file's)."""
    from benchutil import gpu_model

    if path is None:
        return {}
    try:
        record = json.loads(open(path).read())
        rows, commit = record["rows"], record["meta"].get("commit", "")
        card, date = gpu_model(record["meta"].get("gpu", "")), record["meta"].get("date", "")
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise SystemExit(f"error: --continue-from {path}: not a bench_train results file ({err})") from None
    return {_row_key(r): {**r, "commit": r.get("commit") or commit, "gpu": r.get("gpu") or card,
                          "date": r.get("date") or date} for r in rows if r.get("status") == "ok"}


def _meta(peak) -> dict:
    return {"timed": "warm-up steps (incl. compile) excluded",
            "flops_per_token": "megahybrid.train.metrics.flops_per_token (3 x forward; mixers from their records)",
            "matmul_peak_tflops": peak}


def _kept_peaks(done: list[dict], fresh: list[dict]) -> str:
    """Each kept call's matmul peak, as its rows imply it (TFLOP/s / MFU_meas): 'commit card peak, ...'."""
    peaks = {}
    for row in done:
        if row not in fresh and row.get("MFU_meas") not in ("", None, 0):
            peaks.setdefault((row["commit"], row["gpu"]), round(row["TFLOP/s"] / row["MFU_meas"], 1))
    return ", ".join(f"{commit} {card} {peak}" for (commit, card), peak in peaks.items()) or "none recorded"


def _add_measured_mfu(rows: list[dict]):
    import torch

    if not torch.cuda.is_available():
        return None
    from benchutil import matmul_peak_tflops

    peak = round(matmul_peak_tflops(), 1)
    for row in rows:
        if row["TFLOP/s"] != "":
            row["MFU_meas"] = row["TFLOP/s"] / peak
    return peak


if __name__ == "__main__":
    sys.exit(main())
