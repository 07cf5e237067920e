"""Rendezvous for `mpirun` launches through mpi4py: the ranks agree on MASTER_ADDR and a free MASTER_PORT, so a
user need not export them (mpirun, unlike torchrun and srun, hands out neither), and check that they run the
same resolved config from the same commit."""
import os
import socket
import subprocess
from pathlib import Path

from megahybrid.errors import ConfigError


def mpi_rendezvous(expected_size: int) -> tuple[str, str] | None:
    """(MASTER_ADDR, MASTER_PORT) agreed over MPI_COMM_WORLD; None when mpi4py is not installed or MPI's world is
    not the launcher's (a process not started by mpirun initializes MPI as a singleton of size 1).

    All ranks on one host: 127.0.0.1 (nothing listens on a public address). Several hosts: rank 0's host name.
    Rank 0 picks a free port and broadcasts it, so jobs sharing a node do not collide on a fixed port.
    """
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != expected_size:
        return None
    hosts = comm.allgather(socket.gethostname())
    single_host = len(set(hosts)) == 1
    port = _free_port("127.0.0.1" if single_host else "") if comm.Get_rank() == 0 else None
    port = comm.bcast(port, root=0)
    return ("127.0.0.1" if single_host else hosts[0]), str(port)


def _free_port(bind_addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind_addr, 0))
        return s.getsockname()[1]


def check_config_agreement(config: dict) -> None:
    """Under mpirun: rank 0 broadcasts its resolved config and git commit; if any rank's differ, every rank raises
    the same one-line error naming the first difference (a lone failing rank would leave the others waiting)."""
    if not any(key in os.environ for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return
    try:
        from mpi4py import MPI
    except ImportError:
        return
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return
    mine = {"git commit": _git_commit(), **_flatten(config)}
    reference = comm.bcast(mine if comm.Get_rank() == 0 else None, root=0)
    differences = comm.allgather(first_difference(mine, reference))
    for rank, difference in enumerate(differences):
        if difference:
            key, theirs, ours = difference
            raise ConfigError(f"rank {rank} disagrees with rank 0 on {key}: {theirs!r} on rank {rank}, {ours!r} on "
                              "rank 0; launch every rank from the same checkout with the same --config and overrides")


def first_difference(mine: dict, reference: dict) -> tuple | None:
    """(key, mine, reference) of the first key (sorted) whose values differ; None when all agree."""
    for key in sorted(set(mine) | set(reference)):
        if mine.get(key) != reference.get(key):
            return key, mine.get(key), reference.get(key)
    return None


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _git_commit() -> str | None:
    """HEAD of the checkout this package runs from (plus '+dirty' for uncommitted changes); None outside git."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")
