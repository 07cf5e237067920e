"""Typed data config and the checks that run before any process group or model exists.

Every failure raises `DataError` with one line that names the field and the fix.
"""
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from megahybrid.data.tokenizer import SentencePieceTokenizer, file_sha256
from megahybrid.errors import DataError

SPLITS = ("train", "valid", "test")


@dataclass
class DataConfig:
    """Where the tokenized data lives and how it is blended, split and ordered.

    Either one blend (`prefixes` + optional `weights`) cut into train/valid/test by `split`, or one blend per
    split (`train_prefixes`, `valid_prefixes`, `test_prefixes` with optional `*_weights`); not both.
    A prefix names `PREFIX.bin` + `PREFIX.idx` written by `megahybrid data preprocess`.
    The sequence length comes from the model config and is passed to `validate` / `build_datasets`.
    """

    prefixes: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    split: str = "969,30,1"
    train_prefixes: list[str] | None = None
    train_weights: list[float] | None = None
    valid_prefixes: list[str] | None = None
    valid_weights: list[float] | None = None
    test_prefixes: list[str] | None = None
    test_weights: list[float] | None = None
    tokenizer_model: str = ""
    seed: int = 1234
    # DataLoader processes prefetching reads for MicroBatchLoader (0: read in the training process; the batches
    # are the same either way); also the threads megatron builds per-prefix indices with (at least 1).
    num_workers: int = 0
    # Where megatron caches its document/sample/shuffle indices; None: `<dir of first prefix>/index-cache`.
    cache_dir: str | None = None

    @property
    def uses_per_split_blends(self) -> bool:
        return any(getattr(self, f"{s}_prefixes") is not None for s in SPLITS)

    def blends(self) -> dict[str, tuple[list[str], list[float] | None]]:
        """{'all': blend} for a split blend, else {split: blend} for each split that has one."""
        if not self.uses_per_split_blends:
            return {"all": (list(self.prefixes), self.weights)}
        return {
            s: (list(getattr(self, f"{s}_prefixes")), getattr(self, f"{s}_weights"))
            for s in SPLITS
            if getattr(self, f"{s}_prefixes") is not None
        }

    def all_prefixes(self) -> list[str]:
        return [p for prefixes, _ in self.blends().values() for p in prefixes]

    def resolved_cache_dir(self) -> str:
        if self.cache_dir:
            return self.cache_dir
        first = self.all_prefixes()[0]
        return os.path.join(os.path.dirname(os.path.abspath(first)), "index-cache")

    def validate(
        self,
        seq_length: int | None = None,
        model_vocab_size: int | None = None,
        num_samples: tuple[int, int, int] | None = None,
    ) -> None:
        """Check fields, files and tokenizer before training starts; raise `DataError` on the first problem.

        seq_length: the model's sequence length; each split that will be read must hold at least one packed
            sample of seq_length + 1 tokens. model_vocab_size: the model's (padded) vocabulary size; the
            tokenizer's vocabulary must fit into it. num_samples: (train, valid, test) samples the run will draw;
            splits with 0 are not checked for size (None: every split with data is).
        """
        self._check_fields()
        if not self.uses_per_split_blends:
            parse_split(self.split)
        for name, (prefixes, weights) in self.blends().items():
            field_name = "prefixes" if name == "all" else f"{name}_prefixes"
            _check_blend(field_name, prefixes, weights)
            for prefix in prefixes:
                _check_prefix_files(field_name, prefix)
        vocab_size = self._check_tokenizer(model_vocab_size)
        for prefix in self.all_prefixes():
            _check_prefix_tokenizer(prefix, self.tokenizer_model, vocab_size)
        if seq_length is not None:
            self.check_enough_tokens(seq_length, num_samples)

    def _check_fields(self) -> None:
        if self.uses_per_split_blends and self.prefixes:
            raise DataError(
                "data.prefixes and data.train_prefixes/valid_prefixes/test_prefixes are both set: use one blend "
                "with data.split, or one blend per split"
            )
        if self.uses_per_split_blends and self.train_prefixes is None:
            raise DataError("data.train_prefixes is not set: per-split blends need at least a train blend")
        if not self.uses_per_split_blends and not self.prefixes:
            raise DataError(
                "data.prefixes is empty: give the .bin/.idx prefixes written by `megahybrid data preprocess`"
            )
        if self.num_workers < 0:
            raise DataError(f"data.num_workers is {self.num_workers}: use 0 or more")

    def _check_tokenizer(self, model_vocab_size: int | None) -> int:
        if not self.tokenizer_model:
            raise DataError("data.tokenizer_model is not set: give the .model file from `megahybrid data tokenizer`")
        if not os.path.isfile(self.tokenizer_model):
            raise DataError(
                f"data.tokenizer_model: {self.tokenizer_model} does not exist: train one with "
                "`megahybrid data tokenizer` or fix the path"
            )
        vocab_size = SentencePieceTokenizer(self.tokenizer_model).vocab_size
        if model_vocab_size is not None and vocab_size > model_vocab_size:
            raise DataError(
                f"data.tokenizer_model has {vocab_size} tokens but the model's vocab_size is {model_vocab_size}: "
                f"set model vocab_size >= {vocab_size} or train a smaller tokenizer"
            )
        return vocab_size

    def check_enough_tokens(self, seq_length: int, num_samples: tuple[int, int, int] | None = None) -> None:
        """Every split that will be read holds at least one sample of seq_length + 1 tokens in each prefix.

        megatron's GPTDataset repeats epochs until it has the requested samples, so an empty part would hang it.
        """
        need = seq_length + 1
        wanted = {s for i, s in enumerate(SPLITS) if num_samples is None or num_samples[i] > 0}
        split_vector = None if self.uses_per_split_blends else parse_split(self.split)
        for name, (prefixes, _) in self.blends().items():
            field_name = "prefixes" if name == "all" else f"{name}_prefixes"
            for prefix in prefixes:
                lengths = _sequence_lengths(prefix)
                portions = _split_token_counts(lengths, split_vector) if name == "all" else {name: lengths.sum()}
                for split_name, tokens in portions.items():
                    if split_name in wanted and tokens < need:
                        raise DataError(
                            f"data.{field_name}: {prefix} has {tokens} tokens in its {split_name} part, fewer than "
                            f"one sample of seq_length+1 = {need}: add data, shorten seq_length or change data.split"
                        )


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalized [train, valid, test] fractions; raise DataError naming data.split."""
    parts = [p.strip() for p in str(split).split(",")]
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"[0-9]+(\.[0-9]*)?", p) for p in parts):
        raise DataError(
            f"data.split is {split!r}: use up to three non-negative numbers for train,valid,test such as '969,30,1'"
        )
    values = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if values[0] <= 0:
        raise DataError(f"data.split is {split!r}: the train part must be positive, e.g. '969,30,1'")
    total = sum(values)
    return [v / total for v in values]


def _check_blend(field_name: str, prefixes: list[str], weights: list[float] | None) -> None:
    if not prefixes:
        raise DataError(f"data.{field_name} is empty: give at least one .bin/.idx prefix")
    if weights is None:
        return
    weights_field = field_name.replace("prefixes", "weights")
    if len(weights) != len(prefixes):
        raise DataError(
            f"data.{weights_field} has {len(weights)} weights for {len(prefixes)} prefixes: give one weight per "
            f"prefix or none"
        )
    bad = [w for w in weights if not isinstance(w, (int, float)) or not w > 0 or w == float("inf")]
    if bad:
        raise DataError(f"data.{weights_field} contains {bad[0]!r}: every weight must be a positive finite number")


def _check_prefix_files(field_name: str, prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise DataError(
                f"data.{field_name}: {prefix}{ext} does not exist: run `megahybrid data preprocess` or fix the prefix"
            )
    lengths, bin_bytes = _index_summary(prefix)
    if lengths.size == 0 or int(lengths.sum()) == 0:
        raise DataError(f"data.{field_name}: {prefix} holds no tokens: preprocess non-empty input documents")
    actual = os.path.getsize(prefix + ".bin")
    if actual != bin_bytes:
        raise DataError(
            f"data.{field_name}: {prefix}.bin has {actual} bytes but its .idx describes {bin_bytes} (truncated or "
            "from another run): preprocess it again"
        )


def _check_prefix_tokenizer(prefix: str, tokenizer_model: str, vocab_size: int) -> None:
    """Compare against the sidecar `PREFIX.json` that preprocess writes (absent for foreign data: skipped)."""
    meta_path = prefix + ".json"
    if not os.path.isfile(meta_path):
        return
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("tokenizer_sha256") not in (None, file_sha256(tokenizer_model)):
        raise DataError(
            f"data.tokenizer_model: {prefix} was tokenized with another tokenizer ({meta.get('tokenizer_model')}): "
            "use that tokenizer or preprocess again with this one"
        )


def _sequence_lengths(prefix: str) -> np.ndarray:
    return _index_summary(prefix)[0]


def _index_summary(prefix: str) -> tuple[np.ndarray, int]:
    """(tokens per sequence, bytes the .bin must have) from the .idx."""
    from megatron.core.datasets.indexed_dataset import _IndexReader, get_idx_path  # slow import: only with data

    try:
        reader = _IndexReader(get_idx_path(prefix), multimodal=False)
        # Copy while the reader lives: its __del__ closes the mmap the array views.
        lengths = np.array(reader.sequence_lengths, dtype=np.int64)
        end = int(reader.sequence_pointers[-1]) + int(lengths[-1]) * reader.dtype_size if lengths.size else 0
        del reader
        return lengths, end
    except Exception as err:
        raise DataError(f"{prefix}.idx cannot be read ({err.__class__.__name__}): preprocess it again") from None


def _split_token_counts(lengths: np.ndarray, split_vector: list[float]) -> dict[str, int]:
    """Tokens per split, cutting the sequences exactly as megatron's builder does (rounded fraction bounds)."""
    bounds = np.cumsum([0.0] + split_vector)
    n = lengths.size
    counts = {}
    for i, name in enumerate(SPLITS):
        if split_vector[i] > 0:
            beg, end = int(round(bounds[i] * n)), int(round(bounds[i + 1] * n))
            counts[name] = int(lengths[beg:end].sum())
    return counts
