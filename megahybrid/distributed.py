"""Process bootstrap: launch environment, process groups, seeds, and the CPU redirections megatron-core needs.

This is the only module that reads or writes megatron's global `parallel_state`. Everything else receives a
`Groups` object built here from a `ParallelLayout`. megatron is imported inside the functions that use it, so
the launch-environment helpers the CLI calls before training do not pay for it.
"""
import contextlib
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megahybrid.errors import UserError
from megahybrid.parallel import ParallelLayout

_CPU_REDIRECTED = False


class _CpuRNGStatesTracker:
    """megatron's model-parallel RNG tracker, keeping CPU generator states instead of CUDA ones."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self.states_, self.seeds_ = {}, set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG tracker: seed {seed} or state {name} already added")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def apply_cpu_redirections() -> None:
    """Let megatron-core 0.16 run without CUDA: it asks `torch.cuda.current_device()` for buffer, rotary and
    sequence-parallel allocations, synchronizes in the checkpoint writer, and keeps CUDA RNG states (also around
    recomputed activations). Applied only when CUDA is absent. This is the only place megatron's CUDA calls are
    patched; other CPU-vs-GPU choices sit where they are used: precision, torch.compile and offload checks
    (train/config.py), the optimizer's fused/foreach (train/engine.py), CUDA RNG state in checkpoints
    (train/checkpoint.py), memory stats (train/metrics.py), the device of eval/convert (eval/, convert/local.py)."""
    global _CPU_REDIRECTED
    if _CPU_REDIRECTED or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    mp_random.CudaRNGStatesTracker = _CpuRNGStatesTracker
    mp_random._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mp_random.initialize_rng_tracker = lambda *a, **k: None
    # Activation recomputation saves and restores the CUDA RNG state around each recomputed forward; on CPU the
    # CPU generator (which it saves as well) is the only one, so the CUDA one is an empty placeholder.
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    _CPU_REDIRECTED = True


def _silence_row_linear_group_warning() -> None:
    """megatron-core 0.16.1's RowParallelLinear.forward hands its linear function tp_group=None, which looks the
    default group up and warns on rank 0 at every call. Under torch.compile that warning is a graph break: rank 0's
    model split into three graphs per layer (the other ranks' not), measured with torch._dynamo.explain. The same
    lookup without the warning, for the tensor_parallel.layers module only."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers

    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "_megahybrid", False):
        return

    def tp_group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and not is_expert and dist.is_initialized() and ps.is_initialized():
            return ps.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return original(tp_group, is_expert, check_initialized)

    tp_group_if_none._megahybrid = True
    layers.get_tensor_model_parallel_group_if_none = tp_group_if_none


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, srun (SLURM_*) or mpirun (OMPI_*), written back to
    RANK / WORLD_SIZE / LOCAL_RANK so torch and DeepSpeed read the same values; alone = one rank."""
    sources = [
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ]
    for rank_key, size_key, local_key in sources:
        if rank_key in os.environ and size_key in os.environ:
            rank, world = int(os.environ[rank_key]), int(os.environ[size_key])
            local = int(os.environ.get(local_key, rank))
            break
    else:
        rank, world, local = 0, 1, 0
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    return rank, world, local


@dataclass
class Groups:
    """Process groups and ranks of one process under a layout."""

    layout: ParallelLayout
    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    tp_group: object
    cp_group: object
    dp_group: object
    dp_cp_group: object

    @property
    def is_loss_rank(self) -> bool:
        """Global rank 0: the one rank that logs and writes the run's metrics."""
        return self.rank == 0


def init_distributed(layout: ParallelLayout, seed: int = 1234, timeout_s: int = 600) -> Groups:
    """Start torch.distributed (gloo on CPU, nccl on GPU), megatron's model-parallel groups and RNG seeds."""
    apply_cpu_redirections()
    rank, world, local = resolve_launch_env()
    layout.check_world(world)
    if torch.cuda.is_available():
        torch.cuda.set_device(local % torch.cuda.device_count())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                store=_loopback_store(rank, world, timeout))
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
    )
    if not torch.cuda.is_available():
        from megatron.core.tensor_parallel import random as mp_random

        mp_random._CUDA_RNG_STATE_TRACKER.reset()
    _silence_row_linear_group_warning()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return _current_groups(layout)


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _loopback_store(rank: int, world: int, timeout: datetime.timedelta):
    """The rendezvous store of a one-node run, reachable from this host only; None = torch's env:// rendezvous
    (torchrun's agent store, or a TCPStore on MASTER_ADDR:MASTER_PORT that listens on all interfaces).

    One rank needs no socket (an in-memory store, so concurrent runs never collide on a port). Several ranks meet
    in a TCPStore whose listening socket we bind to 127.0.0.1 ourselves (torch binds its own to every interface).
    gloo's and NCCL's connections go over the loopback interface too, unless the user chose one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not _is_loopback(os.environ["MASTER_ADDR"]):
        return None
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if world == 1:
        return dist.HashStore()
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A rerun on the same port (a requeued job) must not wait out the last run's TIME_WAIT; Linux still refuses the
    # bind while another socket listens there, so a concurrent run on the port is still caught below.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as err:
        sock.close()
        raise UserError(f"MASTER_PORT={port} on 127.0.0.1 is taken ({err.strerror}), probably by another run on "
                        "this host: export MASTER_PORT=<a free port>") from None
    sock.listen()
    # detach: the store's daemon owns the socket from now on (closing it here would crash the daemon).
    return dist.TCPStore("127.0.0.1", port, world, True, timeout, master_listen_fd=sock.detach(), use_libuv=False)


def _current_groups(layout: ParallelLayout) -> Groups:
    from megatron.core import parallel_state as ps

    return Groups(
        layout=layout,
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
    )


def tensor_parallel_group():
    """The TP group of this process (for modules megatron builds from a spec, which receive only a config)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def context_parallel_group():
    """The CP group of this process (modules built from a spec receive only a config)."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group(check_initialized=False)


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

