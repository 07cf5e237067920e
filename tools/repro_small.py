"""Small-scale reproduction (issue #20): ~20M-parameter `S`, `D`, `I` (plain and gated: `Ig`), `G` and NAtS-L Hybrid
models trained on the same tokens with one recipe (megahybrid/configs/repro-small.yaml), then `megahybrid eval ppl`
(position buckets to 4x the training context, on the validation split) and `megahybrid eval recall` on each: MQAR
and needle accuracy of a fresh model of each architecture trained on MQAR for --mqar-steps (the usual MQAR
protocol; 0: zero-shot on the language models, where a ~20M model scores ~0 and the comparison says nothing);
writes RESULTS.json and RESULTS.md (default tools/results/repro-small) with date, GPU and commit.

DATA_DIR holds what tools/prepare_wikipedia.py writes: tokenizer.model, train_text_document.{bin,idx} and
valid_text_document.{bin,idx}. A token budget larger than the training split repeats it (epochs are reported).
The files for one GPU call (they must travel with the checkout, 64 MiB in all; 22.9M training tokens, 50.5 MB):
    python tools/prepare_wikipedia.py --out-dir data/wikipedia-en-8k --vocab-size 8192 --max-docs 1900 \
        --splits train,valid

Usage: python tools/repro_small.py --data-dir data/wikipedia-en --tokens 25000000 [--models S,D,I,Ig,G,H]
       [--parallel N] [--run-root DIR] [--results PATH] [--deadline-s S] [--mqar-steps N] [--mqar-batch N]
       [--mqar-length N] [--recall-only] [key=value ...] (overrides for every training run). With --deadline-s the
       training stops in time (checkpoints saved, exit 3) and the same command continues it, so a budget longer than
       one device call runs over several calls on a warm machine. Recall runs --parallel models at once too.
       --recall-only measures the recall of fresh MQAR-trained models alone (no checkpoint needed) and merges it
       into the existing RESULTS.json: for a run whose device time ended before or during its recall stage
       (RESULTS.json is written with training and perplexity before that stage starts, and each model's recall as
       soon as it is measured; `--recall-only --models` names the models still missing).
"""
import argparse
import json
import os
import shutil
import statistics
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megahybrid.errors import EXIT_USER_ERROR, UserError  # noqa: E402

CONFIG = "repro-small"
# Model label -> layer pattern; H is the NAtS-L Hybrid (Gated DeltaNet with NAtS-L at layers 3 and 7 of 8), Ig the
# `I` layer with its SiLU output gate (off in `I` as in the paper's 1.3B runs; at this scale it took the validation
# perplexity from 125 to 53: tools/results/interdomain-ablation.md).
MODELS = {"S": "S", "D": "D", "I": "I", "Ig": "I", "G": "G", "H": "GGGNGGGN"}
MODEL_OVERRIDES = {"Ig": ["model.interdomain.output_gate=true"]}  # before the command line's, which win
MQAR_KEYS = (4, 16, 64)


@dataclass(frozen=True)
class Mqar:
    """How each architecture's fresh model is trained on MQAR before its recall is measured (steps 0: none, the
    trained language models zero-shot). batch None: the run's; length: capped at the run's context."""

    steps: int
    batch: int | None = None
    length: int = 256
    vocab: int | None = None  # token ids of the task (eval recall --vocab); None: the model's vocabulary
    overrides: tuple = ()  # key=value for the MQAR model and optimizer only (a narrower model, another lr)

    def train_length(self, seq: int) -> int:
        return min(self.length, seq)

    def args(self, config: str, seq: int) -> list:
        batch = [f"batch.global_batch_size={self.batch}", f"batch.micro_batch_size={self.batch}"] if self.batch else []
        vocab = ["--vocab", str(self.vocab)] if self.vocab else []
        return ["--train-config", config, "--train-steps", str(self.steps), "--train-length",
                str(self.train_length(seq)), *vocab, *batch, *self.overrides]

    def record(self, seq: int) -> dict:
        """The results meta's description of this protocol (rows of two protocols never share a table)."""
        return {"mqar_steps": self.steps, "mqar_batch": self.batch, "mqar_length": self.train_length(seq),
                "mqar_vocab": self.vocab, "mqar_overrides": list(self.overrides)}


def data_files(data_dir: str) -> dict:
    files = {"tokenizer": os.path.join(data_dir, "tokenizer.model"),
             "train": os.path.join(data_dir, "train_text_document"),
             "valid": os.path.join(data_dir, "valid_text_document")}
    missing = [p for p in (files["tokenizer"], *(files[s] + e for s in ("train", "valid") for e in (".bin", ".idx")))
               if not os.path.isfile(p)]
    if missing:
        raise UserError(f"--data-dir {data_dir}: missing {missing[0]}; run tools/prepare_wikipedia.py --out-dir "
                        f"{data_dir} first")
    return files


