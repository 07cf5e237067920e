"""Tokenize the local English Wikipedia sample into megatron .bin/.idx, one prefix per split.

Reads `INPUT_DIR/{train-*,valid,test}.txt.xz` in place (default `../shared/data/wikipedia-en` next to the
repository; nothing is copied into it) and writes under OUT_DIR (default `data/wikipedia-en/`, git-ignored):
  tokenizer.model / .vocab            SentencePiece BPE trained on a sample of training articles
  {train,valid,test}_text_document.*  one document per article, EOD after each
and prints the `data.*` overrides to train on them (per-split blends, since the corpus comes pre-split), ready to
paste after `megahybrid train --config ...`.

Article splitting. The files hold articles as a title line followed by paragraphs, every block separated by
one blank line, with no explicit article boundary. A block starts a new article when it is a single line of at
most 120 characters and 15 words that does not end like a sentence (. ! ? , ; :) and the block before it
did (or the file starts). A missed or spurious boundary only merges or splits an article, which changes
nothing for packed language-model samples. Title-only articles (no paragraph) are dropped.

Usage: python tools/prepare_wikipedia.py [--input-dir DIR] [--out-dir DIR] [--vocab-size 32000] [--max-docs N]
       [--workers N]
"""
import argparse
import glob
import lzma
import os
import random
import sys
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megahybrid.data.preprocess import preprocess_dataset  # noqa: E402
from megahybrid.data.tokenizer import train_sentencepiece  # noqa: E402
from megahybrid.errors import EXIT_USER_ERROR, DataError  # noqa: E402

DEFAULT_INPUT = os.path.join(os.path.dirname(REPO), "shared", "data", "wikipedia-en")
SPLIT_FILES = {"train": "train-*.txt.xz", "valid": "valid.txt.xz", "test": "test.txt.xz"}
_SENTENCE_END = (".", "!", "?", ",", ";", ":")


def is_title(block: list[str], previous: list[str] | None) -> bool:
    """The article-boundary heuristic described in the module docstring."""
    if len(block) != 1:
        return False
    line = block[0].strip()
    looks_like_title = 0 < len(line) <= 120 and len(line.split()) <= 15 and not line.endswith(_SENTENCE_END)
    previous_ended = previous is None or previous[-1].rstrip().endswith(_SENTENCE_END + ('"', ")", "'"))
    return looks_like_title and previous_ended


def iter_blocks(path: str) -> Iterator[list[str]]:
    """Blank-line separated blocks of non-empty lines."""
    block: list[str] = []
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                block.append(line.rstrip("\n"))
            elif block:
                yield block
                block = []
    if block:
        yield block


def iter_articles(paths: list[str], max_docs: int | None = None) -> Iterator[dict]:
    """{"text": title + blank line + paragraphs} per article, in file order."""
    count = 0
    for path in paths:
        title, paragraphs, previous = None, [], None
        for block in iter_blocks(path):
            if is_title(block, previous):
                if title is not None and paragraphs:
                    yield {"text": "\n\n".join([title] + paragraphs)}
                    count += 1
                    if max_docs is not None and count >= max_docs:
                        return
                title, paragraphs = block[0].strip(), []
            else:
                paragraphs.append("\n".join(block))
            previous = block
        if title is not None and paragraphs:
            yield {"text": "\n\n".join([title] + paragraphs)}
            count += 1
            if max_docs is not None and count >= max_docs:
                return


def split_paths(input_dir: str, split: str) -> list[str]:
    paths = sorted(glob.glob(os.path.join(input_dir, SPLIT_FILES[split])))
    if not paths:
        raise DataError(f"--input-dir: no {SPLIT_FILES[split]} in {input_dir}: point --input-dir at the "
                        "wikipedia-en folder")
    return paths


def articles_dataset(paths: list[str], max_docs: int | None, cache_dir: str):
    import datasets

    return datasets.Dataset.from_generator(
        iter_articles, gen_kwargs={"paths": paths, "max_docs": max_docs}, cache_dir=cache_dir
    )


def train_tokenizer(paths: list[str], out_dir: str, vocab_size: int, sample_docs: int, max_docs: int | None) -> str:
    """Train on `sample_docs` articles drawn with a fixed seed from the first training articles read."""
    pool = list(iter_articles(paths, max_docs=max(sample_docs * 4, 1) if max_docs is None else max_docs))
    sample = random.Random(0).sample(pool, min(sample_docs, len(pool)))
    return train_sentencepiece((doc["text"] for doc in sample), os.path.join(out_dir, "tokenizer"), vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-dir", default=DEFAULT_INPUT, help="the wikipedia-en folder (default: %(default)s)")
    parser.add_argument("--out-dir", default="data/wikipedia-en")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--tokenizer-sample-docs", type=int, default=20000, help="articles to train the tokenizer on")
    parser.add_argument("--max-docs", type=int, default=None, help="articles per input file (for quick tries)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--splits", default="train,valid,test")
    args = parser.parse_args(argv)
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        cache_dir = os.path.join(args.out_dir, "hf-cache")
        model = train_tokenizer(
            split_paths(args.input_dir, "train"), args.out_dir, args.vocab_size, args.tokenizer_sample_docs,
            args.max_docs,
        )
        print(f"tokenizer: {model}")
        prefixes = {}
        for split in args.splits.split(","):
            docs = articles_dataset(split_paths(args.input_dir, split), args.max_docs, cache_dir)
            prefixes[split] = os.path.join(args.out_dir, f"{split}_text_document")
            meta = preprocess_dataset(docs, model, prefixes[split], args.workers)
            print(f"{split}: {meta['documents']} articles, {meta['tokens']} tokens -> {prefixes[split]}")
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    print("overrides: " + train_overrides(model, prefixes))
    return 0


def train_overrides(tokenizer_model: str, prefixes: dict[str, str]) -> str:
    """`megahybrid train` overrides for the prepared files (absolute paths, so they work from any directory)."""
    fields = [f"data.tokenizer_model={os.path.abspath(tokenizer_model)}"]
    fields += [f"data.{split}_prefixes=[{os.path.abspath(prefix)}]" for split, prefix in prefixes.items()]
    return " ".join(fields)


if __name__ == "__main__":
    sys.exit(main())
