"""Our parameter names <-> Hugging Face names, one table per mixer (as torchtitan's StateDictAdapter).

Names map by module path, so the exported model can register our very modules under the Hugging Face names
(megahybrid.convert.hf_model). Tensors keep megatron's layout: `qkv_proj` is megatron's fused QKV (per query
group: its q heads, then k, then v) and `gate_up_proj` is SwiGLU's [gate; up]. A new mixer is covered by adding
its entry to MIXER_MODULES; every parameter of the model must be covered (checked on every conversion).
"""
from megahybrid.errors import UserError

GLOBAL_MODULES = {
    "embedding.word_embeddings": "model.embed_tokens",
    "decoder.final_layernorm": "model.norm",
    "output_layer": "lm_head",
}
LAYER_MODULES = {
    "input_layernorm": "input_layernorm",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc1": "mlp.gate_up_proj",
    "mlp.linear_fc2": "mlp.down_proj",
}
# Per pattern character: the mixer's modules inside one decoder layer. The recurrent mixers have no Hugging Face
# counterpart to match, so their whole module moves as one (`mixer.<our submodule path>.<parameter>`).
MIXER_MODULES = {
    "S": {"self_attention.linear_qkv": "self_attn.qkv_proj", "self_attention.linear_proj": "self_attn.o_proj"},
    **{char: {"self_attention": "mixer"} for char in "IDNG"},
}


def module_map(model_cfg) -> dict[str, str]:
    """Every mapped module path of the model: ours -> Hugging Face's."""
    out = dict(GLOBAL_MODULES)
    for i, char in enumerate(model_cfg.layer_pattern):
        if char not in MIXER_MODULES:
            raise UserError(f"mixer {char!r} has no Hugging Face name mapping yet: add it to MIXER_MODULES in "
                            "megahybrid/convert/adapter.py")
        for ours, theirs in {**LAYER_MODULES, **MIXER_MODULES[char]}.items():
            out[f"decoder.layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return out


def _rename(name: str, table: dict[str, str]) -> str:
    """The parameter's module, or the nearest enclosing module that is mapped, renamed."""
    module, _, leaf = name.rpartition(".")
    inner = []
    while module not in table:
        if "." not in module:
            raise UserError(f"parameter {name} has no name mapping: add its module to megahybrid/convert/adapter.py")
        module, _, part = module.rpartition(".")
        inner.insert(0, part)
    return ".".join([table[module], *inner, leaf])


def to_hf(tensors: dict, model_cfg) -> dict:
    table = module_map(model_cfg)
    return {_rename(name, table): t for name, t in tensors.items()}


def from_hf(tensors: dict, model_cfg) -> dict:
    table = {theirs: ours for ours, theirs in module_map(model_cfg).items()}
    return {_rename(name, table): t for name, t in tensors.items()}
