"""Adapter from our run config to the data pipeline (megahybrid.data): built-in corpus preparation, the
DataConfig, train/valid datasets and the resumable micro-batch loader."""
from megahybrid.data.loader import MicroBatchLoader
from megahybrid.train.config import RunConfig, data_config


def prepare_data(cfg: RunConfig, seq_length: int, vocab_size: int):
    """The validated DataConfig; the built-in corpus is generated, tokenized and preprocessed first (cached,
    file-locked, so every rank may call this before any process group exists)."""
    builtin = None
    if cfg.data.builtin:
        from megahybrid.data.builtin import prepare_builtin

        builtin = prepare_builtin(cfg.data.builtin_dir, vocab_size=cfg.data.builtin_vocab_size,
                                  num_docs=cfg.data.builtin_num_docs)
    data = data_config(cfg, builtin)
    data.validate(seq_length, vocab_size)
    return data


def build_splits(cfg: RunConfig, data, seq_length: int, groups):
    """(train dataset, valid dataset or None) sized for the whole run; built on every rank, rank 0 first."""
    from megahybrid.data.datasets import build_datasets

    train_samples = cfg.train.steps * cfg.batch.global_batch_size
    valid_samples = cfg.eval.iters * cfg.batch.global_batch_size
    splits = build_datasets(data, seq_length, (train_samples, valid_samples, 0))
    return splits.train, splits.valid


def train_loader(cfg: RunConfig, dataset, groups, consumed_samples: int, num_workers: int) -> MicroBatchLoader:
    return MicroBatchLoader(dataset, cfg.batch.global_batch_size, cfg.batch.micro_batch_size, groups.dp_rank,
                            groups.layout.dp, consumed_samples=consumed_samples, num_workers=num_workers)


def valid_loader(cfg: RunConfig, dataset, groups) -> MicroBatchLoader:
    """The same validation samples at every evaluation (position 0)."""
    return MicroBatchLoader(dataset, cfg.batch.global_batch_size, cfg.batch.micro_batch_size, groups.dp_rank,
                            groups.layout.dp)
