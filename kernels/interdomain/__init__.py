"""Interdomain Attention token-mixing op: chunked Triton kernels (forward + backward), a chunked torch path (CPU
tensors, full readouts), decode step, reference."""
from .checks import check_inputs
from .chunk import interdomain_attention, interdomain_bwd_op, interdomain_fwd_op
from .naive import EPS, interdomain_attention_naive
from .recurrent import interdomain_recurrent, interdomain_step
from .torch_chunk import interdomain_readout
from .utils import DEFAULT_PLAN, InterdomainPlan, uses_torch_path

__all__ = ["interdomain_attention", "interdomain_attention_naive", "interdomain_step", "interdomain_recurrent",
           "interdomain_readout", "uses_torch_path", "check_inputs", "interdomain_fwd_op", "interdomain_bwd_op",
           "InterdomainPlan",
           "DEFAULT_PLAN", "EPS"]
