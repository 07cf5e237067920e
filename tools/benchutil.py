"""Shared timing and reporting helpers for tools/bench_*.py (GPU benchmarks; CUDA events via Triton's do_bench)."""
import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

from megahybrid.outputs import git_commit

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROW_MARK = "BENCH_ROW "  # how a benchmark's child process hands its row to the parent (print_row, child_row)


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_model(name: str) -> str:
    """The card's model from its device name ("NVIDIA H100 80GB HBM3" -> "H100"), for per-row columns: a results
    file continued over several device calls may hold rows from different cards."""
    words = name.replace("NVIDIA", "").split()
    return words[0] if words else name


def time_ms(fn, warmup_ms: float = 50, rep_ms: float = 200, grad_to_none=None) -> float:
    """Median milliseconds of fn() measured with CUDA events (triton.testing.do_bench). grad_to_none: leaf tensors
    whose .grad is reset before each (untimed), so that a backward is timed without accumulating into .grad."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                         return_mode="median"))


def graphed(step):
    """A CUDA-graph replay of step() (captured after three warm-up calls on a side stream), or the reason the
    capture failed, for the row to show (the eager time still stands)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:60]} ({_project_frame(err)})"


def _project_frame(err: Exception) -> str:
    """file:line of the innermost frame of this repository's code in err's traceback (what a failed capture ran)."""
    import traceback

    ours = [(_repo_path(f.filename), f.lineno) for f in traceback.extract_tb(err.__traceback__)]
    ours = [(path, line) for path, line in ours if path is not None]
    return f"{ours[-1][0]}:{ours[-1][1]}" if ours else "no frame of ours"


def _repo_path(filename: str) -> Path | None:
    """filename relative to this repository's root, or None for a file outside it."""
    root, path = Path(__file__).resolve().parents[1], Path(filename).resolve()
    return path.relative_to(root) if path.is_relative_to(root) else None


def peak_memory_mib(fn) -> float:
    """Peak allocated CUDA memory above the pre-call level while running fn() once, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def host_waits(fn, sites: int = 5) -> dict:
    """What in one fn() call makes the GPU wait for the host: the synchronizing CUDA calls (torch's sync debug
    mode; the count and the first `sites` file:line of this repository's code that made them) and the caching
    allocator's retries (each frees cached blocks, a device-wide sync, and allocates again). None without a GPU."""
    if not torch.cuda.is_available():
        return {"host_syncs": None, "sync_sites": [], "alloc_retries": None}
    import warnings

    torch.cuda.synchronize()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = sorted({f"{_repo_path(w.filename) or Path(w.filename).name}:{w.lineno}" for w in syncs})
    return {"host_syncs": len(syncs), "sync_sites": where[:sites],
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries}


def kernel_ms(fn, iters: int = 2, top: int = 25) -> dict:
    """Where fn()'s device time goes: milliseconds per call of its `top` kernels by CUDA time (torch.profiler,
    summed over each kernel's launches, averaged over `iters` calls), largest first, with the total of all.
    Without a GPU (the tools' CPU smoke runs): the ops' own CPU time instead."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        sync()
    return _ranked_ms(prof.key_averages(), cuda, iters, top)


def _ranked_ms(events, cuda: bool, iters: int, top: int) -> dict:
    """kernel_ms's table from profiler key averages: names cut to 70 characters, and the kernels whose cut names
    agree summed (template instances of one elementwise kernel; replacing instead of adding lost half of the
    128K prefill's kernel time in the 2026-12-04 profile)."""
    times = {}
    for event in events:
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and (not cuda or not event.key.startswith(("aten::", "autograd::", "["))):
            key = event.key[:70]
            times[key] = times.get(key, 0.0) + us / iters / 1e3
    ranked = dict(sorted(times.items(), key=lambda kv: -kv[1]))
    return {"all kernels": round(sum(ranked.values()), 3), **{k: round(v, 3) for k, v in list(ranked.items())[:top]}}


# Kernel groups of a step's profile, first match wins: cuBLAS (nvjet/gemm), inductor's matmul templates and the CPU
# matmul ops; flash/cuDNN attention; the optimizer's fused and foreach kernels; collectives; copies and fills;
# inductor's fused pointwise/reduction kernels; the rest (hand-written Triton, unfused aten kernels)
KERNEL_GROUPS = (
    ("matmul", r"nvjet|gemm|cutlass|xmma|cublas|triton_tem_|^aten::(mm|bmm|addmm|matmul|linear)$"),
    ("attn", r"flash|fmha|sdpa|attention|cudnn"),
    ("optim", r"adam|multi_tensor|foreach"),
    ("comm", r"nccl|gloo|allreduce|all_reduce|reduce_scatter|all_gather"),
    ("fused", r"^triton_(poi|red|per)_"),  # before copy: inductor names kernels after their ops (`_to_copy`)
    ("copy", r"memcpy|memset|copy|fill|cat_?array"),
)


def kernel_groups(times_us: dict, steps: int) -> dict:
    """Milliseconds per step of each KERNEL_GROUPS group (and `other`) from {kernel name: microseconds over
    `steps` steps}, with `busy`, their sum: a step profile two systems can be compared by."""
    import re

    groups = {name: 0.0 for name, _ in KERNEL_GROUPS} | {"other": 0.0}
    for kernel, us in times_us.items():
        name = next((g for g, pattern in KERNEL_GROUPS if re.search(pattern, kernel, re.IGNORECASE)), "other")
        groups[name] += us / steps / 1e3
    groups["busy"] = sum(groups.values())
    return {f"{name}_ms": round(ms, 2) for name, ms in groups.items()}


def module_ms(model, fn, kinds: tuple[str, ...]) -> dict:
    """GPU milliseconds of one fn() spent inside the modules of `model` whose class name is in kinds, per class (a
    NatsLayer that selects is "NatsLayer-N"), with their count: CUDA events around each module's forward (hooks),
    so it counts what the profiler may miss (at the 128K prefill its kernels summed to half the measured time)."""
    events, handles = {}, []

    def pre(module, args):
        module._bench_start = torch.cuda.Event(enable_timing=True)
        module._bench_start.record()

    def post(name):
        def hook(module, args, out):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.setdefault(name, []).append((module._bench_start, end))
        return hook

    for module in model.modules():
        name = type(module).__name__
        if name in kinds:
            name += "-N" if getattr(module, "select", False) else ""
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post(name))]
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    return {name: {"count": len(pairs), "ms": round(sum(a.elapsed_time(b) for a, b in pairs), 2)}
            for name, pairs in events.items()}


