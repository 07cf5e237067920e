"""Where torch.compile and the Triton kernels keep what they build (train.compile_cache), so that a restarted run
(a preemption, a Slurm requeue, `train.steps=N to go further`) does not build it again.

torch keeps inductor's compiled graphs under /tmp/torchinductor_<user> and Triton its kernels under ~/.triton:
on a cluster a requeued job often lands on another node, whose /tmp is empty, and pays the whole warm-up again
(67-247 s on the H200 for the 125M and 340M presets, tools/results/bench_train-mixers.md). By default the caches
live in the run directory, which a resumed run shares. On CPU (demo config, pattern SG, compiled) the first step
took 41.8 s cold and 9.7 s resumed over the run's cache: all 26 inductor graphs came from it.
"""
import os

CHOICES = ("run", "torch")  # or a directory


def check(choice: str) -> str | None:
    """An error line for a value that names no usable directory, else None."""
    if choice in CHOICES or not os.path.isfile(choice):
        return None
    return f"train.compile_cache={choice!r} is a file; give run, torch or a directory"


def _chosen_by_user() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR when it names a directory of the user's: importing megatron already runs
    torch.compile's imports, which write torch's default into the variable, so that value says nothing."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: any value counts as the user's
        return value
    return value if value and os.path.abspath(value) != os.path.abspath(default_cache_dir()) else None


def use(choice: str, run_dir: str) -> str:
    """Points inductor's caches and Triton's kernel cache at `choice` (run: <run_dir>/compile_cache; torch: torch's
    own default; else that directory), unless the environment names them already. Returns where they go."""
    if user := _chosen_by_user():
        return f"{user} (TORCHINDUCTOR_CACHE_DIR)"
    if choice == "torch":
        return "torch's default"
    path = os.path.abspath(os.path.join(run_dir, "compile_cache") if choice == "run" else choice)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(path, "triton"))
    return path


def summary() -> str | None:
    """How many of the graphs inductor compiled so far in this process came from the cache (None: none compiled)."""
    from torch._dynamo.utils import counters

    hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return f"{hit} of {hit + miss} compiled graphs from the cache" if hit + miss else None
