"""`megahybrid eval ppl`: perplexity by position bucket, up to several times the training context.

Windows of the longest bucket's length are cut one after another from the start of an indexed dataset
(`megahybrid data preprocess` output, EOD between documents, no shuffle: give a held-out prefix); the loss at
each position is averaged over the windows, and each bucket (l_{i-1}, l_i] of positions gets exp(mean loss).
RoPE extends to any length, so positions past model.seq_length measure extrapolation.
"""
import json
import math
import os
import re
import time

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megahybrid.errors import UserError
from megahybrid.eval.loading import load
from megahybrid.outputs import git_commit

DEFAULT_WINDOWS = 8
UNITS = {"": 1, "K": 1024, "M": 1024 * 1024}


def parse_lengths(text: str) -> list[int]:
    """"1K,2K,4096" -> [1024, 2048, 4096], strictly increasing."""
    out = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", item)
        if not match or int(match.group(1)) < 1:
            raise UserError(f"--lengths {text!r}: write increasing positive lengths such as 1K,2K,4K (K = 1024)")
        out.append(int(match.group(1)) * UNITS[match.group(2).upper()])
    if out != sorted(set(out)):
        raise UserError(f"--lengths {text!r}: the lengths must increase, e.g. 1K,2K,4K")
    return out


def label(n: int) -> str:
    for suffix, unit in (("M", UNITS["M"]), ("K", UNITS["K"])):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def read_tokens(prefix: str, need: int, want: int) -> np.ndarray:
    """The first min(want, available) tokens of the dataset's documents in file order; at least `need`."""
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        raise UserError(f"--data {prefix}: no {prefix}.bin/.idx; give the prefix `megahybrid data preprocess` wrote")
    dataset = IndexedDataset(prefix)
    available = int(np.asarray(dataset.sequence_lengths, dtype=np.int64).sum())
    if available < need:
        raise UserError(f"--data {prefix} holds {available} tokens, fewer than the {need} one window of the longest "
                        "bucket needs: lower --lengths or give a larger dataset")
    pieces, total = [], 0
    for i in range(len(dataset)):
        piece = dataset.get(i, length=min(int(dataset.sequence_lengths[i]), want - total))
        pieces.append(piece.astype(np.int64))
        total += len(piece)
        if total >= want:
            break
    return np.concatenate(pieces)


@torch.no_grad()
def position_losses(model, tokens: np.ndarray, length: int, windows: int, device) -> torch.Tensor:
    """Mean next-token loss at each of `length` positions over `windows` consecutive windows, float64 [length]."""
    total = torch.zeros(length, dtype=torch.float64)
    for w in range(windows):
        chunk = torch.from_numpy(tokens[w * length: w * length + length + 1]).to(device)
        inputs, labels = chunk[None, :-1], chunk[None, 1:]
        loss = model(input_ids=inputs, position_ids=None, attention_mask=None, labels=labels)
        total += loss[0].double().cpu()
    return total / windows


def buckets(losses: torch.Tensor, lengths: list[int], train_length: int) -> list[dict]:
    rows, start = [], 0
    for end in lengths:
        nll = losses[start:end].mean().item()
        rows.append({"bucket": f"{label(start)}-{label(end)}" if start else f"<={label(end)}", "start": start,
                     "end": end, "nll": nll, "ppl": math.exp(nll), "beyond_training": start >= train_length})
        start = end
    return rows


def evaluate(loaded, tokens: np.ndarray, lengths: list[int], windows: int) -> dict:
    t0 = time.perf_counter()
    losses = position_losses(loaded.model, tokens, lengths[-1], windows, loaded.device)
    seconds = time.perf_counter() - t0
    return {"checkpoint": loaded.path, "label": run_label(loaded), "step": loaded.step,
            "pattern": loaded.cfg.pattern, "train_length": loaded.cfg.seq_length, "windows": windows,
            "tokens": windows * lengths[-1], "tokens_per_s": windows * lengths[-1] / seconds,
            "buckets": buckets(losses, lengths, loaded.cfg.seq_length)}


def run_label(loaded) -> str:
    """"RUN step N (PATTERN)": the run directory above checkpoints/step_*, which is what users tell apart."""
    parts = [p for p in os.path.normpath(os.path.abspath(loaded.path)).split(os.sep) if p]
    names = [p for p in parts if p != "checkpoints" and not p.startswith("step_")]
    step = f" step {loaded.step}" if loaded.step is not None else ""
    return f"{names[-1] if names else loaded.path}{step} ({loaded.cfg.pattern})"


def table(result: dict) -> str:
    lines = [f"{result['label']}: {result['windows']} windows x {result['buckets'][-1]['end']} tokens, "
             f"trained at {result['train_length']}, {result['tokens_per_s']:.0f} tok/s",
             f"  {'positions':>14} {'ppl':>10} {'nll':>8}"]
    for row in result["buckets"]:
        mark = "  (beyond training context)" if row["beyond_training"] else ""
        lines.append(f"  {row['bucket']:>14} {row['ppl']:>10.3f} {row['nll']:>8.4f}{mark}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib  # the headless backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        ends = [row["end"] for row in result["buckets"]]
        line, = ax.plot(ends, [row["ppl"] for row in result["buckets"]], marker="o", label=result["label"])
        ax.axvline(result["train_length"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ends, [label(e) for e in ends])
    ax.set_xlabel("position (bucket end); dotted: training context")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity by position")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tensorboard(result: dict, out_dir: str) -> None:
    """`eval/ppl_by_position` with the bucket end as the step (the curve), and one `eval/ppl_<bucket>` scalar
    per bucket at the training step (to follow a bucket across checkpoints)."""
    from torch.utils.tensorboard import SummaryWriter  # slow to import (TensorFlow stubs): only when writing

    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", result["label"]).strip("_")
    with SummaryWriter(os.path.join(out_dir, "tensorboard", name)) as writer:
        for row in result["buckets"]:
            writer.add_scalar("eval/ppl_by_position", row["ppl"], global_step=row["end"])
            writer.add_scalar(f"eval/ppl_{label(row['end'])}", row["ppl"], global_step=result["step"] or 0)


def run(args) -> int:
    lengths = parse_lengths(args.lengths)
    want = (args.tokens or DEFAULT_WINDOWS * lengths[-1]) + 1
    tokens = read_tokens(args.data, lengths[-1] + 1, max(want, lengths[-1] + 1))
    windows = max(1, (len(tokens) - 1) // lengths[-1])
    results = []
    for path in args.checkpoint:
        loaded = load(path, args.precision, max_length=lengths[-1])
        results.append(evaluate(loaded, tokens, lengths, windows))
        print(table(results[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    record = {"meta": {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "data": args.data,
                       "device": _device_name()}, "results": results}
    with open(os.path.join(args.out, "ppl.json"), "w") as f:
        json.dump(record, f, indent=1)
    plot(results, os.path.join(args.out, "ppl.png"))
    for result in results:
        write_tensorboard(result, args.out)
    print(f"wrote {args.out}/ppl.json, ppl.png and tensorboard/", flush=True)
    return 0


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