def matmul_peak_tflops(n: int = 8192) -> float:
    """Measured bf16 matmul rate on random data, the ceiling that MFU is quoted against."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(c for row in rows for c in row))  # every row's keys: later rows may add columns
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def save_results(name: str, rows: list[dict], extra: dict | None = None, results_dir=None) -> Path:
    """Write tools/results/<name>.json and .md (or under results_dir), replacing the benchmark's current result
    (git keeps the earlier ones), with date, GPU and commit in the meta; return the .md path."""
    root = Path(results_dir) if results_dir else RESULTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    meta = {"date": date, "gpu": gpu_name(), "commit": git_commit(), "torch": torch.__version__}
    meta.update(extra or {})
    paths = {".json": root / f"{name}.json", ".md": root / f"{name}.md"}
    paths[".json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    header = "\n".join(_meta_line(k, v) for k, v in meta.items())
    paths[".md"].write_text(f"# {name}\n\n{header}\n\n```\n{format_table(rows)}\n```\n")
    out_dir = os.environ.get("OUT")
    if out_dir:
        for path in paths.values():
            Path(out_dir, path.name).write_text(path.read_text())
    return paths[".md"]


def _meta_line(key: str, value) -> str:
    """A results header line; a dict value (a profile) as one indented line per entry."""
    if not isinstance(value, dict):
        return f"- {key}: {value}"
    return "\n".join([f"- {key}:"] + [f"  - {k}: {v}" for k, v in value.items()])


def print_row(row: dict) -> None:
    """A child process's result, on stdout for child_row."""
    print(ROW_MARK + json.dumps(row), flush=True)


def child_row(cmd: list, timeout: float, env: dict | None = None) -> tuple[dict | None, str, str]:
    """cmd, a benchmark re-running itself for one row, in a fresh process (a clean GPU; a fault or a hang stays in
    it): (the row it printed with print_row, or None; the failure as a status: the timeout, or the exit code and
    exception line; its stderr)."""
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s", ""
    for line in out.stdout.splitlines():
        if line.startswith(ROW_MARK):
            return json.loads(line[len(ROW_MARK):]), "ok", out.stderr
    return None, f"exit {out.returncode}: {failure_line(out.stderr or out.stdout)[:300]}", out.stderr


def failure_line(text: str) -> str:
    """The exception line of a failed row (the last line naming an Error), not the warnings printed after it."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors or lines or ["no output"])[-1]