def dataset_tokens(prefix: str) -> int:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # held while summing: sequence_lengths views its memory map
    return int(np.asarray(dataset.sequence_lengths, dtype=np.int64).sum())


def tokenizer_vocab(model_file: str) -> int:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=model_file).vocab_size()


def run_overrides(label: str, files: dict, tokens: int, run_root: str, extra: list) -> list:
    """The training overrides of one model: its pattern and run_dir, the data, and steps for the token budget."""
    from megahybrid.train.config import load_config

    base = load_config(CONFIG, extra)
    seq = base.model.overrides["seq_length"]
    steps = max(1, tokens // (base.batch.global_batch_size * seq))
    return [f"model.pattern={MODELS[label]}", f"run_dir={os.path.join(run_root, label)}",
            f"model.vocab_size={tokenizer_vocab(files['tokenizer'])}", f"data.tokenizer_model={files['tokenizer']}",
            f"data.train_prefixes=[{files['train']}]", f"data.valid_prefixes=[{files['valid']}]",
            f"train.steps={steps}", f"optimizer.warmup_steps={max(1, steps // 10)}",
            f"checkpoint.interval={steps}", f"eval.interval={steps}", *MODEL_OVERRIDES.get(label, []), *extra]


class Unfinished(Exception):
    """A training run stopped at the deadline (it saved a checkpoint; the same command resumes it)."""


def megahybrid_process(argv: list, log: str, gpu: int | None, deadline: float | None = None) -> int:
    """`python -m megahybrid ARGV` in a process of its own (fresh process groups and GPU memory) on GPU `gpu`,
    appending its output to `log` (a resumed run continues its log); its exit code. At the deadline
    (time.monotonic()) it gets SIGTERM: the trainer saves a checkpoint and exits with EXIT_REQUEUE."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    with open(log, "a") as f:
        proc = subprocess.Popen([sys.executable, "-m", "megahybrid", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO)
        try:
            return proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            return proc.wait()


def failed(what: str, code: int, log: str, lines: int) -> UserError:
    tail = open(log).read().strip().splitlines()[-lines:]
    return UserError(f"{what} failed with exit {code}: {' | '.join(tail)}")


def on_gpus(labels: list, parallel: int, fn) -> dict:
    """fn(label, gpu) for every label, `parallel` at once, spread over the GPUs (None without one); the finished
    futures by label."""
    import torch

    gpus = torch.cuda.device_count()
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return {label: pool.submit(fn, label, i % gpus if gpus else None) for i, label in enumerate(labels)}


def train(label: str, overrides: list, run_root: str, gpu: int | None, deadline: float | None) -> None:
    """One `megahybrid train` run, its log in the run dir; Unfinished when stopped at the deadline."""
    from megahybrid.train.signals import EXIT_REQUEUE

    run_dir = os.path.join(run_root, label)
    os.makedirs(run_dir, exist_ok=True)
    log = os.path.join(run_dir, "train.log")
    code = megahybrid_process(["train", "--config", CONFIG, *overrides], log, gpu, deadline)
    print(f"{label}: trained (exit {code}), log {log}", flush=True)
    if code == EXIT_REQUEUE:
        raise Unfinished(label)
    if code:
        raise failed(f"training {label}", code, log, 5)


def train_all(labels: list, overrides: dict, run_root: str, parallel: int, deadline: float | None) -> list:
    """Trains every model; returns the labels stopped at the deadline (none when all finished)."""
    jobs = on_gpus(labels, parallel, lambda label, gpu: train(label, overrides[label], run_root, gpu, deadline))
    unfinished = []
    for label, job in jobs.items():
        try:
            job.result()
        except Unfinished:
            unfinished.append(label)
    return unfinished


def training_record(run_dir: str) -> dict:
    """Throughput (median over logged steps after the first: compilation and warm-up), final losses."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rates = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r]
    valid = [r for r in rows if "valid/perplexity" in r]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    return {"tokens_per_s": statistics.median(rates[1:] or rates) if rates else None,
            "train_loss": losses[-1] if losses else None,
            "valid_ppl": valid[-1]["valid/perplexity"] if valid else None,
            "steps": max(r["step"] for r in rows)}


def cli(argv: list) -> None:
    from megahybrid.cli import main

    code = main(argv)
    if code:
        raise UserError(f"megahybrid {' '.join(argv[:2])} failed with exit {code}")


def evaluate_ppl(labels: list, files: dict, run_root: str, seq: int) -> dict:
    """eval ppl of every model on one plot (buckets seq/4 .. 4 seq): {label: its result}."""
    ckpts = [os.path.join(run_root, label, "checkpoints") for label in labels]
    lengths = ",".join(str(n) for n in (seq // 4, seq // 2, seq, 2 * seq, 4 * seq))
    ppl_dir = os.path.join(run_root, "eval-ppl")
    cli(["eval", "ppl", "--checkpoint", *ckpts, "--data", files["valid"], "--lengths", lengths,
         "--tokens", str(32 * 4 * seq), "--out", ppl_dir])
    return dict(zip(labels, json.load(open(os.path.join(ppl_dir, "ppl.json")))["results"]))


def recall_all(labels: list, run_root: str, seq: int, mqar: Mqar, parallel: int, done) -> None:
    """eval recall of each architecture, `parallel` at once: a fresh model of its run config trained on MQAR as
    `mqar` says, or (mqar.steps 0) its trained language model zero-shot. done(label, rows) as each finishes, one at
    a time: a call cut later keeps what finished."""
    lock = threading.Lock()

    def one(label, gpu):
        rows = recall_one(label, run_root, seq, mqar, gpu)
        with lock:
            done(label, rows)

    for job in on_gpus(labels, parallel, one).values():
        job.result()


def recall_one(label: str, run_root: str, seq: int, mqar: Mqar, gpu: int | None) -> list:
    out = os.path.join(run_root, f"eval-recall-{label}")
    if mqar.steps:
        source = mqar.args(os.path.join(run_root, label, "config.yaml"), seq)
    else:
        source = ["--checkpoint", os.path.join(run_root, label, "checkpoints")]
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "recall.log")
    code = megahybrid_process(["eval", "recall", "--lengths", f"{seq // 4},{seq // 2},{seq}", "--keys",
                               ",".join(map(str, MQAR_KEYS)), "--out", out, *source], log, gpu)
    if code:
        raise failed(f"eval recall of {label}", code, log, 3)
    print(f"{label}: recall measured, log {log}", flush=True)
    return json.load(open(os.path.join(out, "recall.json")))["rows"]


def record(labels: list, files: dict, tokens: int, run_root: str, ppl: dict) -> dict:
    """Training, parameters and perplexity of every model; recall pending (merge_recall adds it)."""
    import torch

    from megahybrid.outputs import git_commit
    from megahybrid.model.config import count_parameters, preset
    from megahybrid.train.config import load_config

    models = {}
    for label in labels:
        cfg = load_config(os.path.join(run_root, label, "config.yaml"))
        model = preset(cfg.model.preset, **cfg.model.overrides)
        models[label] = {"pattern": model.pattern, "parameters": count_parameters(model),
                         "tokens": cfg.train.steps * cfg.batch.global_batch_size * model.seq_length,
                         "train": training_record(cfg.run_dir), "ppl_buckets": ppl[label]["buckets"], "recall": []}
    available = dataset_tokens(files["train"])
    return {"meta": {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                     "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "config": CONFIG, "data": os.path.dirname(files["train"]), "tokens_requested": tokens,
                     "train_tokens_available": available, "epochs": tokens / available,
                     "train_length": model.seq_length, "mqar_steps": None, "mqar_batch": None,
                     "mqar_length": None},
            "models": models}


def markdown(result: dict) -> str:
    meta, models = result["meta"], result["models"]
    first = next(iter(models.values()))
    buckets = [b["bucket"] for b in first["ppl_buckets"]]
    mqar = sorted({(r["length"], r["keys"]) for m in models.values() for r in m["recall"] if r["task"] == "mqar"})
    columns = ["model", "pattern", "params", "tok/s", "valid ppl", *(f"ppl {b}" for b in buckets),
               *(f"MQAR {n}/{k}" for n, k in mqar), "NIAH mean"]
    lines = [f"# Small-scale reproduction ({meta['date']}, {meta['gpu']}, commit {meta['commit']})", "",
             f"Config `{meta['config']}`, data `{meta['data']}`, {meta['tokens_requested']:,} tokens per model "
             f"({meta['epochs']:.2f} epochs of {meta['train_tokens_available']:,} training tokens), trained at "
             f"{meta['train_length']}; perplexity on the validation split by position bucket (past "
             f"{meta['train_length']}: extrapolation); MQAR / needle ({_recall_source(meta)}; MQAR length/keys). "
             "H is the NAtS-L Hybrid.",
             "",
             "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += [_row(label, m, mqar) for label, m in models.items()]
    lines += ["", meta["note"]] if meta.get("note") else []
    return "\n".join(lines) + "\n"


def _recall_source(meta: dict) -> str:
    steps, batch = meta.get("mqar_steps"), meta.get("mqar_batch")
    if steps is None:
        return "not measured yet"
    at = f" at commit {meta['recall_commit']}" if meta.get("recall_commit") else ""
    per_step = f" of {batch} sequences" if batch else ""
    per_step += f" of {meta['mqar_length']} tokens" if meta.get("mqar_length") else ""
    per_step += f", task vocabulary {meta['mqar_vocab']}" if meta.get("mqar_vocab") else ""
    per_step += f", MQAR model {' '.join(meta['mqar_overrides'])}" if meta.get("mqar_overrides") else ""
    return (f"a fresh model of each architecture trained on MQAR for {steps} steps{per_step}{at}" if steps
            else "zero-shot on the language models")


def _row(label: str, m: dict, mqar: list) -> str:
    acc = {(r["length"], r["keys"]): r["accuracy"] for r in m["recall"] if r["task"] == "mqar"}
    niah = [r["accuracy"] for r in m["recall"] if r["task"] == "niah"]
    train = m["train"]
    cells = [label, f"`{m['pattern']}`", f"{m['parameters'] / 1e6:.1f}M",
             f"{train['tokens_per_s']:,.0f}" if train["tokens_per_s"] else "-",
             f"{train['valid_ppl']:.2f}" if train["valid_ppl"] else "-",
             *(f"{b['ppl']:.2f}" for b in m["ppl_buckets"]), *(f"{acc[s]:.3f}" if s in acc else "-" for s in mqar),
             f"{statistics.mean(niah):.3f}" if niah else "-"]
    return "| " + " | ".join(cells) + " |"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.path.join(REPO, "data", "wikipedia-en"))
    parser.add_argument("--tokens", type=int, default=25_000_000, help="training tokens per model")
    parser.add_argument("--models", default=",".join(MODELS), help=f"a subset of {','.join(MODELS)}")
    parser.add_argument("--parallel", type=int, default=1, help="models trained at once (spread over the GPUs)")
    parser.add_argument("--run-root", default=None, help="default runs/repro-small-<tokens>")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="stop training after this many seconds (checkpoints saved, exit 3); the same command "
                             "continues")
    parser.add_argument("--mqar-steps", type=int, default=2000,
                        help="MQAR training steps of the fresh model whose recall is measured per architecture "
                             "(default 2000; 0: zero-shot on the trained language models)")
    parser.add_argument("--mqar-batch", type=int, default=None,
                        help="sequences per MQAR training step (default: the run's batch.global_batch_size)")
    parser.add_argument("--mqar-length", type=int, default=256,
                        help="MQAR training length, capped at the run's context: a few times the largest key count "
                             "keeps the queries dense (at 1024 tokens 500 steps taught no model recall)")
    parser.add_argument("--mqar-vocab", type=int, default=None,
                        help="token ids of the recall tasks (eval recall --vocab; default: the model's): a small one "
                             "(256: 83 values) is learned in far fewer steps than 8192 (2729 values)")
    parser.add_argument("--mqar-overrides", default="",
                        help="comma-separated key=value for the MQAR model only, e.g. model.hidden_size=128,"
                             "model.num_heads=2,optimizer.lr=1e-3 (a zoology-style narrow model per mixer)")
    parser.add_argument("--recall-only", action="store_true",
                        help="measure recall only and merge it into the existing PATH.json (no training)")
    parser.add_argument("--results", default=os.path.join(REPO, "tools", "results", "repro-small"),
                        help="writes PATH.json, PATH.md and PATH.png")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="for every training run")
    return parser.parse_args(argv)


