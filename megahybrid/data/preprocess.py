"""Raw text -> SentencePiece model, and raw text -> megatron-core indexed dataset (.bin/.idx).

Inputs are read through Hugging Face `datasets` by extension: .jsonl/.json (field `text_key`), .parquet
(column `text_key`), anything else as plain text (optionally .gz/.xz/...), one document per `text_sample_by`
unit: "paragraph" (blank-line separated, the default), "line" or "document" (whole file).
The output is one sequence per document, its tokens followed by EOD, written with megatron-core's
`IndexedDatasetBuilder`; a sidecar `PREFIX.json` records the tokenizer so training can detect a mismatch.
"""
import gzip
import json
import lzma
import os
from collections.abc import Iterator

import numpy as np

from megahybrid.data.tokenizer import SentencePieceTokenizer, file_sha256, train_sentencepiece
from megahybrid.errors import DataError
from megahybrid.outputs import check_writable

_JSON_EXT = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.xz", ".json.xz")
_PARQUET_EXT = (".parquet",)


def load_documents(
    files: list[str], text_key: str = "text", text_sample_by: str = "paragraph", cache_dir: str | None = None
):
    """A `datasets.Dataset` with one column `text_key`, one row per document, read from local `files`."""
    import datasets  # Hugging Face datasets: slow to import, only to read raw text

    if not files:
        raise DataError("--input is empty: give at least one .txt, .jsonl or .parquet file")
    for path in files:
        if not os.path.isfile(path):
            raise DataError(f"--input: {path} does not exist: fix the path")
        if os.path.getsize(path) == 0:
            raise DataError(f"--input: {path} is empty: remove it or give a file with text")
    kinds = {_input_kind(path) for path in files}
    if len(kinds) > 1:
        raise DataError(f"--input mixes file kinds {sorted(kinds)}: preprocess each kind separately")
    kind = kinds.pop()
    kwargs = {"sample_by": text_sample_by} if kind == "text" else {}
    try:
        ds = datasets.load_dataset(kind, data_files=list(files), split="train", cache_dir=cache_dir, **kwargs)
    except Exception as err:
        if kind == "json":
            _raise_bad_json_line(files)
        raise DataError(f"--input could not be read as {kind} ({_one_line(err)}): check the files") from None
    if kind == "text" and text_key != "text":
        ds = ds.rename_column("text", text_key)
    if text_key not in ds.column_names:
        raise DataError(
            f"--text-key {text_key!r} is not a field of the input (fields: {ds.column_names}): set --text-key"
        )
    _check_text_column(ds, text_key)
    return ds.select_columns([text_key])


