"""Layer specs: one spec function per mixer kind, selected by a pattern character (megatron hybrid style).

A new mixer adds a module and one entry in MIXERS; nothing else in the model changes.
"""
from dataclasses import dataclass
from typing import Callable

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megahybrid.errors import ConfigError
from megahybrid.model.attention import SDPAttention
from megahybrid.model.norm import RMSNorm


def _swiglu_mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def _decoder_layer_spec(mixer: ModuleSpec) -> ModuleSpec:
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


def softmax_layer_spec() -> ModuleSpec:
    """Causal softmax attention with RoPE and optional GQA (SDPA core)."""
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )
    return _decoder_layer_spec(attention)


@dataclass(frozen=True)
class Mixer:
    name: str
    spec: Callable[[], ModuleSpec] | None
    chunk_size: int = 1
    issue: str = ""


MIXERS: dict[str, Mixer] = {
    "S": Mixer("softmax attention", softmax_layer_spec),
    "I": Mixer("Interdomain attention", None, chunk_size=64, issue="the Interdomain mixer layer"),
    "D": Mixer("S4D", None, chunk_size=64, issue="the Interdomain mixer layer"),
    "N": Mixer("NAtS-L", None, chunk_size=64, issue="the NAtS-L mixer layer"),
    "G": Mixer("Gated DeltaNet", None, chunk_size=64, issue="the NAtS-L mixer layer"),
}


def mixer_for(char: str) -> Mixer:
    if char not in MIXERS:
        raise ConfigError(f"model.pattern has unknown mixer {char!r}; known: {', '.join(MIXERS)}")
    mixer = MIXERS[char]
    if mixer.spec is None:
        raise ConfigError(
            f"model.pattern mixer {char!r} ({mixer.name}) is not available yet (it lands with {mixer.issue}); "
            'use "S" for now'
        )
    return mixer


def max_chunk_size(pattern: str) -> int:
    return max(mixer_for(c).chunk_size for c in set(pattern))


def block_spec(layer_pattern: str) -> TransformerBlockSubmodules:
    """One layer spec per pattern character, then the final RMSNorm."""
    layers = [mixer_for(c).spec() for c in layer_pattern]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)
