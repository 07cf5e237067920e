"""Build the decoder on megatron-core's GPTModel from a ModelConfig, a layout and a precision.

Model code holds architecture only; parallel wrapping, checkpointing and compile are applied by the trainer. The
one exception is activation recomputation (model.recompute), a property of the built model for every caller.
"""
import functools

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megahybrid.distributed import context_parallel_group, device
from megahybrid.model.config import ModelConfig
from megahybrid.model.cp import ContiguousShardRotary
from megahybrid.model.loss import vocab_parallel_cross_entropy
from megahybrid.model.mixers import check_context_parallel, max_chunk_size
from megahybrid.model.specs import block_spec
from megahybrid.parallel import ParallelLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _skip_init(weight: torch.Tensor) -> None:
    """An init method that leaves the weight as allocated (the caller loads it)."""


def transformer_config(cfg: ModelConfig, layout: ParallelLayout, precision: str = "fp32",
                       initialize: bool = True) -> TransformerConfig:
    dtype = DTYPES[precision]
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_size,
        kv_channels=cfg.head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        # Initialize every full weight on the CPU from one seed, then shard: the same model for any TP size.
        use_cpu_initialization=True,
        # Without initialize the init methods do nothing; megatron still tags the TP partition of each weight.
        **({} if initialize else dict.fromkeys(("init_method", "output_layer_init_method", "embedding_init_method"),
                                              _skip_init)),
        params_dtype=dtype,
        bf16=precision == "bf16",
        pipeline_dtype=dtype,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        # megatron's own default "full" warns that it is deprecated on every config; [] is what it turns it into
        cuda_graph_scope=[],
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **recompute_fields(cfg),
    )


def recompute_fields(cfg: ModelConfig) -> dict:
    """model.recompute=selective as megatron-core TransformerConfig fields; full is `recompute_layers`' (below)."""
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(cfg.recompute_modules or ["core_attn"])}
    return {}


def recompute_layers(model: GPTModel, cfg: ModelConfig) -> None:
    """model.recompute=full: each decoder layer (the first model.recompute_num_layers when given, as megatron's
    block method) keeps only its input for the backward, which runs its forward again. torch.utils.checkpoint's
    non-reentrant form, which torch.compile traces into its graph, instead of megatron-core's full granularity: its
    reentrant autograd Function (saving and restoring RNG states) broke the compiled graph at every layer
    (torch._dynamo.explain of the tiny model's loss, 4 layers: 11 graphs against 4 without recomputation), and the
    1.3B preset trained at 0.57x the speed without recomputation on the H200 (tools/results/bench_train-recompute.md).
    The model has no dropout, so the recomputed forward is the same computation without megatron's RNG tracker."""
    if cfg.recompute != "full":
        return
    layers = list(model.decoder.layers)
    for layer in layers[:cfg.recompute_num_layers or len(layers)]:
        layer.forward = _recomputed(layer.forward)


def _recomputed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation and decoding keep nothing for a backward anyway
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


class DecoderLM(GPTModel):
    """megatron-core's GPTModel with the cross entropy of megahybrid.model.loss (it saves the logits, not their
    fp32 softmax, for the backward)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        loss_SB = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp)
        return loss_SB.transpose(0, 1).contiguous()


def build_model(cfg: ModelConfig, layout: ParallelLayout, precision: str = "fp32", initialize: bool = True) -> GPTModel:
    """The decoder for this rank's shard, on the current device. forward(tokens, labels) -> per-token loss [b, s].
    `initialize=False` leaves the weights uninitialized (fast) for callers that load them right after."""
    layout.check_model(cfg.num_heads, cfg.kv_heads, cfg.seq_length, max_chunk_size(cfg.pattern))
    check_context_parallel(cfg.pattern, layout.cp)
    model = DecoderLM(
        config=transformer_config(cfg, layout, precision, initialize),
        transformer_layer_spec=block_spec(cfg),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_base),
    )
    if layout.cp > 1:
        model.rotary_pos_emb = ContiguousShardRotary(model.rotary_pos_emb, context_parallel_group().rank(), layout.cp)
    recompute_layers(model, cfg)
    return model.to(device())


def lm_loss(model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
            cp_group=None) -> torch.Tensor:
    """Mean next-token cross entropy over unmasked tokens of this rank's micro-batch. Under context parallelism
    (this rank holds one shard of each sequence) the sum of the shard is divided by the count of the whole
    sequences and multiplied by cp, so the gradient average over the CP ranks is the sequence mean."""
    per_token = model(input_ids=tokens, position_ids=None, attention_mask=None, labels=labels)
    mask = loss_mask.to(per_token.dtype)
    count = mask.sum()
    cp = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
    if cp > 1:
        count = count.detach().clone()
        torch.distributed.all_reduce(count, group=cp_group)
    return (per_token.float() * mask).sum() / count.clamp(min=1) * cp