def _raise_bad_json_line(files: list[str]) -> None:
    """Name the first line of a .jsonl input that is not one JSON object (datasets' error does not)."""
    for path in (p for p in files if ".jsonl" in p.lower()):
        opener = gzip.open if path.endswith(".gz") else lzma.open if path.endswith(".xz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except ValueError as err:
                    raise DataError(f"--input: {path} line {number} is not valid JSON ({err.msg}): fix or remove "
                                    "that line") from None


def _check_text_column(ds, text_key: str) -> None:
    """Every document's text must be a string (or null); json lets a field hold numbers or lists."""
    feature = ds.features[text_key]
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return
    for number, value in enumerate(ds[text_key], 1):
        if value is not None and not isinstance(value, str):
            raise DataError(f"--input: record {number} has {text_key}={value!r} ({type(value).__name__}), not a "
                            f"string: fix the input or choose the text field with --text-key")


def iter_texts(
    files: list[str], text_key: str = "text", text_sample_by: str = "paragraph", cache_dir: str | None = None
) -> Iterator[str]:
    ds = load_documents(files, text_key, text_sample_by, cache_dir)
    for batch in ds.iter(batch_size=1000):
        yield from (t for t in batch[text_key] if t)


def train_tokenizer(
    files: list[str],
    output_prefix: str,
    vocab_size: int,
    text_key: str = "text",
    text_sample_by: str = "paragraph",
    max_sentences: int = 2_000_000,
    cache_dir: str | None = None,
) -> str:
    """Train a SentencePiece model on local files; returns the path of `output_prefix.model`."""
    check_writable("--output directory", os.path.dirname(os.path.abspath(output_prefix)), DataError)
    texts = iter_texts(files, text_key, text_sample_by, cache_dir)
    return train_sentencepiece(texts, output_prefix, vocab_size, max_sentences=max_sentences)


class _Encoder:
    """Picklable batch tokenizer for `datasets.map(num_proc=...)`: each worker loads the model once."""

    def __init__(self, model_path: str, text_key: str):
        self.model_path, self.text_key = model_path, text_key
        self._tokenizer = None

    def __getstate__(self):
        return {"model_path": self.model_path, "text_key": self.text_key, "_tokenizer": None}

    def __call__(self, batch: dict) -> dict:
        if self._tokenizer is None:
            self._tokenizer = SentencePieceTokenizer(self.model_path)
        eod = self._tokenizer.eod
        ids = self._tokenizer.encode_batch([t or "" for t in batch[self.text_key]])
        return {"ids": [x + [eod] if x else [] for x in ids]}


def preprocess(
    files: list[str],
    tokenizer_model: str,
    output_prefix: str,
    workers: int = 1,
    text_key: str = "text",
    text_sample_by: str = "paragraph",
    cache_dir: str | None = None,
) -> dict:
    """Tokenize documents into `output_prefix.bin/.idx` (+ `.json` metadata); returns that metadata.

    Empty documents are dropped. Files are written under temporary names and renamed, .idx last, so a crash never
    leaves a prefix that looks complete.
    """
    if not os.path.isfile(tokenizer_model):
        raise DataError(f"--tokenizer: {tokenizer_model} does not exist: train one with `megahybrid data tokenizer`")
    if workers < 1:
        raise DataError(f"--workers is {workers}: use 1 or more")
    SentencePieceTokenizer(tokenizer_model)
    check_writable("--output-prefix directory", os.path.dirname(os.path.abspath(output_prefix)), DataError)
    docs = load_documents(files, text_key, text_sample_by, cache_dir)
    return preprocess_dataset(docs, tokenizer_model, output_prefix, workers, text_key)


def preprocess_dataset(
    docs, tokenizer_model: str, output_prefix: str, workers: int = 1, text_key: str = "text"
) -> dict:
    """`preprocess` for an already loaded `datasets.Dataset` with a `text_key` column."""
    # megatron is slow to import (the tokenizer command does not need it); tqdm comes with it.
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm.auto import tqdm

    tokenizer = SentencePieceTokenizer(tokenizer_model)
    encoded = docs.map(
        _Encoder(tokenizer_model, text_key),
        batched=True,
        batch_size=256,
        num_proc=workers if workers > 1 and len(docs) >= 2 * workers else None,
        remove_columns=[text_key],
        desc="tokenizing",
    )
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    num_docs = num_tokens = 0
    with tqdm(total=len(encoded), desc="writing", unit="doc") as bar:
        for batch in encoded.iter(batch_size=1000):
            for ids in batch["ids"]:
                if ids:
                    builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                    num_docs, num_tokens = num_docs + 1, num_tokens + len(ids)
            bar.update(len(batch["ids"]))
    builder.finalize(tmp + ".idx")
    if num_docs == 0:
        _remove(tmp + ".bin", tmp + ".idx")
        raise DataError("--input holds no non-empty documents: check --text-key and the files")
    meta = {
        "documents": num_docs,
        "tokens": num_tokens,
        "tokenizer_model": os.path.abspath(tokenizer_model),
        "tokenizer_sha256": file_sha256(tokenizer_model),
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "dtype": np.dtype(dtype).name,
    }
    with open(tmp + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    for ext in (".bin", ".json", ".idx"):
        os.replace(tmp + ext, output_prefix + ext)
    return meta


def _input_kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(_JSON_EXT):
        return "json"
    if lower.endswith(_PARQUET_EXT):
        return "parquet"
    return "text"


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _remove(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