def run(args) -> int:
    from megahybrid.eval.recall import mqar_min_vocab  # torch: the tool imports it only once it runs

    labels = [m for m in args.models.split(",") if m]
    if (not labels or set(labels) - set(MODELS) or args.tokens < 1 or args.parallel < 1 or args.mqar_steps < 0
            or (args.mqar_batch is not None and args.mqar_batch < 1) or args.mqar_length < 4
            or (args.mqar_vocab is not None and args.mqar_vocab < mqar_min_vocab(max(MQAR_KEYS)))
            or any("=" not in o for o in args.mqar_overrides.split(",") if o)):
        raise UserError(f"--models {args.models} --tokens {args.tokens} --parallel {args.parallel} --mqar-steps "
                        f"{args.mqar_steps} --mqar-batch {args.mqar_batch} --mqar-length {args.mqar_length} "
                        f"--mqar-vocab {args.mqar_vocab} --mqar-overrides {args.mqar_overrides!r}: choose models from "
                        f"{','.join(MODELS)}, a positive token budget, --parallel >= 1, --mqar-steps >= 0, "
                        f"--mqar-batch >= 1, --mqar-length >= 4, --mqar-vocab >= {mqar_min_vocab(max(MQAR_KEYS))} (the "
                        "largest key count fits) and key=value overrides")
    files = data_files(os.path.abspath(args.data_dir))
    existing = existing_results(args) if args.recall_only else None
    run_root = os.path.abspath(args.run_root or os.path.join(REPO, "runs", f"repro-small-{args.tokens}"))
    overrides = {label: run_overrides(label, files, args.tokens, run_root, args.overrides) for label in labels}
    from megahybrid.train.config import load_config

    seq = load_config(CONFIG, args.overrides).model.overrides["seq_length"]
    if existing is not None:
        return recall_only(args, existing, labels, overrides, run_root, seq)
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    unfinished = train_all(labels, overrides, run_root, args.parallel, deadline)
    if unfinished:
        from megahybrid.train.signals import EXIT_REQUEUE

        print(f"stopped at --deadline-s {args.deadline_s:g}: {','.join(unfinished)} not finished (checkpoints "
              f"saved in {run_root}); run the same command again to continue", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    result = record(labels, files, args.tokens, run_root, evaluate_ppl(labels, files, run_root, seq))
    write(args.results, result)  # before the recall stage: a call that ends during it keeps this (--recall-only)
    shutil.copyfile(os.path.join(run_root, "eval-ppl", "ppl.png"), args.results + ".png")
    mqar = mqar_of(args)
    recall_all(labels, run_root, seq, mqar, args.parallel,
               lambda label, rows: merge_recall(mqar, args.results, result, label, rows))
    return 0


def mqar_of(args) -> Mqar:
    return Mqar(args.mqar_steps, args.mqar_batch, args.mqar_length, args.mqar_vocab,
                tuple(o for o in args.mqar_overrides.split(",") if o))


def existing_results(args) -> dict:
    if not args.mqar_steps:
        raise UserError("--recall-only trains fresh models on MQAR: give --mqar-steps N > 0")
    try:
        with open(args.results + ".json") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"--recall-only merges into {args.results}.json, which cannot be read ({err}); run "
                        "tools/repro_small.py without --recall-only first") from None


