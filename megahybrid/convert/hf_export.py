"""Write a Hugging Face directory: config.json, safetensors weights under Hugging Face names, the SentencePiece
tokenizer and the modeling code (a stub that imports megahybrid.convert.hf_model, so every mixer megahybrid
has runs in the export exactly as in training)."""
import json
import os
import shutil

from megahybrid.convert import adapter, files, hf_config

MODELING_STUB = '''"""Hugging Face entry point of a megahybrid model: the classes live in the megahybrid package (pip install
megahybrid, or put its checkout on PYTHONPATH), so the model runs the same layers as training."""
from megahybrid.convert.hf_model import MegahybridConfig, MegahybridForCausalLM

__all__ = ["MegahybridConfig", "MegahybridForCausalLM"]
'''


def _write_tokenizer(tokenizer_model: str | None, out: str) -> None:
    if not tokenizer_model or not os.path.isfile(tokenizer_model):
        return
    shutil.copyfile(tokenizer_model, os.path.join(out, "tokenizer.model"))
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
              "legacy": True, "model_max_length": None}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def write_hf(weights, tensors: dict, out: str, dtype: str, max_shard_bytes: int) -> None:
    hf_dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config.hf_config(weights.model, hf_dtype), f, indent=1)
    files.write_weights(adapter.to_hf(tensors, weights.model), out, max_shard_bytes)
    with open(os.path.join(out, f"{hf_config.MODULE}.py"), "w") as f:
        f.write(MODELING_STUB)
    _write_tokenizer(weights.tokenizer_model, out)
