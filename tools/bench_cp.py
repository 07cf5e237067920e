"""What one context-parallel rank computes, timed on one GPU, and the weak-scaling step time it predicts (#18).

A CP rank runs its shard (S = context / cp tokens) through the whole model, forward and backward, with the
state-passing pieces: the conv halos, the shard summaries, the prefix combine and the corrected outputs (and for
`N` the gathered attention keys). Here the collectives of a stand-in CP group run locally: an all-gather returns
cp copies of this rank's piece (the same shapes, so the same compute as on cp GPUs), an all-reduce is a no-op and
a reduce-scatter keeps this rank's part,
for the last rank (cp - 1), which has the most attention work. Against it: the same model on the same S tokens
without CP, i.e. what each GPU computes at cp = 1. The bytes each rank sends come from the mixer records
(`cp_bytes`), and the link time assumes `--link-gbs` GB/s per GPU (an assumption, stated in the results: one
GPU cannot measure it; the 2-GPU run is issue #19). Predicted weak scaling (cp GPUs on cp x S tokens against
one GPU on S tokens) = (rank ms + link ms) / no-CP ms; the issue's target is <= 1.1 for `I` and `G` models.
The `*_host_ms` columns are the host's part of each step (until the step returns, before the device sync). With
--profile, each profiled step also gets its idle ms (wall less kernels) and its host syncs and allocator retries:
the compiled 350M `I` rank at f423cf7 took 478.6 ms for 351.7 ms of kernels, where the shard without CP had no
idle time (tools/results/bench_cp-compiled.md).

The stand-in reproduces the shapes, hence the compute, of a real rank, not its values (the earlier ranks' pieces
are copies of this rank's: with RoPE offsets and conv halos those are not what any sequence gives); that the
state passing is exact is tested with real collectives in tests/test_context_parallel.py. A row checks only
that its loss is finite.

    python tools/bench_cp.py                                  # GPU: 350m-interdomain and natsl-340m, 64K
    python tools/bench_cp.py --compile --cps 2                # compiled layer by layer, as training on a GPU
    python tools/bench_cp.py --models tiny@I tiny@GN --context 512 --cps 2 4 --results-dir /tmp/r   # CPU smoke
"""
import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megahybrid.distributed import init_distributed  # noqa: E402
from megahybrid.model.config import preset  # noqa: E402
from megahybrid.model.gpt import build_model  # noqa: E402
from megahybrid.model.mixers import cp_bytes_per_layer, interdomain, nats  # noqa: E402
from megahybrid.parallel import ParallelLayout  # noqa: E402
from tools.benchutil import format_table, host_waits, kernel_ms, save_results  # noqa: E402

DEFAULT_MODELS = ["350m-interdomain", "natsl-340m"]


class StandInGroup:
    """Rank `rank` of a CP group of `size` whose collectives run locally (module docstring)."""

    def __init__(self, rank: int, size: int):
        self.rank_, self.size_ = rank, size


@contextmanager
def stand_in_cp(group: StandInGroup):
    """torch.distributed's calls on `group` answered locally, every other group's passed on; the mixer modules'
    layer CP group is `group` meanwhile."""
    scatters = [name for name in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, name)]
    real = {name: getattr(dist, name) for name in ("get_rank", "get_world_size", "all_gather", "all_reduce", *scatters)}

    def get_rank(group_=None):
        return group.rank_ if group_ is group else real["get_rank"](group_)

    def get_world_size(group_=None):
        return group.size_ if group_ is group else real["get_world_size"](group_)

    def all_gather(parts, x, group=None, **kwargs):
        if group is not stand_in:
            return real["all_gather"](parts, x, group=group, **kwargs)
        for part in parts:
            part.copy_(x)

    def all_reduce(x, *args, group=None, **kwargs):  # the sum or max over identical copies: a no-op for timing
        if group is not stand_in:
            return real["all_reduce"](x, *args, group=group, **kwargs)

    def reduce_scatter(output, parts, *args, group=None, **kwargs):  # the sum over identical copies: a copy
        if group is not stand_in:
            return real[scatters[-1]](output, parts, *args, group=group, **kwargs)
        n = output.shape[0]
        output.copy_(parts[stand_in.rank_ * n:(stand_in.rank_ + 1) * n])

    stand_in, owners = group, (interdomain, nats)
    saved_cp = [owner.layer_cp_group for owner in owners]
    try:
        for fn in (get_rank, get_world_size, all_gather, all_reduce):
            setattr(dist, fn.__name__, fn)
        for name in scatters:
            setattr(dist, name, reduce_scatter)
        for owner in owners:
            owner.layer_cp_group = lambda config: stand_in
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        for owner, fn in zip(owners, saved_cp):
            owner.layer_cp_group = fn


