"""ModelConfig <-> the Hugging Face config.json fields (Llama names where one exists, our pattern and per-family
mixer options beside them). Needs no transformers import, so reading an exported directory works without it."""
import dataclasses

from megahybrid.model.config import OPTION_SECTIONS, ModelConfig

# Hugging Face field -> ModelConfig field.
FIELDS = {
    "num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads", "intermediate_size": "ffn_hidden_size", "vocab_size": "vocab_size",
    "max_position_embeddings": "seq_length", "pattern": "pattern", "tie_word_embeddings": "tie_embeddings",
    "rope_theta": "rope_base", "rms_norm_eps": "norm_eps", "initializer_range": "init_std",
}
MODULE = "modeling_megahybrid"


def hf_config(model_cfg: ModelConfig, dtype: str) -> dict:
    values = {hf: getattr(model_cfg, ours) for hf, ours in FIELDS.items()}
    values.update(num_key_value_heads=model_cfg.kv_heads, intermediate_size=model_cfg.ffn_size)
    options = {name: dataclasses.asdict(getattr(model_cfg, name)) for name in OPTION_SECTIONS}
    return {
        "architectures": ["MegahybridForCausalLM"], "model_type": "megahybrid",
        "auto_map": {"AutoConfig": f"{MODULE}.MegahybridConfig", "AutoModelForCausalLM": f"{MODULE}.MegahybridForCausalLM"},
        **values, "mixer_options": options, "dtype": dtype, "use_cache": True,
    }


def model_config(values: dict) -> ModelConfig:
    """The ModelConfig a config.json describes (a ConfigError names the field when it is inconsistent)."""
    fields = {ours: values[hf] for hf, ours in FIELDS.items() if hf in values}
    return ModelConfig(**fields).replace(**(values.get("mixer_options") or {}))
