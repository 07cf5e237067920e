"""One call from nothing to trainable data: generate the built-in corpus, train its tokenizer, preprocess it."""
import fcntl
import json
import os
from dataclasses import asdict, dataclass

from megahybrid.data.config import DataConfig
from megahybrid.data.corpus import write_corpus
from megahybrid.data.preprocess import preprocess, train_tokenizer

# Bump when the generator, tokenizer settings or file layout change, so cached outputs are rebuilt.
BUILTIN_VERSION = 1


@dataclass(frozen=True)
class BuiltinData:
    """Paths of a prepared built-in corpus."""

    corpus: str
    tokenizer_model: str
    prefix: str

    def data_config(self, **overrides) -> DataConfig:
        """A DataConfig reading this corpus (default split 949,50,1); `overrides` set other DataConfig fields."""
        fields = {"prefixes": [self.prefix], "tokenizer_model": self.tokenizer_model, "split": "949,50,1"}
        return DataConfig(**{**fields, **overrides})


def prepare_builtin(
    out_dir: str, vocab_size: int = 2048, num_docs: int = 12000, seed: int = 0, workers: int = 1
) -> BuiltinData:
    """Prepare the built-in corpus under `out_dir` (about 6.7 MB of text, 1.8M tokens at the defaults).

    Cached: a second call with the same arguments returns at once; other arguments rebuild. Safe to call from
    several processes at once (a file lock serializes them).
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = BuiltinData(
        corpus=os.path.join(out_dir, "builtin.jsonl"),
        tokenizer_model=os.path.join(out_dir, "builtin-tokenizer.model"),
        prefix=os.path.join(out_dir, "builtin_text_document"),
    )
    stamp_path = os.path.join(out_dir, "builtin.stamp.json")
    stamp = {"version": BUILTIN_VERSION, "vocab_size": vocab_size, "num_docs": num_docs, "seed": seed, **asdict(paths)}
    with open(os.path.join(out_dir, ".builtin.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_json(stamp_path) == stamp and _all_exist(paths):
            return paths
        hf_cache = os.path.join(out_dir, "hf-cache")
        write_corpus(paths.corpus, seed=seed, num_docs=num_docs)
        train_tokenizer([paths.corpus], paths.tokenizer_model[: -len(".model")], vocab_size, cache_dir=hf_cache)
        preprocess([paths.corpus], paths.tokenizer_model, paths.prefix, workers=workers, cache_dir=hf_cache)
        tmp = f"{stamp_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(stamp, f, indent=1)
        os.replace(tmp, stamp_path)
    return paths


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _all_exist(paths: BuiltinData) -> bool:
    files = [paths.corpus, paths.tokenizer_model, paths.prefix + ".bin", paths.prefix + ".idx"]
    return all(os.path.isfile(f) for f in files)
