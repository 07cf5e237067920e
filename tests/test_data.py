"""Data pipeline: corpus, tokenizer, preprocessing, megatron dataset builds, resumable loader, config errors."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from megahybrid.data import cli
from megahybrid.data.builtin import prepare_builtin
from megahybrid.data.config import DataConfig, DataError
from megahybrid.data.corpus import iter_documents, write_corpus
from megahybrid.data.datasets import build_datasets
from megahybrid.data.loader import MicroBatchLoader
from megahybrid.data.preprocess import preprocess
from megahybrid.data.tokenizer import SentencePieceTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 64
VOCAB = 512


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two preprocessed corpora (A: seed 0, B: seed 1) sharing one tokenizer trained through the CLI on A."""
    root = tmp_path_factory.mktemp("data")
    hf = str(root / "hf")
    corpus_a = write_corpus(str(root / "a.jsonl"), seed=0, num_docs=1200)
    corpus_b = write_corpus(str(root / "b.jsonl"), seed=1, num_docs=600)
    rc = cli.main(["tokenizer", "--input", corpus_a, "--vocab-size", str(VOCAB), "--output", str(root / "tok"),
                   "--hf-cache", hf])
    assert rc == 0
    model = str(root / "tok.model")
    rc = cli.main(["preprocess", "--input", corpus_a, "--tokenizer", model, "--output-prefix", str(root / "a"),
                   "--workers", "2", "--hf-cache", hf])
    assert rc == 0
    preprocess([corpus_b], model, str(root / "b"), workers=1, cache_dir=hf)
    return {"root": root, "model": model, "a": str(root / "a"), "b": str(root / "b"), "corpus_a": corpus_a}


def _config(data, tmp_path, **kw) -> DataConfig:
    fields = {"prefixes": [data["a"]], "tokenizer_model": data["model"], "split": "8,2,0",
              "cache_dir": str(tmp_path / "idx"), "seed": 7}
    return DataConfig(**{**fields, **kw})


def _tokens(dataset, n):
    return torch.stack([dataset[i]["tokens"] for i in range(n)])


def test_corpus_deterministic(tmp_path):
    first = list(iter_documents(seed=3, num_docs=40))
    assert first == list(iter_documents(seed=3, num_docs=40))
    assert first != list(iter_documents(seed=4, num_docs=40))
    assert len({d["text"] for d in first}) == 40
    a = write_corpus(str(tmp_path / "x.jsonl"), seed=3, num_docs=200)
    b = write_corpus(str(tmp_path / "y.jsonl"), seed=3, num_docs=200)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert os.path.getsize(a) > 50_000


def test_tokenizer_round_trip(data):
    tok = SentencePieceTokenizer(data["model"])
    assert tok.vocab_size == VOCAB
    assert (tok.unk, tok.bos, tok.eod, tok.pad) == (0, 1, 2, 3)
    for doc in iter_documents(seed=9, num_docs=20):
        ids = tok.encode(doc["text"])
        assert max(ids) < VOCAB and tok.eod not in ids and tok.pad not in ids
        assert tok.decode(ids) == doc["text"]
    assert tok.decode(tok.encode("Zqx 12345 ünïcode!")) == "Zqx 12345 ünïcode!"


