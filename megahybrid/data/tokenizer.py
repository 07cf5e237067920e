"""SentencePiece tokenizer: training from an iterator of texts, and a wrapper megatron's GPTDataset accepts.

Special ids are fixed at training time: unk=0, bos=1, eos=2, pad=3. The end-of-document token (EOD) is eos.
A separate pad id matters: GPTDataset masks the loss where labels == tokenizer.pad, and it refuses a pad id that
collides with eos/eod (it falls back to -1 with a warning).
"""
import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Iterable

import sentencepiece as spm

from megahybrid.errors import DataError

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
MIN_VOCAB_SIZE = 16


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class SentencePieceTokenizer:
    """A trained SentencePiece model.

    Has what megatron-core 0.16.1's `GPTDatasetConfig.tokenizer` is used for: `vocab_size` (token dtype),
    `eod` (loss/attention masks), `pad` (masked padding), `eos`, and `unique_identifiers` (part of the hash
    naming megatron's cached indices; here the model file's sha256, so a retrained tokenizer never reuses them).
    """

    def __init__(self, model_path: str):
        self.model_path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as err:
            raise DataError(f"tokenizer {model_path} is not a SentencePiece model ({str(err).splitlines()[0][:120]}): "
                            "give the .model file written by `megahybrid data tokenizer`") from None
        self.sha256 = file_sha256(model_path)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("sha256", self.sha256), ("vocab_size", self.vocab_size)]
        )

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    def encode(self, text: str) -> list[int]:
        """Text -> token ids, without bos/eos."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    tokenize = encode
    detokenize = decode

    def __getstate__(self):
        return {"model_path": self.model_path}

    def __setstate__(self, state):
        self.__init__(state["model_path"])


def train_sentencepiece(
    texts: Iterable[str],
    output_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    max_sentences: int = 2_000_000,
    num_threads: int | None = None,
    seed_sentencepiece_size: int = 200_000,
) -> str:
    """Train a SentencePiece model on `texts` and write `output_prefix.model` / `.vocab`; returns the .model path.

    Each text may hold several lines; SentencePiece sees one line per sentence. Encoding is lossless: decode
    returns the exact text (newlines included). Byte fallback keeps every string encodable; digits are split
    so numbers tokenize uniformly.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"--vocab-size is {vocab_size}: use at least {MIN_VOCAB_SIZE}")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_prefix=output_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            byte_fallback=True,
            split_digits=True,
            # Identity normalization keeps the text exact; "\n" as a user symbol keeps line and paragraph breaks,
            # which the default NFKC rules turn into spaces.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            user_defined_symbols=["\n"],
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            seed_sentencepiece_size=seed_sentencepiece_size,
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise DataError(_training_error(str(err), vocab_size)) from None
    return output_prefix + ".model"


def _training_error(message: str, vocab_size: int) -> str:
    """sentencepiece's multi-part error -> one line naming --vocab-size and the bound it states."""
    too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if too_small:
        return f"--vocab-size {vocab_size} is below the {too_small.group(1)} distinct characters and specials: raise it"
    too_large = re.search(r"value <= (\d+)", message)
    if too_large:
        return f"--vocab-size {vocab_size} is too large for this input: use at most {too_large.group(1)}"
    last = message.strip().splitlines()[-1] if message.strip() else "no details"
    return f"sentencepiece training failed ({last}): check the input text and --vocab-size"
