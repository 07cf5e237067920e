"""Monitoring: FLOP and MFU accounting, per-layer scalars from mixers, TensorBoard + console + JSONL logging.

Model FLOPs per token of one training step (forward + backward = 3 x forward, no recomputation counted):
    forward = sum over layers of the mixer's forward FLOPs (its record in megahybrid.model.mixers: 2 per matmul
              weight plus the token-mixing core, e.g. QK^T and AV over the causal half for softmax)
            + 2 * (SwiGLU fc1/fc2 weights per layer x layers + LM head weights)
The input embedding is a lookup, not a matmul. MFU = achieved TFLOP/s per GPU / peak.
"""
import json
import math
import os
import sys
import time

import psutil
import torch

from megahybrid.model.config import ModelConfig
from megahybrid.model.mixers import mixer_flops


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward) by the formula in the module docstring."""
    d = cfg.hidden_size
    dense = 2.0 * (cfg.num_layers * 3 * d * cfg.ffn_size + cfg.vocab_size * d)
    return 3.0 * (mixer_flops(cfg) + dense)


def model_metrics(model: torch.nn.Module) -> dict[str, float]:
    """Scalars from every submodule that defines `tensorboard_scalars() -> dict[str, float]`, keyed
    `<module path>/<name>` (e.g. the NAtS-L kept fraction or Interdomain state norms of a layer)."""
    out = {}
    for path, module in model.named_modules():
        hook = getattr(module, "tensorboard_scalars", None)
        if callable(hook):
            for name, value in hook().items():
                out[f"{path or 'model'}/{name}"] = float(value)
    return out


def memory_mib() -> dict[str, float]:
    if torch.cuda.is_available():
        return {"memory/allocated_mib": torch.cuda.memory_allocated() / 2**20,
                "memory/peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    return {"memory/rss_mib": psutil.Process().memory_info().rss / 2**20}


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class TrainLogger:
    """Writes on the logging rank only: TensorBoard scalars, `metrics.jsonl` (one record per logged step) and a
    console progress line with ETA. Other ranks get a logger whose methods do nothing."""

    def __init__(self, enabled: bool, run_dir: str, tb_dir: str | None, total_steps: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self.writer = None
        self.jsonl = None
        self.start_time = time.monotonic()
        self.start_step = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if tb_dir:
            from torch.utils.tensorboard import SummaryWriter  # slow to import; only runs that log to TensorBoard

            self.writer = SummaryWriter(tb_dir)

    def start(self, step: int) -> None:
        """Measure the ETA from here (the first step this process runs)."""
        self.start_step, self.start_time = step, time.monotonic()

    def text(self, tag: str, text: str) -> None:
        if self.writer:
            self.writer.add_text(tag, text.replace("\n", "  \n"), 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled or not values:
            return
        if self.writer:
            for key, value in values.items():
                if value is not None and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
        record = {"step": step, **{k: (v if v is None or math.isfinite(v) else str(v)) for k, v in values.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def progress(self, step: int, values: dict[str, float]) -> None:
        """One console line: step/total, loss, lr, throughput, MFU, skipped steps and ETA."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self.start_step is None:
            self.start(step - 1)
        rate = (step - self.start_step) / max(1e-9, now - self.start_time)
        eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
        print(
            f"step {step:>6}/{self.total_steps}  loss {values['train/loss']:.4f}  lr {values['train/lr']:.3e}  "
            f"gnorm {values['train/grad_norm']:.3f}  {values['perf/tokens_per_s']:.0f} tok/s  "
            f"{values['perf/tflops_per_gpu']:.3g} TFLOP/s/GPU  MFU {100 * values['perf/mfu']:.3g}%  "
            f"skipped {int(values['train/skipped_steps'])}  ETA {format_duration(eta) if math.isfinite(eta) else '?'}",
            flush=True,
        )

    def flush(self) -> None:
        if self.writer:
            self.writer.flush()

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.jsonl:
            self.jsonl.close()


def say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stdout, flush=True)
