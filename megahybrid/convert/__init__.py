"""Checkpoint conversion: training checkpoints (any tp / dp / ZeRO stage) -> consolidated full-tensor weights
or a Hugging Face export, and back; `checkpoint.init_from` starts a run at any layout from any of them, and a
resume at another layout reshards the optimizer state too.

zero.py reads DeepSpeed's files, sources.py turns any source into full tensors, files.py writes and reads
safetensors atomically, adapter.py maps names per mixer, hf_export.py / hf_model.py are the Hugging Face side,
init.py loads full tensors into a sharded model, reshard.py resumes a checkpoint (Adam state included) in an
engine of another layout, cli.py is `megahybrid convert`.
"""
