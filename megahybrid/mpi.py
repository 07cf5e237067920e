"""Rendezvous for `mpirun` launches through mpi4py: the ranks agree on MASTER_ADDR and a free MASTER_PORT, so a
user need not export them (mpirun, unlike torchrun and srun, hands out neither)."""
import socket


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
