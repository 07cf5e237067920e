"""The `I` layer's fused input path (short conv, RoPE, feature map, head norms): Triton kernels forward and
backward, and the fp32 torch definition."""
from .fused import check_inputs, interdomain_input, interdomain_input_bwd_op, interdomain_input_fwd_op
from .naive import interdomain_input_naive

__all__ = ["interdomain_input", "interdomain_input_naive", "interdomain_input_fwd_op", "interdomain_input_bwd_op",
           "check_inputs"]
