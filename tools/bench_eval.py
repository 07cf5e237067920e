"""Evaluation and decoding throughput of every available mixer (one pattern per mixer of megahybrid's MIXERS
registry) at 4K and 16K tokens, on one GPU, freshly initialized weights (speed does not depend on them).

Per mixer and length: `eval ppl` forward with the loss (tok/s, batch 1), the prefill of a prompt of that length
(ms, batch 1), and decode tokens/s after it at batch 1 and 16 (64 steps through the decode caches).

    python tools/bench_eval.py [--preset 125m] [--lengths 4096 16384] [--mixers S I ...]

Writes tools/results/eval.{json,md} (date, GPU and commit in the meta).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from benchutil import format_table, save_results, time_ms  # noqa: E402

DECODE_STEPS = 64


def _decode_tok_s(model, vocab: int, batch: int, length: int) -> float:
    from megahybrid.model import decode

    ctx = decode.new_context(batch, length + DECODE_STEPS)
    ctx.materialize_only_last_token_logits = True
    prompt = torch.randint(0, vocab, (batch, length), device="cuda")
    token = decode.step_logits(model, prompt, ctx)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(DECODE_STEPS):
        token = decode.step_logits(model, token, ctx)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return batch * DECODE_STEPS / (time.perf_counter() - t0)


def _prefill_ms(model, vocab: int, length: int) -> float:
    from megahybrid.model import decode

    prompt = torch.randint(0, vocab, (1, length), device="cuda")

    def prefill():
        ctx = decode.new_context(1, length + 1)
        ctx.materialize_only_last_token_logits = True
        decode.step_logits(model, prompt, ctx)

    return time_ms(prefill)


def bench_one(preset_name: str, mixer: str, length: int) -> dict:
    from megahybrid.eval.loading import fresh
    from megahybrid.model.config import preset

    cfg = preset(preset_name, pattern=mixer, seq_length=length)
    model = fresh(cfg, precision="bf16").model.eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, length + 1), device="cuda")
    with torch.no_grad():
        eval_ms = time_ms(lambda: model(input_ids=tokens[:, :-1], position_ids=None, attention_mask=None,
                                        labels=tokens[:, 1:]))
        row = {"mixer": mixer, "preset": preset_name, "T": length, "eval_tok/s": length / eval_ms * 1e3,
               "prefill_ms": _prefill_ms(model, cfg.vocab_size, length)}
        for batch in (1, 16):
            row[f"decode_tok/s B={batch}"] = _decode_tok_s(model, cfg.vocab_size, batch, length)
    row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main() -> None:
    from megahybrid.model.mixers import MIXERS

    available = [c for c, m in MIXERS.items() if m.spec is not None]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--mixers", nargs="+", default=available, choices=available)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_eval.py needs a CUDA GPU")
    rows = [bench_one(args.preset, m, t) for m in args.mixers for t in args.lengths]
    print(format_table(rows))
    print(f"wrote {save_results('eval', rows, {'decode_steps': DECODE_STEPS})}")


if __name__ == "__main__":
    main()
