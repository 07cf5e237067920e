"""`megahybrid convert`: one source (detected) -> a consolidated or Hugging Face directory, written atomically."""
import dataclasses
import os
import shutil

import torch

from megahybrid.convert import files, sources
from megahybrid.convert.local import bare_model
from megahybrid.errors import UserError
from megahybrid.train.config import RunConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = ("consolidated", "hf")


def run_yaml_for(model_cfg) -> str:
    """A run config holding exactly `model_cfg` (for sources that carry no run config)."""
    cfg = RunConfig()
    cfg.model.overrides = dataclasses.asdict(model_cfg)
    return cfg.to_yaml()


def full_checked(weights: sources.Weights) -> dict:
    """The source's tensors, checked against the model its config describes."""
    sources.check_shapes(weights.tensors, bare_model(weights.model), weights.model, f"{weights.kind} weights")
    return weights.tensors


def write_consolidated(weights: sources.Weights, tensors: dict, out: str, max_shard_bytes: int) -> None:
    files.write_weights(tensors, out, max_shard_bytes)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(weights.run_yaml or run_yaml_for(weights.model))
    if weights.tokenizer_model and os.path.isfile(weights.tokenizer_model):
        shutil.copyfile(weights.tokenizer_model, os.path.join(out, "tokenizer.model"))


def convert(source: str, to: str, output: str, dtype: str = "fp32", force: bool = False,
            max_shard_bytes: int = files.DEFAULT_SHARD_BYTES) -> str:
    if to not in TARGETS or dtype not in DTYPES:
        raise UserError(f"--to {to} --dtype {dtype}: choose --to from {TARGETS} and --dtype from {tuple(DTYPES)}")
    with files.staged_output(output, force) as tmp:
        weights = sources.read(source)
        tensors = {k: v.to(DTYPES[dtype]) for k, v in full_checked(weights).items()}
        if to == "consolidated":
            write_consolidated(weights, tensors, tmp, max_shard_bytes)
        else:
            from megahybrid.convert.hf_export import write_hf  # imports transformers: only for --to hf

            write_hf(weights, tensors, tmp, dtype, max_shard_bytes)
    return os.path.abspath(output)
