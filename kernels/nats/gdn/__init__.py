"""Chunk-selected Gated DeltaNet (NAtS-L's linear branch): public op, decode step and fp32 reference."""
from megahybrid_kernels.nats.gdn.chunk import chunk_selected_gdn
from megahybrid_kernels.nats.gdn.naive import naive_chunk_selected_gdn
from megahybrid_kernels.nats.gdn.recurrent import chunk_selected_gdn_step

__all__ = ["chunk_selected_gdn", "chunk_selected_gdn_step", "naive_chunk_selected_gdn"]
