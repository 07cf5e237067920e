"""NAtS-L Hybrid (natsl-340m) against the same-size softmax model `S`: prefill (forward) time at 128K and decode
step time after 8K and 128K tokens (each eager and as a CUDA graph), bf16, batch 1, one GPU.

The selection of an untrained model is a coin flip per chunk; trained NAtS-L layers keep few chunks for
attention, so the `N` layers here keep a fixed fraction (KEPT, random chunks) to time what a trained model runs.
Usage: python tools/bench_nats_layer.py  (writes tools/results/nats-layer.{json,md}); --profile adds each prefill's
GPU time per module kind (CUDA events) and kernel times (torch.profiler) to the results; --prefill-only skips the
decode rows; --compile adds each prefill under torch.compile.
Training throughput of the presets: tools/bench_train.py with --config natsl-340m (and -n, -g, -s).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megahybrid.distributed import init_distributed  # noqa: E402
from megahybrid.model import decode  # noqa: E402
from megahybrid.model.config import preset  # noqa: E402
from megahybrid.model.gpt import build_model  # noqa: E402
from megahybrid.model.mixers.nats import NatsDecodeCache, NatsLayer, cache_bytes  # noqa: E402
from megahybrid.parallel import ParallelLayout  # noqa: E402
from tools.benchutil import (  # noqa: E402
    _project_frame, format_table, graphed, kernel_ms, module_ms, peak_memory_mib, save_results, time_ms)

KEPT = 0.1
PREFILL = 131072
DECODE_CONTEXTS = (8192, 131072)
LAYER_KINDS = ("TransformerLayer", "NatsLayer", "MLP", "SelfAttention")  # --profile's per-kind GPU times


def _fixed_fraction_choose(self, score):
    """KEPT of the chunks to attention, the rest to GDN, at random positions per (batch, head)."""
    B, NC, H = score.shape[:3]
    keep_attn = (torch.rand(B, H, NC, device=score.device) < KEPT).float()
    return keep_attn, 1.0 - keep_attn


def _model(pattern: str, seq: int, segments: int = 1):
    cfg = preset("natsl-340m", pattern=pattern, seq_length=seq, nats={"gdn_segments": segments})
    return cfg, build_model(cfg, ParallelLayout(), "bf16").eval()


def _prefill_row(name, pattern, profiles=None, compiled=False, segments=1):
    """Eager and CUDA-graph prefill times, and torch.compile's with `compiled` (full_logits: no autograd);
    `segments`: model.nats.gdn_segments."""
    cfg, model = _model(pattern, PREFILL, segments)
    tokens = torch.randint(0, cfg.vocab_size, (1, PREFILL), device="cuda")
    run = lambda: decode.full_logits(model, tokens)  # noqa: E731
    row = {"model": name, "what": f"prefill {PREFILL // 1024}K", "ms": time_ms(run, 20, 100),
           "peak_mib": peak_memory_mib(run)}
    replay = graphed(run)  # no host time: at 128K it ran as long as eager (2026-12-04), the forward is GPU-bound
    row["graphed_ms"] = time_ms(replay, 20, 100) if callable(replay) else replay
    del replay
    torch.cuda.empty_cache()
    where = f"{name} prefill {PREFILL // 1024}K"
    if profiles is not None:
        profiles[f"{where}, GPU ms per module kind"] = module_ms(model, run, LAYER_KINDS)
        profiles[f"{where}, kernel ms"] = kernel_ms(run)
        print(name, profiles[f"{where}, GPU ms per module kind"], flush=True)
    if compiled:
        fast = torch.compile(model)
        run = lambda: decode.full_logits(fast, tokens)  # noqa: E731
        try:
            row["compile_s"] = _seconds(run)
        except Exception as err:  # the row keeps its eager times and says why
            row["compiled_ms"] = f"{type(err).__name__}: {str(err).splitlines()[0][:60]} ({_project_frame(err)})"
            return row
        row["compiled_ms"] = time_ms(run, 20, 100)
        if profiles is not None:
            profiles[f"{where} compiled, kernel ms"] = kernel_ms(run)
    return row


def _seconds(fn) -> float:
    """Wall seconds of one fn() (the first call of a compiled forward: its compilation)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round(time.perf_counter() - start, 1)


