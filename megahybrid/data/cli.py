"""`megahybrid data tokenizer|preprocess|builtin`.

The top-level CLI calls `add_data_commands(subparsers)` to get a `data` command and dispatches to `run(args)`,
which returns the exit code. Stand-alone: `python -m megahybrid.data.cli tokenizer ...`.
User errors print one line `error: ...` to stderr and give exit code 2, without a traceback.
"""
import argparse
import sys

from megahybrid.errors import EXIT_USER_ERROR, DataError


def add_data_commands(subparsers) -> argparse.ArgumentParser:
    """Add the `data` command (with its sub-commands) to a top-level argparse `subparsers`; returns its parser."""
    data = subparsers.add_parser("data", help="train a tokenizer, preprocess text, prepare the built-in corpus")
    _add_subcommands(data)
    return data


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="data_command", required=True, metavar="{tokenizer,preprocess,builtin}")

    tok = commands.add_parser("tokenizer", help="train a SentencePiece model from .txt/.jsonl/.parquet files")
    _add_input_args(tok)
    tok.add_argument("--vocab-size", type=int, required=True, help="number of tokens, specials included")
    tok.add_argument("--output", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    tok.add_argument("--max-sentences", type=int, default=2_000_000, help="lines sampled for training")

    pre = commands.add_parser("preprocess", help="tokenize files into megatron .bin/.idx, EOD after each document")
    _add_input_args(pre)
    pre.add_argument("--tokenizer", required=True, help="SentencePiece .model file")
    pre.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    pre.add_argument("--workers", type=int, default=1, help="tokenizing processes")

    builtin = commands.add_parser("builtin", help="generate, tokenize and preprocess the built-in corpus (cached)")
    builtin.add_argument("--output", default="data/builtin", help="output directory")
    builtin.add_argument("--vocab-size", type=int, default=2048)
    builtin.add_argument("--num-docs", type=int, default=12000)
    builtin.add_argument("--seed", type=int, default=0)
    builtin.add_argument("--workers", type=int, default=1)


def _add_input_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, help="local .txt[.xz|.gz], .jsonl or .parquet files")
    parser.add_argument("--text-key", default="text", help="json field / parquet column holding the text")
    parser.add_argument(
        "--text-sample-by", choices=["paragraph", "line", "document"], default="paragraph",
        help="what one document is in plain-text inputs",
    )
    parser.add_argument("--hf-cache", default=None, help="datasets cache directory (default: HF_DATASETS_CACHE)")


def run(args: argparse.Namespace) -> int:
    """Run the parsed `data` sub-command; returns the process exit code."""
    try:
        print(_dispatch(args))
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _dispatch(args: argparse.Namespace) -> str:
    # preprocess and builtin import numpy and sentencepiece: loaded for the command that runs, not at CLI start.
    if args.data_command == "tokenizer":
        from megahybrid.data.preprocess import train_tokenizer

        model = train_tokenizer(
            args.input, args.output, args.vocab_size, args.text_key, args.text_sample_by, args.max_sentences,
            args.hf_cache,
        )
        return f"wrote {model}"
    if args.data_command == "preprocess":
        from megahybrid.data.preprocess import preprocess

        meta = preprocess(
            args.input, args.tokenizer, args.output_prefix, args.workers, args.text_key, args.text_sample_by,
            args.hf_cache,
        )
        return f"wrote {args.output_prefix}.bin/.idx: {meta['documents']} documents, {meta['tokens']} tokens"
    from megahybrid.data.builtin import prepare_builtin

    data = prepare_builtin(args.output, args.vocab_size, args.num_docs, args.seed, args.workers)
    return f"built-in corpus ready: data.prefixes=[{data.prefix}] data.tokenizer_model={data.tokenizer_model}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megahybrid.data.cli", description=__doc__.splitlines()[0])
    _add_subcommands(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
