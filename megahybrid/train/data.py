"""Adapter from our run config to the data pipeline (megahybrid.data): built-in corpus preparation, the
DataConfig, train/valid datasets and the resumable micro-batch loader; random tokens for `data.synthetic`."""
from dataclasses import dataclass

import torch

from megahybrid.data.builtin import prepare_builtin
from megahybrid.data.datasets import build_datasets
from megahybrid.data.loader import MicroBatchLoader
from megahybrid.train.config import RunConfig, data_config


@dataclass
class SyntheticData:
    """Stands in for a DataConfig when data.synthetic is set."""

    seed: int
    vocab_size: int
    num_workers: int = 0


class RandomTokens(torch.utils.data.Dataset):
    """Uniform random token sequences, sample i drawn from its own seed (the same on every rank and resume)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=gen)
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(self.seq_length)}


def prepare_data(cfg: RunConfig, seq_length: int, vocab_size: int):
    """The validated DataConfig; the built-in corpus is generated, tokenized and preprocessed first (cached,
    file-locked, so every rank may call this before any process group exists)."""
    if cfg.data.synthetic:
        return SyntheticData(cfg.train.seed, vocab_size)
    builtin = None
    if cfg.data.builtin:
        builtin = prepare_builtin(cfg.data.builtin_dir, vocab_size=cfg.data.builtin_vocab_size,
                                  num_docs=cfg.data.builtin_num_docs)
    data = data_config(cfg, builtin)
    data.validate(seq_length, vocab_size)
    return data


def build_splits(cfg: RunConfig, data, seq_length: int):
    """(train dataset, valid dataset or None) sized for the whole run; built on every rank, rank 0 first."""
    train_samples = cfg.train.steps * cfg.batch.global_batch_size
    valid_samples = cfg.eval.iters * cfg.batch.global_batch_size
    if isinstance(data, SyntheticData):
        return RandomTokens(train_samples, seq_length, data.vocab_size, data.seed), None
    splits = build_datasets(data, seq_length, (train_samples, valid_samples, 0))
    valid = splits.valid
    if valid is not None and len(valid) > valid_samples:
        # megatron builds a split given by its own prefixes (data.valid_prefixes) whole, whatever size was asked:
        # an evaluation reads eval.iters global batches, not the whole split (510 batches of a 2M-token split)
        valid = torch.utils.data.Subset(valid, range(valid_samples))
    return splits.train, valid


def train_loader(cfg: RunConfig, dataset, groups, consumed_samples: int, num_workers: int) -> MicroBatchLoader:
    return MicroBatchLoader(dataset, cfg.batch.global_batch_size, cfg.batch.micro_batch_size, groups.dp_rank,
                            groups.layout.dp, consumed_samples=consumed_samples, num_workers=num_workers,
                            pin_memory=torch.cuda.is_available())


def valid_loader(cfg: RunConfig, dataset, groups) -> MicroBatchLoader:
    """The same validation samples at every evaluation (position 0)."""
    return MicroBatchLoader(dataset, cfg.batch.global_batch_size, cfg.batch.micro_batch_size, groups.dp_rank,
                            groups.layout.dp)
