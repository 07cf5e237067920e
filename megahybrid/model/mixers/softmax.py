"""`S`: causal softmax attention with RoPE and optional GQA, megatron-core's SelfAttention around an SDPA core.

SDPAttention is the `core_attention` submodule on torch's scaled_dot_product_attention (flash / cuDNN on GPU,
math on CPU): megatron's local DotProductAttention materializes the full score matrix, and TransformerEngine is
not a dependency.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megahybrid.distributed import context_parallel_group
from megahybrid.model.cp import gather_sequence
from megahybrid.model.mixers import Mixer


class SDPAttention(MegatronModule):
    """Causal attention, GQA through SDPA's `enable_gqa`. Inputs [s, b, heads, d]; output [s, b, heads * d]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal masks only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention does not support packed sequences or attention bias")
        key, value = self._context_parallel_keys(key, value)
        q_BHSD, k_BHSD, v_BHSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # Decoding hands over the cached keys too, and CP the keys of earlier shards: the queries are the last
        # positions either way, and SDPA's is_causal aligns the mask top-left, so a shorter query block gets the
        # bottom-right causal mask explicitly.
        sq, sk = q_BHSD.shape[2], k_BHSD.shape[2]
        mask = None
        if sq != sk:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q_BHSD.device).tril(diagonal=sk - sq)
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BHSD, v_BHSD,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=mask is None,
            scale=self.softmax_scale,
            enable_gqa=q_BHSD.shape[1] != k_BHSD.shape[1],
        )
        seq, batch = query.shape[0], query.shape[1]
        return out_BHSD.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _context_parallel_keys(self, key, value):
        """Under context parallelism (contiguous shards, megahybrid.model.cp): the keys and values of this shard
        and every earlier one, [s * (cp_rank + 1), b, heads, d]; later shards are causally invisible."""
        if self.config.context_parallel_size == 1:
            return key, value
        group = context_parallel_group()
        visible = key.shape[0] * (torch.distributed.get_rank(group) + 1)
        return gather_sequence(key, 0, group)[:visible], gather_sequence(value, 0, group)[:visible]


def softmax_spec(cfg) -> ModuleSpec:
    return ModuleSpec(
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


def softmax_params(cfg) -> int:
    """q, k, v and output projections (no biases)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    return d * (cfg.num_heads + 2 * cfg.kv_heads) * hd + cfg.num_heads * hd * d


def softmax_flops(cfg) -> float:
    """2 per weight, plus QK^T and AV (2 matmuls x 2 FLOPs per MAC) over the causal half of the score matrix."""
    return 2.0 * softmax_params(cfg) + 2.0 * cfg.seq_length * cfg.num_heads * cfg.head_dim


def softmax_state_floats(cfg, context: int) -> int:
    """The KV cache: keys and values of every earlier token."""
    return 2 * cfg.kv_heads * cfg.head_dim * context


def softmax_cp_bytes(cfg, cp: int, element_bytes: int) -> int:
    """Forward: a ring all-gather of this shard's K and V, (cp - 1) shards each; backward: a reduce-scatter of
    their gradients over the gathered length, (cp - 1) shards each."""
    shard = cfg.kv_heads * cfg.head_dim * (cfg.seq_length // cp) * element_bytes
    return 2 * 2 * (cp - 1) * shard


SOFTMAX = Mixer("S", "softmax attention", softmax_spec, softmax_params, softmax_flops, softmax_state_floats,
                chunk_size=1, cp=True, cp_bytes=softmax_cp_bytes, cp_flops=lambda cfg, cp: 0.0, cache="KV cache")
