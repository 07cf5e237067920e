"""A one-process model-parallel world for work outside a training launch (conversion, the Hugging Face model).

An existing process group is reused; otherwise a private one-rank gloo group rendezvous through a FileStore in a
temporary directory (no port is opened) and megatron's parallel state is set to tp = cp = 1.
"""
import os
import tempfile

import torch
import torch.distributed as dist

from megahybrid.distributed import apply_cpu_redirections
from megahybrid.model.sharding import is_tp_sharded
from megahybrid.parallel import ParallelLayout


def ensure_local_groups() -> None:
    # megatron (several seconds to import) loads only when a model is built, as in bare_model below.
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    apply_cpu_redirections()
    if not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="megahybrid-pg-"), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        if not torch.cuda.is_available():
            from megatron.core.tensor_parallel import random as mp_random

            mp_random._CUDA_RNG_STATE_TRACKER.reset()
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def bare_model(model_cfg, precision: str = "fp32"):
    """The full (tp = 1) model with uninitialized weights, on the CPU: names, shapes and TP partition tags."""
    from megahybrid.model.gpt import build_model  # imports megatron

    ensure_local_groups()
    return build_model(model_cfg, ParallelLayout(), precision, initialize=False).cpu()


def partition_tags(model) -> dict[str, tuple[int, int] | None]:
    """(partition_dim, partition_stride) of every TP-sharded parameter, None for replicated ones."""
    return {name: (p.partition_dim, getattr(p, "partition_stride", 1)) if is_tp_sharded(p) else None
            for name, p in model.named_parameters()}
