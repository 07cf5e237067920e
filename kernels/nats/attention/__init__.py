"""Attention over selected chunks (NAtS-L attention branch): naive reference, Triton kernels, decode step."""
from megahybrid_kernels.nats.attention.chunk import chunk_selected_attention
from megahybrid_kernels.nats.attention.naive import naive_chunk_selected_attention
from megahybrid_kernels.nats.attention.recurrent import (
    SelectedAttentionCache,
    selected_attention_prefill,
    selected_attention_step,
)

__all__ = [
    "chunk_selected_attention",
    "naive_chunk_selected_attention",
    "SelectedAttentionCache",
    "selected_attention_prefill",
    "selected_attention_step",
]
