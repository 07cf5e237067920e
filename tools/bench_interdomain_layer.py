"""Decode-step time of the 1.3B Interdomain model (`1.3b-interdomain`, every layer `I`) against the same-size
softmax model (`1.3b-paper`) at B = 1 and 16 and 1K / 8K / 32K / 100K tokens of context, bf16, one GPU.

One step = one token through the whole model (megahybrid.model.decode.step_logits) at position `context`, after
a short prefill that creates the caches. The Interdomain state has a fixed size, so its content does not change
the time; the softmax KV cache is allocated for the whole context and attended over up to `context` (its
content is what the prefill left, also irrelevant to the time). `graphed` replays the step as a CUDA graph
where the capture succeeds (else the row says why). Rows whose KV cache would pass --max-cache-gib are skipped.

    python tools/bench_interdomain_layer.py [--contexts 1024 8192 32768 102400] [--batches 1 16]
Results: tools/results/bench_interdomain_layer.{json,md} (date, GPU, commit).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from benchutil import format_table, graphed, save_results, time_ms  # noqa: E402
from megahybrid.distributed import init_distributed, shutdown  # noqa: E402
from megahybrid.model.config import preset  # noqa: E402
from megahybrid.model.decode import new_context, step_logits  # noqa: E402
from megahybrid.model.gpt import build_model  # noqa: E402
from megahybrid.parallel import ParallelLayout  # noqa: E402

PROMPT = 16


def kv_cache_gib(cfg, batch: int, context: int) -> float:
    return 2 * cfg.num_layers * batch * context * cfg.kv_heads * cfg.head_dim * 2 / 2**30


def bench_one(model, cfg, batch: int, context: int) -> dict:
    ctx = new_context(batch, context + 1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, PROMPT), device="cuda")
    step_logits(model, tokens, ctx)
    token = tokens[:, :1].contiguous()

    def step():
        ctx.sequence_len_offset = context
        step_logits(model, token, ctx)

    eager = time_ms(step)
    graph = graphed(step)
    graph_ms = time_ms(graph) if callable(graph) else graph
    return {"model": cfg.pattern, "batch": batch, "context": context, "eager ms": eager, "graphed ms": graph_ms}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["1.3b-interdomain", "1.3b-paper"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768, 102400])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-cache-gib", type=float, default=100.0)
    args = parser.parse_args()
    layout = init_distributed(ParallelLayout()).layout
    rows = []
    for name in args.presets:
        # room for one step past the longest context, in whole 64-token chunks (the mixers' chunk)
        cfg = preset(name, seq_length=-(-(max(args.contexts) + 1) // 64) * 64)
        model = build_model(cfg, layout, "bf16").eval()
        for batch in args.batches:
            for context in args.contexts:
                if cfg.pattern == "S" and kv_cache_gib(cfg, batch, context) > args.max_cache_gib:
                    rows.append({"model": cfg.pattern, "batch": batch, "context": context, "eager ms": "skipped",
                                 "graphed ms": f"KV cache {kv_cache_gib(cfg, batch, context):.0f} GiB"})
                    continue
                rows.append(bench_one(model, cfg, batch, context))
                print(format_table(rows[-1:]), flush=True)
        del model
        torch.cuda.empty_cache()
    print(format_table(rows))
    print(save_results("bench_interdomain_layer", rows, {"presets": args.presets}))
    shutdown()


if __name__ == "__main__":
    main()