def model_config(name: str, seq: int):
    """`PRESET` or `PRESET@PATTERN` at sequence length seq."""
    base, _, pattern = name.partition("@")
    cfg = preset(base, **({"pattern": pattern} if pattern else {}), seq_length=seq)
    if "S" in cfg.layer_pattern:
        raise SystemExit(f"error: {name}: softmax layers are not covered by the stand-in CP group (they use "
                         "megatron's CP group and RoPE table); time I, D, N and G patterns")
    return cfg


def fwd_bwd(model, tokens) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, position_ids=None, attention_mask=None, labels=tokens).float().mean()
    loss.backward()
    return loss


def time_ms(fn, warmup: int, reps: int) -> tuple[float, float]:
    """Median ms of fn() to the device's end, and of its host part alone (until fn returns, before the device
    sync): a host part near the whole means the host, not the GPU, sets the pace."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        host.append((time.perf_counter() - start) * 1e3)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), statistics.median(host)


def _profile(what: str, step, wall_ms: float) -> dict:
    """The step's kernel times, and where the device waits: its idle ms (the timed wall ms less the kernels'
    total) and the host syncs and allocator retries of one call (benchutil.host_waits)."""
    kernels = kernel_ms(step)
    waits = {"idle_ms": round(wall_ms - kernels["all kernels"], 3), **host_waits(step)}
    return {f"{what}, kernel ms": kernels, f"{what}, waits": waits}


def rows_for(name: str, args, precision: str, profiles: dict | None = None) -> list[dict]:
    rows = []
    for cp in args.cps:
        S = args.context // cp
        cfg = model_config(name, S * cp)  # the records' byte counts are per sequence of the whole context
        model = build_model(model_config(name, S), ParallelLayout(), precision)
        if args.compile:  # layer by layer (train.compile_scope=layers: a warm-up independent of depth); the
            from megahybrid.train.trainer import compile_by_layer  # stand-in CP pass compiles apart from no-CP

            compile_by_layer(model)
        tokens = torch.randint(0, cfg.vocab_size, (1, S), device=next(model.parameters()).device)
        step = lambda: fwd_bwd(model, tokens)  # noqa: E731
        profile = profiles is not None and cp == args.cps[0]
        no_cp, no_cp_host = time_ms(step, args.warmup, args.reps)
        with stand_in_cp(StandInGroup(cp - 1, cp)):
            rank, rank_host = time_ms(step, args.warmup, args.reps)
            finite = bool(torch.isfinite(step()))
            if profile:
                profiles.update(_profile(f"{name} cp={cp} rank", step, rank))
        if profile:
            profiles.update(_profile(f"{name} shard {S} without CP", step, no_cp))
        per_layer = cp_bytes_per_layer(cfg, cp, 2)
        sent = sum(per_layer[c] for c in cfg.layer_pattern)
        link_ms = sent / (args.link_gbs * 1e9) * 1e3
        rows.append({"model": name, "cp": cp, "shard": S, "no_cp_ms": no_cp, "rank_ms": rank,
                     "no_cp_host_ms": no_cp_host, "rank_host_ms": rank_host, "compute_ratio": rank / no_cp,
                     "MiB_sent": sent / 2**20, "link_ms": link_ms,
                     "predicted_weak_scaling": (rank + link_ms) / no_cp, "loss": "finite" if finite else "NOT FINITE"})
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="PRESET or PRESET@PATTERN")
    parser.add_argument("--context", type=int, default=65536, help="tokens of one sequence over all CP ranks")
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--link-gbs", type=float, default=200.0,
                        help="assumed GB/s each GPU sends over (an assumption; see the module docstring)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--results-dir", default=None, help="default tools/results")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile layer by layer, as `megahybrid train train.compile_scope=layers` does "
                             "(the warm-up steps compile)")
    parser.add_argument("--profile", action="store_true",
                        help="kernel times of the first cp's rank and of its shard without CP, into the results")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    init_distributed(ParallelLayout())
    profiles = {} if args.profile else None
    rows = [row for name in args.models for row in rows_for(name, args, "bf16" if gpu else "fp32", profiles)]
    print(format_table(rows))
    meta = {"context": args.context, "link_gbs_assumed": args.link_gbs, "rank_timed": "cp - 1 (the last)",
            "compiled": args.compile}
    print("saved", save_results("bench_cp", rows, {**meta, **(profiles or {})}, args.results_dir))
    return 0 if all(r["loss"] == "finite" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