def recall_only(args, result: dict, labels: list, overrides: dict, run_root: str, seq: int) -> int:
    """Recall of fresh models trained on MQAR (it needs no trained checkpoint) merged into the existing results:
    what a training run that ran out of device time before its recall stage still lacks."""
    from megahybrid.train.config import load_config

    labels = [label for label in labels if label in result["models"]]
    if not labels:
        raise UserError(f"--recall-only: none of --models {args.models} is in {args.results}.json")
    for label in labels:
        config = os.path.join(run_root, label, "config.yaml")
        if not os.path.isfile(config):  # the training's run dir is gone: the same config, written again
            os.makedirs(os.path.dirname(config), exist_ok=True)
            with open(config, "w") as f:
                f.write(load_config(CONFIG, overrides[label]).to_yaml())
    mqar = mqar_of(args)
    drop_other_protocol(result, mqar)
    recall_all(labels, run_root, seq, mqar, args.parallel,
               lambda label, rows: merge_recall(mqar, args.results, result, label, rows))
    return 0


def drop_other_protocol(result: dict, mqar: Mqar) -> None:
    """Forget every model's recall rows when they were measured with another MQAR training (steps, batch, length,
    task vocabulary, model overrides; files from before the last two have neither) than this run's: the results
    meta names one protocol, so rows of two must not share a table. Written at the first merge (merge_recall), so
    an unchanged file stays as it was until a row of the new protocol exists."""
    meta, want = result["meta"], mqar.record(result["meta"]["train_length"])
    if {key: meta.get(key, [] if key == "mqar_overrides" else None) for key in want} != want:
        for model in result["models"].values():
            model["recall"] = []


def merge_recall(mqar: Mqar, path: str, result: dict, label: str, rows: list) -> None:
    """One model's recall rows into the results, written at once."""
    from megahybrid.outputs import git_commit

    result["models"][label]["recall"] = rows
    result["meta"].update(mqar.record(result["meta"]["train_length"]), recall_commit=git_commit(),
                          recall_date=time.strftime("%Y-%m-%d"))
    write(path, result)


def write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result) + f"wrote {path}.json and .md", flush=True)


def main(argv=None) -> int:
    try:
        return run(parse(argv))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
