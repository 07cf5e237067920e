"""`megahybrid eval recall`: synthetic associative recall on a checkpoint, or on a tiny model trained here.

MQAR (multi-query associative recall): the sequence starts with `keys` key-value pairs, then each key comes
back once, at a random place among filler tokens, followed by its value; a query is right when the model's
argmax after the key is the value. NIAH (needle in a haystack): a two-token key and a two-token value sit at a
relative depth of random haystack tokens; the key is asked again at the end; right when both value tokens are
the argmax (teacher forcing, which is exact for "all right"). Keys, values and haystack use disjoint token
ranges above the special ids. Fixed-state mixers are expected to lose accuracy as keys and lengths grow.
"""
import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from megahybrid.errors import UserError
from megahybrid.eval.loading import fresh, load
from megahybrid.outputs import git_commit
from megahybrid.eval.ppl import parse_lengths
from megahybrid.model.config import preset
from megahybrid.model.decode import full_logits
from megahybrid.train.config import load_config

FIRST_ID = 4  # above unk, bos, eos, pad
NEEDLE = 2  # tokens of a needle's key and of its value


@dataclass
class RecallSettings:
    lengths: list = field(default_factory=lambda: [256, 512, 1024])
    keys: list = field(default_factory=lambda: [4, 16, 64])
    depths: list = field(default_factory=lambda: [0.1, 0.5, 0.9])
    samples: int = 64  # sequences per setting
    vocab: int | None = None  # token ids used (FIRST_ID..vocab); default: the model's vocabulary
    seed: int = 0


@dataclass
class Ranges:
    """Disjoint token ranges for keys, values and the haystack; the filler of MQAR is one fixed token."""

    filler: int
    keys: tuple
    values: tuple
    hay: tuple

    @classmethod
    def of(cls, vocab: int) -> "Ranges":
        third = (vocab - FIRST_ID - 1) // 3
        if third < 2:
            raise UserError(f"a vocabulary of {vocab} tokens is too small for recall tasks: use at least 11")
        lo = FIRST_ID + 1
        return cls(FIRST_ID, (lo, lo + third), (lo + third, lo + 2 * third), (lo + 2 * third, lo + 3 * third))


def mqar_min_vocab(num_keys: int) -> int:
    """The smallest vocabulary whose key range (Ranges.of) holds `num_keys` distinct keys."""
    return 3 * num_keys + FIRST_ID + 1


