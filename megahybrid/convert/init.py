"""`checkpoint.init_from`: full weights from any source, sharded to this rank's TP slice, copied into a freshly
built model before the DeepSpeed engine exists (so ZeRO's fp32 masters start from them); optimizer and step
start fresh."""
import dataclasses

import torch

from megahybrid.convert import sources
from megahybrid.convert.local import partition_tags
from megahybrid.errors import UserError
from megahybrid.model.sharding import shard_of

IGNORED_FIELDS = ("seq_length", "init_std")  # no weight depends on them


def _architecture(cfg) -> dict:
    """The fields the weights depend on, defaults resolved (num_kv_heads=None is num_heads, ...)."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in IGNORED_FIELDS}
    return {**values, "num_kv_heads": cfg.kv_heads, "ffn_hidden_size": cfg.ffn_size}


def check_same_model(source_cfg, target_cfg, path: str) -> None:
    source = _architecture(source_cfg)
    for name, ours in _architecture(target_cfg).items():
        theirs = source[name]
        if theirs != ours:
            raise UserError(f"checkpoint.init_from {path} holds a model with {name}={theirs!r} but this run has "
                            f"model.{name}={ours!r}: set model.{name}={theirs!r} or use a matching checkpoint")


def local_shard(full, param, tag, tp_rank: int, tp_world: int, what: str):
    """This TP rank's piece of the full tensor `full` of `param` (its ZeRO-3 shape when partitioned), checked."""
    expected = list(getattr(param, "ds_shape", param.shape))
    if tag:
        expected[tag[0]] *= tp_world
    if full is None or list(full.shape) != expected:
        found = "missing" if full is None else f"shape {tuple(full.shape)}"
        raise UserError(f"{what} is {found}, this model needs {tuple(expected)}; use a checkpoint of this model "
                        "config")
    return shard_of(full, *tag, tp_world, tp_rank) if tag and tp_world > 1 else full


def load_full_weights(model, path: str, model_cfg, tp_rank: int, tp_world: int) -> None:
    """Copy this TP rank's shards of the weights at `path` into `model` (built for that rank)."""
    tags = partition_tags(model)
    weights = sources.read(path, tags)
    check_same_model(weights.model, model_cfg, path)
    for name, param in model.named_parameters():
        value = local_shard(weights.tensors.get(name), param, tags[name], tp_rank, tp_world,
                            f"checkpoint.init_from {path}: {name}")
        with torch.no_grad():
            param.copy_(value)
