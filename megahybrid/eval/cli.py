"""`megahybrid eval ppl|recall|harness` and `megahybrid generate` (parsers and dispatch)."""
from importlib import import_module

DEFAULT_LENGTHS = "1K,2K,4K,8K,16K"


def _add_common(parser, checkpoint_required: bool = True) -> None:
    parser.add_argument("--checkpoint", required=checkpoint_required, help="a training checkpoint directory (its "
                        "latest), a step directory, a consolidated or a Hugging Face directory; any saved layout")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: bf16 on a GPU, "
                        "fp32 on the CPU")


def add_eval_commands(subparsers) -> None:
    commands = subparsers.add_parser("eval", help="perplexity by position, synthetic recall, lm-eval tasks")
    sub = commands.add_subparsers(dest="eval_command", required=True)
    ppl = sub.add_parser("ppl", help="perplexity by position bucket (extrapolation curve): table, PNG, JSON, "
                         "TensorBoard")
    ppl.add_argument("--checkpoint", required=True, nargs="+", action="extend", help="one or more (one plot)")
    ppl.add_argument("--precision", choices=("fp32", "bf16"), default=None)
    ppl.add_argument("--data", required=True, help="indexed dataset prefix (PREFIX.bin/.idx), held-out text")
    ppl.add_argument("--lengths", default=DEFAULT_LENGTHS, help="bucket ends, e.g. 1K,2K,4K (the last is the "
                     "window length)")
    ppl.add_argument("--tokens", type=int, default=None, help="tokens to score (default: 8 windows)")
    ppl.add_argument("--out", default="runs/eval/ppl")
    _add_recall(sub)
    harness = sub.add_parser("harness", help="lm-evaluation-harness tasks (needs megahybrid[eval])")
    _add_common(harness)
    harness.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. piqa,hellaswag")
    harness.add_argument("--include-path", default=None, help="a directory of local task YAML files")
    harness.add_argument("--num-fewshot", type=int, default=None)
    harness.add_argument("--limit", type=int, default=None, help="examples per task")
    harness.add_argument("--max-length", type=int, default=None, help="context limit (default model.seq_length)")
    harness.add_argument("--out", default="runs/eval/harness")


def _add_recall(sub) -> None:
    recall = sub.add_parser("recall", help="MQAR and needle-in-a-haystack accuracy per length and key count")
    _add_common(recall, checkpoint_required=False)
    recall.add_argument("--train-config", default=None, help="instead of --checkpoint: train the model of this run "
                        "config on MQAR first (its optimizer.lr, batch.global_batch_size, model.seq_length)")
    recall.add_argument("--train-steps", type=int, default=None, help="default: the config's train.steps")
    recall.add_argument("--train-length", type=int, default=None,
                        help="MQAR training sequence length (default: the config's model.seq_length)")
    recall.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides for --train-config")
    recall.add_argument("--lengths", default="256,512,1024")
    recall.add_argument("--keys", default="4,16,64", help="MQAR key counts")
    recall.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (fraction of the length)")
    recall.add_argument("--samples", type=int, default=64, help="sequences per setting")
    recall.add_argument("--vocab", type=int, default=None, help="token ids used (default: the whole vocabulary)")
    recall.add_argument("--seed", type=int, default=0)
    recall.add_argument("--out", default="runs/eval/recall")


def add_generate_command(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="sample a continuation through the decode caches (tokens/s)")
    _add_common(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-length", type=int, default=None, help="prompt + new tokens limit (default "
                     "model.seq_length, the training context)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-document token")


def run(args) -> int:
    # Every command's module imports torch and megatron: only the one that runs is loaded, not at CLI start.
    name = "generate" if args.command == "generate" else args.eval_command
    return import_module(f"megahybrid.eval.{name}").run(args)
