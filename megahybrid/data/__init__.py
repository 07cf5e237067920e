"""Data pipeline: built-in corpus, SentencePiece tokenizer, preprocessing into megatron-core indexed datasets,
train/valid/test GPT datasets and a resumable, deterministic micro-batch loader."""
