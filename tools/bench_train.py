"""Training-step throughput of a preset on one GPU: forward+backward (+ AdamW step) in bf16.

FLOPs per token (stated, Megatron/PaLM convention): 6 * N_matmul + 6 * L * T * d, where N_matmul counts every
weight used in a matrix product (attention, MLP, LM head; not the input embedding lookup) and 6*L*T*d is causal
attention's QK^T and PV products forward+backward (2 products x 2 FLOP x T/2 keys on average x d x 3 passes).
MFU is quoted against the bf16 matmul rate measured in the same run and the 989 TFLOP/s datasheet number.

    python tools/bench_train.py --preset 125m --seq 4096 --tokens 65536 [--compile]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from benchutil import format_table, matmul_peak_tflops, save_results, time_ms  # noqa: E402
from megahybrid.distributed import init_distributed, shutdown  # noqa: E402
from megahybrid.model.config import ModelConfig, count_parameters, preset  # noqa: E402
from megahybrid.model.gpt import build_model, lm_loss  # noqa: E402
from megahybrid.parallel import ParallelLayout  # noqa: E402

DATASHEET_TFLOPS = 989.0


def flops_per_token(cfg: ModelConfig) -> float:
    matmul_params = count_parameters(cfg) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1)
    matmul_params -= (2 * cfg.num_layers + 1) * cfg.hidden_size  # norm weights are not matmuls
    return 6.0 * matmul_params + 6.0 * cfg.num_layers * cfg.seq_length * cfg.hidden_size


def bench_one(name: str, seq: int, tokens: int, compile_model: bool, peak: float) -> dict:
    cfg = preset(name, seq_length=seq)
    model = build_model(cfg, ParallelLayout(), precision="bf16")
    step_model = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = max(1, tokens // seq)
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device="cuda")
    tokens_in, labels, mask = data[:, :-1], data[:, 1:], torch.ones(batch, seq, device="cuda")

    def step():
        loss = lm_loss(step_model, tokens_in, labels, mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    ms = time_ms(step, warmup_ms=100, rep_ms=1000)
    torch.cuda.reset_peak_memory_stats()
    step()
    mem_gib = torch.cuda.max_memory_allocated() / 2**30
    tok_s = batch * seq / (ms * 1e-3)
    tflops = flops_per_token(cfg) * tok_s / 1e12
    del model, opt, step_model
    torch.cuda.empty_cache()
    return {"preset": name, "seq": seq, "batch": batch, "compile": compile_model, "ms/step": ms,
            "tok/s": tok_s, "TFLOP/s": tflops, "MFU_meas": tflops / peak, "MFU_989": tflops / DATASHEET_TFLOPS,
            "mem_GiB": mem_gib}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=["125m"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per step (batch = tokens // seq)")
    parser.add_argument("--compile", choices=["off", "on", "both"], default="both")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU")
    init_distributed(ParallelLayout())
    peak = matmul_peak_tflops()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    rows = [bench_one(p, args.seq, args.tokens, c, peak) for p in args.preset for c in modes]
    save_results("bench_train", rows, {"matmul_peak_tflops": round(peak, 1)})
    print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s")
    print(format_table(rows))
    shutdown()


if __name__ == "__main__":
    main()
