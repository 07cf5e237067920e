"""NAtS-L token-mixing ops: chunk-selected Gated DeltaNet and attention over selected chunks (see README.md)."""
from megahybrid_kernels.nats.attention import chunk_selected_attention
from megahybrid_kernels.nats.gdn import chunk_selected_gdn, chunk_selected_gdn_step

__all__ = ["chunk_selected_attention", "chunk_selected_gdn", "chunk_selected_gdn_step"]
