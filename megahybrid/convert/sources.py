"""Read full (unsharded) weights and their model config from any source: a training checkpoint (a step
directory, or a checkpoint directory with `latest`), a consolidated directory, or a Hugging Face export."""
import json
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from megahybrid.convert import adapter, files, hf_config
from megahybrid.convert.local import bare_model, partition_tags
from megahybrid.convert.zero import rank_states, tp_size
from megahybrid.errors import UserError
from megahybrid.model.config import preset
from megahybrid.model.sharding import merge_shards
from megahybrid.train.checkpoint import CheckpointManager
from megahybrid.train.config import load_config


@dataclass
class Weights:
    model: object  # ModelConfig
    tensors: dict  # our parameter names -> full fp32 (or stored dtype) tensors
    run_yaml: str | None  # the run config, when the source has one
    tokenizer_model: str | None  # a SentencePiece model file, when the source names or holds one
    kind: str


def detect(path: str) -> str:
    if not os.path.isdir(path):
        raise UserError(f"checkpoint {path} is not a directory: give a training checkpoint, a consolidated or a "
                        "Hugging Face directory")
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return "checkpoint"
    if os.path.isfile(os.path.join(path, "latest")):
        return "checkpoint_root"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if os.path.isfile(os.path.join(path, "config.yaml")) and files.has_weights(path):
        return "consolidated"
    raise UserError(f"{path} is neither a training checkpoint (trainer_state.json), a checkpoint directory "
                    f"(latest), a Hugging Face export (config.json) nor a consolidated one (config.yaml + weights)")


def read(path: str, tags: dict | None = None) -> Weights:
    """Full weights under our names; `tags` (partition dim and stride per name) saves building the model."""
    kind = detect(path)
    if kind == "checkpoint_root":
        with open(os.path.join(path, "latest")) as f:
            path, kind = os.path.join(path, f.read().strip()), "checkpoint"
    if kind == "checkpoint":
        return read_checkpoint(path, tags)
    return {"consolidated": read_consolidated, "hf": read_hf}[kind](path)


def _run_model(run_yaml_path: str):
    cfg = load_config(run_yaml_path)
    return cfg, preset(cfg.model.preset, **cfg.model.overrides)


def _tokenizer_of(run_cfg) -> str | None:
    if run_cfg.data.builtin:
        return os.path.join(run_cfg.data.builtin_dir, "builtin-tokenizer.model")
    return run_cfg.data.fields.get("tokenizer_model")


def read_checkpoint(step_dir: str, tags: dict | None = None) -> Weights:
    """Verify the manifest, merge ZeRO partitions per TP rank, then TP shards by the model's partition tags."""
    model_cfg, full = read_checkpoint_states(step_dir, tags)
    run_cfg, _ = _run_model(os.path.join(step_dir, "config.yaml"))
    with open(os.path.join(step_dir, "config.yaml")) as f:
        return Weights(model_cfg, full["fp32"], f.read(), _tokenizer_of(run_cfg), "checkpoint")


def read_checkpoint_states(step_dir: str, tags: dict | None = None, keys=("fp32",)) -> tuple:
    """(model config, {key: {name: full tensor}}) of a verified training checkpoint, for each key of
    zero.rank_states ("fp32" masters, Adam's "exp_avg" / "exp_avg_sq")."""
    problem = CheckpointManager(os.path.dirname(step_dir), keep=1)._verify(step_dir)
    if problem:
        raise UserError(f"checkpoint {step_dir} is unusable ({problem}); use an older one")
    _, model_cfg = _run_model(os.path.join(step_dir, "config.yaml"))
    tags = tags or partition_tags(bare_model(model_cfg))
    ranks = [rank_states(step_dir, r, keys) for r in tqdm(range(tp_size(step_dir)), desc="reading TP ranks")]
    full = {key: {} for key in keys}
    for key in keys:
        for name, tag in tags.items():
            shards = [r[key][name] for r in ranks]
            full[key][name] = merge_shards(shards, *tag) if tag and len(shards) > 1 else shards[0]
    return model_cfg, full


def read_consolidated(path: str) -> Weights:
    run_cfg, model_cfg = _run_model(os.path.join(path, "config.yaml"))
    tokenizer = os.path.join(path, "tokenizer.model")
    with open(os.path.join(path, "config.yaml")) as f:
        return Weights(model_cfg, files.read_weights(path), f.read(),
                       tokenizer if os.path.isfile(tokenizer) else _tokenizer_of(run_cfg), "consolidated")


def read_hf(path: str) -> Weights:
    try:
        with open(os.path.join(path, "config.json")) as f:
            values = json.load(f)
    except ValueError as err:
        raise UserError(f"{path}/config.json is not valid JSON ({err}); fix or export it again") from None
    if values.get("model_type") != "megahybrid":
        raise UserError(f"{path}/config.json has model_type={values.get('model_type')!r}; only megahybrid exports "
                        "can be imported")
    model_cfg = hf_config.model_config(values)
    tensors = adapter.from_hf(files.read_weights(path), model_cfg)
    tokenizer = os.path.join(path, "tokenizer.model")
    return Weights(model_cfg, tensors, None, tokenizer if os.path.isfile(tokenizer) else None, "hf")


def check_shapes(tensors: dict[str, torch.Tensor], model, model_cfg, source: str) -> None:
    """Every parameter of `model` (full shapes) present with its shape, nothing extra; a mismatch names the
    config fields that set the shapes."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model has not"
        raise UserError(f"{source} {what}: the weights do not belong to a model of this config (model.pattern="
                        f"{model_cfg.pattern!r}, model.num_layers={model_cfg.num_layers})")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise UserError(
                f"{source}: {name} has shape {tuple(tensors[name].shape)} but the config gives {shape} (model."
                f"hidden_size={model_cfg.hidden_size}, num_heads={model_cfg.num_heads}, num_kv_heads="
                f"{model_cfg.kv_heads}, ffn_hidden_size={model_cfg.ffn_size}, vocab_size={model_cfg.vocab_size}): "
                "the config does not match the weights; fix the config")