def test_preprocess_writes_indexed_dataset_with_eod(data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = SentencePieceTokenizer(data["model"])
    docs = [json.loads(line)["text"] for line in open(data["corpus_a"])]
    ds = IndexedDataset(data["a"])
    assert len(ds) == len(docs) == 1200
    for i in (0, 1, 599, 1199):
        seq = ds[i].astype(np.int64).tolist()
        assert seq == tok.encode(docs[i]) + [tok.eod]
    lengths = ds.sequence_lengths
    assert int(lengths.sum()) == json.load(open(data["a"] + ".json"))["tokens"]
    all_tokens = np.fromfile(data["a"] + ".bin", dtype=np.uint16)
    assert (all_tokens == tok.eod).sum() == len(docs)
    assert (all_tokens[np.cumsum(lengths) - 1] == tok.eod).all()


def test_blend_of_two_prefixes_follows_weights(data, tmp_path):
    cfg = _config(data, tmp_path, prefixes=[data["a"], data["b"]], weights=[1.0, 3.0], split="9,1,0")
    cfg.validate(SEQ, VOCAB)
    splits = build_datasets(cfg, SEQ, (800, 80, 0))
    assert len(splits.train) == 800 and len(splits.valid) == 80 and splits.test is None
    ids = np.array([int(splits.train[i]["dataset_id"]) for i in range(800)])
    assert abs((ids == 1).mean() - 0.75) < 0.02
    sample = splits.train[5]
    assert sample["tokens"].shape == (SEQ,) and sample["tokens"].dtype == torch.int64
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def test_split_uses_disjoint_documents(data, tmp_path):
    cfg = _config(data, tmp_path, split="8,2,0")
    splits = build_datasets(cfg, SEQ, (300, 60, 0))
    train_docs = set(np.unique(splits.train.document_index).tolist())
    valid_docs = set(np.unique(splits.valid.document_index).tolist())
    assert train_docs == set(range(960)) and valid_docs == set(range(960, 1200))


def test_order_fixed_by_seed(data, tmp_path):
    first = build_datasets(_config(data, tmp_path / "1", seed=11), SEQ, (200, 20, 0))
    again = build_datasets(_config(data, tmp_path / "2", seed=11), SEQ, (200, 20, 0))
    other = build_datasets(_config(data, tmp_path / "3", seed=12), SEQ, (200, 20, 0))
    assert torch.equal(_tokens(first.train, 200), _tokens(again.train, 200))
    assert torch.equal(_tokens(first.valid, 20), _tokens(again.valid, 20))
    assert not torch.equal(_tokens(first.train, 50), _tokens(other.train, 50))


class _IndexDataset:
    """Sample i is a row of i's, so batches show which indices a rank read."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        row = torch.full((4,), i)
        return {"tokens": row, "labels": row + 1, "loss_mask": torch.ones(4)}


@pytest.mark.parametrize("dp_size", [1, 2])
def test_loader_resume_matches_uninterrupted(data, tmp_path, dp_size):
    dataset = build_datasets(_config(data, tmp_path), SEQ, (256, 0, 0)).train
    for rank in range(dp_size):
        full = list(MicroBatchLoader(dataset, 16, 2, rank, dp_size))
        assert len(dataset) >= 256 and len(full) == len(dataset) // 16 * 16 // (2 * dp_size)
        interrupted = MicroBatchLoader(dataset, 16, 2, rank, dp_size)
        it = iter(interrupted)
        for _ in range(7):
            next(it)
        state = interrupted.state_dict()
        assert state["consumed_samples"] == 7 * 2 * dp_size
        resumed = MicroBatchLoader(dataset, 16, 2, rank, dp_size)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert len(rest) == len(full) - 7
        for got, want in zip(rest, full[7:]):
            assert got.keys() == {"tokens", "labels", "loss_mask"}
            assert got["tokens"].shape == (2, SEQ) and got["tokens"].dtype == torch.int64
            assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["labels"], want["labels"])


def test_loader_dp_ranks_disjoint_and_complete():
    dataset = _IndexDataset(100)
    seen = {}
    for rank in range(2):
        batches = list(MicroBatchLoader(dataset, 12, 3, rank, 2, consumed_samples=12))
        seen[rank] = [int(x) for b in batches for x in b["tokens"][:, 0]]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(12, 96))
    assert seen[0][:3] == [12, 13, 14] and seen[1][:3] == [15, 16, 17]
    with_workers = list(MicroBatchLoader(dataset, 12, 3, 1, 2, consumed_samples=12, num_workers=2))
    assert [int(x) for b in with_workers for x in b["tokens"][:, 0]] == seen[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none found)")
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_pins_batches_for_the_gpu(workers):
    """train_loader asks for pinned batches when a GPU is there: same batches, in page-locked memory."""
    dataset = _IndexDataset(100)
    plain = list(MicroBatchLoader(dataset, 12, 3, num_workers=workers))
    pinned = list(MicroBatchLoader(dataset, 12, 3, num_workers=workers, pin_memory=True))
    assert len(pinned) == len(plain) > 0
    for got, want in zip(pinned, plain):
        assert all(v.is_pinned() for v in got.values()) and not any(v.is_pinned() for v in want.values())
        assert all(torch.equal(got[k], want[k]) for k in want)


def _empty_prefix(root) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(root / "empty")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.finalize(prefix + ".idx")
    return prefix


def _other_tokenizer(data) -> str:
    from megahybrid.data.tokenizer import train_sentencepiece

    texts = (d["text"] for d in iter_documents(seed=5, num_docs=300))
    return train_sentencepiece(texts, str(data["root"] / "other"), 600)


BAD_CONFIGS = {
    "missing_bin": (lambda d, t: {"prefixes": [str(t / "nope")]}, "data.prefixes", "nope.bin does not exist"),
    "empty_dataset": (lambda d, t: {"prefixes": [_empty_prefix(t)]}, "data.prefixes", "holds no tokens"),
    "vocab_too_big": (lambda d, t: {}, "data.tokenizer_model", "model's vocab_size is 256"),
    "missing_tokenizer": (
        lambda d, t: {"tokenizer_model": str(t / "x.model")}, "data.tokenizer_model", "does not exist"
    ),
    "no_tokenizer": (lambda d, t: {"tokenizer_model": ""}, "data.tokenizer_model", "is not set"),
    "negative_weight": (
        lambda d, t: {"prefixes": [d["a"], d["b"]], "weights": [1.0, -1.0]}, "data.weights", "positive"
    ),
    "zero_weight": (lambda d, t: {"prefixes": [d["a"], d["b"]], "weights": [0.0, 1.0]}, "data.weights", "positive"),
    "weights_mismatch": (
        lambda d, t: {"prefixes": [d["a"], d["b"]], "weights": [1.0]}, "data.weights", "1 weights for 2"
    ),
    "bad_split": (lambda d, t: {"split": "90,x,1"}, "data.split", "three non-negative numbers"),
    "zero_train_split": (lambda d, t: {"split": "0,1,0"}, "data.split", "train part must be positive"),
    "too_few_tokens": (lambda d, t: {"split": "99990,1,0"}, "data.prefixes", "fewer than one sample"),
    "both_blends": (lambda d, t: {"train_prefixes": [d["a"]]}, "data.prefixes", "both set"),
    "no_prefixes": (lambda d, t: {"prefixes": []}, "data.prefixes", "is empty"),
    "other_tokenizer": (
        lambda d, t: {"tokenizer_model": _other_tokenizer(d)}, "data.tokenizer_model", "another tokenizer"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_gives_one_line(data, tmp_path, case):
    overrides, field, message = BAD_CONFIGS[case]
    cfg = _config(data, tmp_path, **overrides(data, tmp_path))
    model_vocab = 256 if case == "vocab_too_big" else 4096
    with pytest.raises(DataError) as err:
        cfg.validate(SEQ, model_vocab)
    text = str(err.value)
    assert "\n" not in text and field in text and message in text, text


def test_good_per_split_config_validates(data, tmp_path):
    cfg = DataConfig(train_prefixes=[data["a"], data["b"]], train_weights=[1, 1], valid_prefixes=[data["b"]],
                     tokenizer_model=data["model"], cache_dir=str(tmp_path))
    cfg.validate(SEQ, VOCAB)
    splits = build_datasets(cfg, SEQ, (100, 10, 0))
    assert len(splits.train) == 100 and len(splits.valid) >= 10 and splits.test is None


def test_validation_prefix_is_read_for_eval_iters_batches(data, tmp_path):
    """megatron builds a split with its own prefixes whole (data.valid_prefixes), whatever size is asked; the
    trainer's validation set is its first eval.iters global batches (it read the whole split at every evaluation)."""
    from megahybrid.train.config import load_config
    from megahybrid.train.data import build_splits, prepare_data

    cfg = load_config("demo", ["data.builtin=false", f"data.train_prefixes=[{data['a']}]",
                               f"data.valid_prefixes=[{data['b']}]", f"data.tokenizer_model={data['model']}",
                               f"data.cache_dir={tmp_path / 'idx'}", "eval.iters=2", "batch.global_batch_size=4",
                               "batch.micro_batch_size=4", "train.steps=3", f"run_dir={tmp_path / 'run'}"])
    prepared = prepare_data(cfg, SEQ, VOCAB)
    whole = build_datasets(prepared, SEQ, (12, 8, 0)).valid
    _, valid = build_splits(cfg, prepared, SEQ)
    assert len(whole) > 8 and len(valid) == 8
    assert torch.equal(_tokens(valid, 8), _tokens(whole, 8))


@pytest.mark.parametrize(
    "args, message",
    [
        (["tokenizer", "--input", "/nonexistent.txt", "--vocab-size", "100", "--output", "x"], "does not exist"),
        (["tokenizer", "--input", "EMPTY", "--vocab-size", "100", "--output", "x"], "is empty"),
        (["tokenizer", "--input", "CORPUS", "--vocab-size", "5", "--output", "x"], "--vocab-size is 5"),
        (["tokenizer", "--input", "CORPUS", "--vocab-size", "100000", "--output", "x"], "use at most"),
        (["preprocess", "--input", "CORPUS", "--tokenizer", "/no.model", "--output-prefix", "x"], "--tokenizer"),
        (["preprocess", "--input", "CORPUS", "--tokenizer", "MODEL", "--output-prefix", "x", "--text-key", "body"],
         "--text-key 'body'"),
    ],
)
def test_cli_errors_exit_2_with_one_line(data, tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    subs = {"EMPTY": str(tmp_path / "empty.txt"), "CORPUS": data["corpus_a"], "MODEL": data["model"],
            "x": str(tmp_path / "x")}
    args = [subs.get(a, a) for a in args] + ["--hf-cache", str(tmp_path / "hf")]
    proc = subprocess.run([sys.executable, "-m", "megahybrid.data.cli", *args], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_prepare_builtin_is_cached(tmp_path):
    first = prepare_builtin(str(tmp_path), vocab_size=400, num_docs=400)
    mtime = os.stat(first.prefix + ".bin").st_mtime_ns
    again = prepare_builtin(str(tmp_path), vocab_size=400, num_docs=400)
    assert again == first and os.stat(first.prefix + ".bin").st_mtime_ns == mtime
    cfg = first.data_config(cache_dir=str(tmp_path / "idx"))
    with pytest.raises(DataError, match="0 tokens in its test part"):
        cfg.validate(SEQ, 400)
    cfg.validate(SEQ, 400, num_samples=(50, 5, 0))
    splits = build_datasets(cfg, SEQ, (50, 5, 0))
    assert len(splits.train) >= 50 and len(splits.valid) >= 5 and splits.test is None


@pytest.mark.skipif(not os.path.isdir(os.path.join(os.path.dirname(REPO), "shared", "data", "wikipedia-en")),
                    reason="the Wikipedia sample is not in ../shared/data/wikipedia-en next to the repository")
def test_prepare_wikipedia_tiny_slice(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import prepare_wikipedia

    rc = prepare_wikipedia.main(["--out-dir", str(tmp_path), "--max-docs", "20", "--vocab-size", "1000",
                                 "--splits", "valid", "--workers", "1", "--tokenizer-sample-docs", "20"])
    assert rc == 0
    meta = json.load(open(tmp_path / "valid_text_document.json"))
    assert meta["documents"] == 20 * len(prepare_wikipedia.split_paths(prepare_wikipedia.DEFAULT_INPUT, "valid"))
    assert prepare_wikipedia.is_title(["Transport in Italy"], None)
    assert not prepare_wikipedia.is_title(["It opened in 1977."], None)
    assert not prepare_wikipedia.is_title(["Short line"], ["a paragraph without an end"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank, world, port, cfg, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        splits = build_datasets(cfg, SEQ, (96, 8, 0))
        batches = list(MicroBatchLoader(splits.train, 8, 2, rank, world))
        torch.save({"all": _tokens(splits.train, 96), "mine": torch.cat([b["tokens"] for b in batches])},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.dist
def test_two_process_gloo_build(data, tmp_path):
    cfg = _config(data, tmp_path, prefixes=[data["a"], data["b"]], weights=[1.0, 1.0])
    torch.multiprocessing.spawn(_gloo_worker, args=(2, _free_port(), cfg, str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = build_datasets(_config(data, tmp_path / "single", prefixes=[data["a"], data["b"]], weights=[1.0, 1.0]),
                            SEQ, (96, 8, 0))
    assert torch.equal(got[0]["all"], got[1]["all"]) and torch.equal(got[0]["all"], _tokens(single.train, 96))
    expected = {r: torch.cat([_tokens(single.train, 96)[s + 2 * r: s + 2 * r + 2] for s in range(0, 96, 4)])
                for r in range(2)}
    assert torch.equal(got[0]["mine"], expected[0]) and torch.equal(got[1]["mine"], expected[1])