def _open_chunk_counters(ctx) -> list[tuple]:
    """Each NAtS-L / GDN layer cache with its open-chunk counters, as the prefill left them."""
    caches = [c for c in ctx.key_value_memory_dict.values() if isinstance(c, NatsDecodeCache)]
    return [(c, c.n_open, c.attention.n_cur if c.attention is not None else None) for c in caches]


def _restore(counters) -> None:
    for cache, n_open, n_cur in counters:
        cache.n_open = n_open
        if n_cur is not None:
            cache.attention.n_cur = n_cur


def _decode_row(name, pattern, context):
    """One step at `context` tokens inside the open chunk (what 63 of every 64 steps run: no chunk is committed),
    eager and replayed as a CUDA graph."""
    cfg, model = _model(pattern, context + 64)
    ctx = decode.new_context(1, context + 64)
    decode.step_logits(model, torch.randint(0, cfg.vocab_size, (1, context), device="cuda"), ctx)
    token = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    counters = _open_chunk_counters(ctx)

    def step():  # the same position and open-chunk length each time
        _restore(counters)
        ctx.sequence_len_offset = context
        decode.step_logits(model, token, ctx)

    eager = time_ms(step, 20, 100)
    replay = graphed(step)
    layer_bytes = cache_bytes(cfg.replace(nats={"kept_fraction": KEPT}), context)
    per_layer = {c: layer_bytes[c] / 2**20 for c in dict.fromkeys(cfg.layer_pattern)}
    return {"model": name, "what": f"decode step @ {context // 1024}K", "ms": eager,
            "graphed_ms": time_ms(replay, 20, 100) if callable(replay) else replay,
            "cache_mib_per_layer": ", ".join(f"{c} {v:.1f}" for c, v in per_layer.items())}


def _speedup(pair: list[dict], key: str):
    hybrid, softmax = (row.get(key) for row in pair)
    ok = all(isinstance(x, float) for x in (hybrid, softmax))
    return softmax / hybrid if ok else ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true",
                        help="each prefill's GPU time per module kind and kernel times into the results")
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode rows")
    parser.add_argument("--compile", action="store_true",
                        help="also time each prefill under torch.compile (compile_s: its first call)")
    parser.add_argument("--gdn-segments", default="1", metavar="N[,N...]",
                        help="one Hybrid prefill row per model.nats.gdn_segments value (default 1)")
    args = parser.parse_args(argv)
    init_distributed(ParallelLayout())
    NatsLayer._choose = _fixed_fraction_choose
    hybrid = preset("natsl-340m").pattern
    profiles = {} if args.profile else None
    segments = [int(n) for n in args.gdn_segments.split(",")]
    rows = [_prefill_row("Hybrid" + (f" gdn_segments={n}" if n > 1 else ""), hybrid, profiles, args.compile, n)
            for n in segments]
    rows.append(_prefill_row("S", "S", profiles, args.compile))
    for row in rows[:-1]:
        pair = [row, rows[-1]]
        row["speedup"], row["graphed_speedup"] = _speedup(pair, "ms"), _speedup(pair, "graphed_ms")
        if args.compile:
            row["compiled_speedup"] = _speedup(pair, "compiled_ms")
    for context in () if args.prefill_only else DECODE_CONTEXTS:
        pair = [_decode_row("Hybrid", hybrid, context), _decode_row("S", "S", context)]
        pair[0]["speedup"], pair[0]["graphed_speedup"] = _speedup(pair, "ms"), _speedup(pair, "graphed_ms")
        rows += pair
    print(format_table(rows))
    name = "nats-layer-prefill" if args.prefill_only else "nats-layer"
    print("saved", save_results(name, rows, {"kept_fraction": KEPT, **(profiles or {})}))


if __name__ == "__main__":
    main()
