"""Decoder layer specs: the pre-norm layer around each pattern character's mixer (megatron hybrid style).

The mixers' own specs live with their records in megahybrid.model.mixers; this module only wraps them.
"""
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megahybrid.model.mixers import mixer_for
from megahybrid.model.norm import RMSNorm


def _swiglu_mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def decoder_layer_spec(mixer: ModuleSpec) -> ModuleSpec:
    """Pre-norm decoder layer around any token mixer; the MLP half is shared by every variant."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=_swiglu_mlp_spec(),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(cfg) -> TransformerBlockSubmodules:
    """One decoder layer spec per character of cfg.layer_pattern, then the final RMSNorm."""
    layers = [decoder_layer_spec(mixer_for(c).spec(cfg)) for c in cfg.layer_pattern]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)