def mqar_batch(rng, n: int, length: int, num_keys: int, r: Ranges) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [n, length] and targets [n, length] (the value expected after a query key, -1 elsewhere)."""
    if r.keys[1] - r.keys[0] < num_keys:
        raise UserError(f"MQAR with {num_keys} keys needs a vocabulary of more than {mqar_min_vocab(num_keys) - 1} "
                        "tokens")
    tokens = np.full((n, length), r.filler, dtype=np.int64)
    targets = np.full((n, length), -1, dtype=np.int64)
    slots = (length - 2 * num_keys) // 2
    for i in range(n):
        keys = rng.choice(np.arange(*r.keys), num_keys, replace=False)
        values = rng.integers(*r.values, size=num_keys)
        tokens[i, 0:2 * num_keys:2], tokens[i, 1:2 * num_keys:2] = keys, values
        at = 2 * num_keys + 2 * np.sort(rng.choice(slots, num_keys, replace=False))
        order = rng.permutation(num_keys)
        tokens[i, at], tokens[i, at + 1] = keys[order], values[order]
        targets[i, at] = values[order]
    return tokens, targets


def niah_batch(rng, n: int, length: int, depth: float, r: Ranges) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.integers(*r.hay, size=(n, length))
    targets = np.full((n, length), -1, dtype=np.int64)
    key = rng.integers(*r.keys, size=(n, NEEDLE))
    value = rng.integers(*r.values, size=(n, NEEDLE))
    needle = np.concatenate([key, value], 1)
    at = int(depth * (length - 4 * NEEDLE))
    tokens[:, at:at + 2 * NEEDLE] = needle
    tokens[:, length - 2 * NEEDLE:] = needle
    targets[:, length - NEEDLE - 1:length - 1] = value
    return tokens, targets


@torch.no_grad()
def correct(model, tokens: np.ndarray, targets: np.ndarray, device, per_sequence: bool) -> np.ndarray:
    """Right answers: per query (MQAR), or per sequence when all its targets are right (NIAH)."""
    batch = max(1, 16384 // tokens.shape[1])
    hits = []
    for s in range(0, len(tokens), batch):
        x = torch.from_numpy(tokens[s:s + batch]).to(device)
        want = torch.from_numpy(targets[s:s + batch]).to(device)
        pred = full_logits(model, x).argmax(-1)
        ok = (pred == want) | (want < 0)
        hits.append((ok.all(1) if per_sequence else ok[want >= 0]).cpu().numpy())
    return np.concatenate(hits)


def evaluate(model, settings: RecallSettings, vocab: int, device) -> list[dict]:
    ranges = Ranges.of(settings.vocab or vocab)
    rng = np.random.default_rng(settings.seed)
    rows = []
    for length in settings.lengths:
        for num_keys in settings.keys:
            if 4 * num_keys > length:
                continue  # the keys and their queries do not fit
            tokens, targets = mqar_batch(rng, settings.samples, length, num_keys, ranges)
            hits = correct(model, tokens, targets, device, per_sequence=False)
            rows.append({"task": "mqar", "length": length, "keys": num_keys, "accuracy": float(hits.mean()),
                         "queries": int(hits.size)})
        for depth in settings.depths:
            tokens, targets = niah_batch(rng, settings.samples, length, depth, ranges)
            hits = correct(model, tokens, targets, device, per_sequence=True)
            rows.append({"task": "niah", "length": length, "depth": depth, "accuracy": float(hits.mean()),
                         "queries": int(hits.size)})
    return rows


def train_mqar(loaded, settings: RecallSettings, steps: int, batch: int, lr: float, grad_clip: float = 1.0,
               length: int | None = None) -> list:
    """Train `loaded.model` on MQAR at `length` tokens (default its seq_length), a mixture of the key counts that
    fit; returns losses. A length a few times the largest key count keeps the queries dense: a model trained at
    1024 with 4-64 keys sees a few supervised tokens per sequence and learned no recall in 500 steps (repro-small)."""
    model, length = loaded.model, length or loaded.cfg.seq_length
    ranges = Ranges.of(settings.vocab or loaded.cfg.vocab_size)
    key_counts = [k for k in settings.keys if 4 * k <= length] or [max(1, length // 4)]
    rng = np.random.default_rng(settings.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    losses = []
    for _ in range(steps):
        tokens, targets = mqar_batch(rng, batch, length, int(rng.choice(key_counts)), ranges)
        x, y = torch.from_numpy(tokens).to(loaded.device), torch.from_numpy(targets).to(loaded.device)
        mask = (y >= 0).float()
        per_token = model(input_ids=x, position_ids=None, attention_mask=None, labels=y.clamp(min=0))
        loss = (per_token.float() * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses


def table(rows: list[dict]) -> str:
    lines = [f"  {'task':<5} {'length':>7} {'keys/depth':>10} {'accuracy':>9} {'queries':>8}"]
    for row in rows:
        setting = row["keys"] if row["task"] == "mqar" else f"{row['depth']:.2f}"
        lines.append(f"  {row['task']:<5} {row['length']:>7} {setting:>10} {row['accuracy']:>9.3f} "
                     f"{row['queries']:>8}")
    return "\n".join(lines)


def _ints(text: str, what: str) -> list:
    try:
        return parse_lengths(text)
    except UserError:
        raise UserError(f"--{what} {text!r}: write increasing positive integers such as 4,16,64") from None


def settings_from(args) -> RecallSettings:
    try:
        depths = [float(d) for d in args.depths.split(",")]
    except ValueError:
        depths = [-1.0]
    if not all(0 <= d <= 1 for d in depths):
        raise UserError(f"--depths {args.depths!r}: write relative depths in [0, 1] such as 0.1,0.5,0.9")
    return RecallSettings(_ints(args.lengths, "lengths"), _ints(args.keys, "keys"), depths, args.samples,
                          args.vocab, args.seed)


def _trained(args, settings: RecallSettings):
    """A fresh model of the run config's model section, trained on MQAR for --train-steps."""
    cfg = load_config(args.train_config, args.overrides)
    loaded = fresh(preset(cfg.model.preset, **cfg.model.overrides), seed=cfg.train.seed)
    steps, length = args.train_steps or cfg.train.steps, args.train_length or loaded.cfg.seq_length
    if not 4 <= length <= loaded.cfg.seq_length:
        raise UserError(f"--train-length {length}: MQAR trains at 4 to model.seq_length ({loaded.cfg.seq_length}) "
                        "tokens; give a length in that range")
    t0 = time.perf_counter()
    losses = train_mqar(loaded, settings, steps, cfg.batch.global_batch_size, cfg.optimizer.lr,
                        cfg.optimizer.grad_clip, length)
    print(f"trained {loaded.path} on MQAR at {length} tokens for {steps} steps in {time.perf_counter() - t0:.0f} s: "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return loaded, {"train_config": args.train_config, "overrides": args.overrides, "steps": steps,
                    "length": length, "losses": [losses[0], losses[-1]]}


def run(args) -> int:
    settings = settings_from(args)
    if bool(args.checkpoint) == bool(args.train_config):
        raise UserError("give either --checkpoint PATH (zero-shot) or --train-config CONFIG (train on MQAR first)")
    if args.checkpoint and (args.train_steps or args.train_length or args.overrides):
        raise UserError("--train-steps, --train-length and key=value overrides train a fresh model: use them with "
                        "--train-config CONFIG, not with --checkpoint (which is scored zero-shot)")
    if args.checkpoint:
        loaded, trained = load(args.checkpoint, args.precision, max_length=max(settings.lengths)), None
    else:
        loaded, trained = _trained(args, settings)
    rows = evaluate(loaded.model, settings, loaded.cfg.vocab_size, loaded.device)
    print(f"{loaded.path} ({loaded.cfg.pattern}, trained at {loaded.cfg.seq_length}):\n{table(rows)}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    record = {"meta": {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "checkpoint": loaded.path,
                       "pattern": loaded.cfg.pattern, "settings": asdict(settings), "trained": trained},
              "rows": rows}
    with open(os.path.join(args.out, "recall.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}/recall.json", flush=True)
    return 0
