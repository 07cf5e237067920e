"""RMSNorm that works under megatron's sequence parallelism.

With SP each TP rank normalizes a different slice of the sequence, so the weight's gradient on one rank covers
only its tokens: the weight passes through an identity whose backward all-reduces over the TP group. The weight
is also tagged `sequence_parallel` (megatron's convention) for tools that inspect it.
"""
import torch
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig

from megahybrid.distributed import tensor_parallel_group


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.sequence_parallel:
            weight = copy_to_tensor_model_parallel_region(weight, group=tensor_parallel_group())
        x_f32 = x.float()
        normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * weight
