"""Train/valid/test datasets of fixed-length packed samples, built by megatron-core's dataset builder.

Each sample holds seq_length + 1 consecutive tokens of the shuffled, concatenated documents (EOD between them);
position ids and attention masks are not reset at document boundaries. The shuffle is fixed by `DataConfig.seed`.

Distributed: call `build_datasets` on every rank. When torch.distributed is initialized, megatron builds the
index files on global rank 0, barriers, then the other ranks load them from `DataConfig.cache_dir`, which
must therefore be on a file system all ranks see.

megatron is imported inside the functions that build datasets (it takes seconds to import).
"""
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megahybrid.data.config import SPLITS, DataConfig, DataError, parse_split
from megahybrid.data.tokenizer import SentencePieceTokenizer


@dataclass
class SplitDatasets:
    """The three splits; a split is None when it has no data (split fraction 0 or no per-split blend)."""

    train: object | None
    valid: object | None
    test: object | None


def gpt_dataset_config(
    cfg: DataConfig, tokenizer: SentencePieceTokenizer, seq_length: int
):
    """megatron-core's `GPTDatasetConfig` for `cfg` (no attention mask tensors: the model builds causal masks)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    if cfg.uses_per_split_blends:
        blend, split = None, None
        blend_per_split = [
            (list(getattr(cfg, f"{s}_prefixes")), _weights(getattr(cfg, f"{s}_weights")))
            if getattr(cfg, f"{s}_prefixes") is not None
            else None
            for s in SPLITS
        ]
    else:
        parse_split(cfg.split)
        blend, split, blend_per_split = (list(cfg.prefixes), _weights(cfg.weights)), cfg.split, None
    return GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        num_dataset_builder_threads=max(1, cfg.num_workers),
        path_to_cache=os.path.join(cfg.resolved_cache_dir(), _data_fingerprint(cfg.all_prefixes())),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )


def build_datasets(
    cfg: DataConfig,
    seq_length: int,
    num_samples: tuple[int, int, int],
    tokenizer: SentencePieceTokenizer | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> SplitDatasets:
    """Build the train/valid/test datasets; call on every rank after `cfg.validate(seq_length, vocab)`.

    num_samples: (train, valid, test) samples to draw, e.g. train_iters * global_batch_size; an epoch is
        repeated (with a fresh shuffle) as often as needed. A split with 0 samples requested is returned as None.
    is_built_on_rank: default builds on every rank (rank 0 first); pass e.g. `lambda: tp_rank == 0` to skip ranks
        that get their batches by broadcast.
    Every sample is a dict of int64 "tokens"/"labels" [seq_length], float "loss_mask" and "position_ids".
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if seq_length < 1:
        raise DataError(f"seq_length is {seq_length}: use a positive model sequence length")
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise DataError(f"num_samples is {num_samples}: give (train, valid, test) sample counts >= 0")
    check_helpers()
    sizes = [int(n) for n in num_samples]
    cfg.check_enough_tokens(seq_length, tuple(sizes))
    tokenizer = tokenizer or SentencePieceTokenizer(cfg.tokenizer_model)
    config = gpt_dataset_config(cfg, tokenizer, seq_length)
    _skip_unrequested_splits(config, sizes)
    os.makedirs(config.path_to_cache, exist_ok=True)
    with _quiet_megatron(), _single_process_rank():
        built = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, is_built_on_rank or (lambda: True), config
        ).build()
    built = [ds if n > 0 else None for ds, n in zip(built, sizes)]
    return SplitDatasets(*built)


def check_helpers() -> None:
    """megatron's sample-index builder is C++ (`helpers_cpp`); its wheels ship it compiled (cp311 and cp312 here).
    A source checkout needs `make -C megatron/core/datasets` with pybind11 and g++ first."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError as err:
        raise DataError(
            f"megatron-core's compiled dataset helpers are missing ({err}): install the megatron-core wheel, or "
            "run `make -C <site-packages>/megatron/core/datasets` with pybind11 and g++ installed"
        ) from None


def _skip_unrequested_splits(config, sizes: list[int]) -> None:
    """Build nothing for a split with 0 samples requested: an empty part would make megatron loop forever
    looking for one sample. Other splits keep their document ranges."""
    for i, size in enumerate(sizes):
        if size == 0:
            if config.blend_per_split is not None:
                config.blend_per_split[i] = None
            else:
                config.split_matrix[i] = None


def _data_fingerprint(prefixes: list[str]) -> str:
    """megatron keys its cached indices by prefix path, not content: a sub-directory per file state keeps a
    re-preprocessed prefix from reusing stale indices."""
    state = []
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            st = os.stat(prefix + ext)
            state.append([os.path.abspath(prefix + ext), st.st_size, st.st_mtime_ns])
    return hashlib.md5(json.dumps(state).encode(), usedforsecurity=False).hexdigest()[:16]


def _weights(weights: list[float] | None) -> list[float] | None:
    return None if weights is None else [float(w) for w in weights]


class _quiet_megatron:
    """megatron logs every index build at INFO; keep warnings and errors only."""

    def __enter__(self):
        self.logger = logging.getLogger("megatron.core.datasets")
        self.level = self.logger.level
        self.logger.setLevel(max(self.level, logging.WARNING))

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


class _single_process_rank:
    """megatron 0.16.1's BlendedDataset calls torch.distributed.get_rank() unguarded when its cache misses;
    without a process group that raises, so report rank 0 for the duration of a single-process build."""

    def __enter__(self):
        self.patched = not torch.distributed.is_initialized()
        if self.patched:
            self.get_rank = torch.distributed.get_rank
            torch.distributed.get_rank = lambda group=None: 0

    def __exit__(self, *exc):
        if self.patched:
            torch.distributed.get_rank = self.get_rank
