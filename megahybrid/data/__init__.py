"""Data pipeline: built-in corpus, SentencePiece tokenizer, preprocessing into megatron-core indexed datasets,
train/valid/test GPT datasets and a resumable, deterministic micro-batch loader.

Training-loop entry points (imported lazily, so `megahybrid data ...` does not pay for torch/megatron imports):
`DataConfig`, `DataError`, `SentencePieceTokenizer`, `build_datasets`, `SplitDatasets`, `MicroBatchLoader`,
`prepare_builtin`, `BuiltinData`.
"""
import importlib

_EXPORTS = {
    "DataConfig": "config",
    "DataError": "config",
    "SentencePieceTokenizer": "tokenizer",
    "build_datasets": "datasets",
    "SplitDatasets": "datasets",
    "MicroBatchLoader": "loader",
    "prepare_builtin": "builtin",
    "BuiltinData": "builtin",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
