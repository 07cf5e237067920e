"""Run a test body on N gloo ranks in one launch (spawned processes, MASTER_ADDR=127.0.0.1, a free port).

Each launch pays ~6-12 s of imports on 2 cores, so a body should group several checks. The body is a
module-level function `fn(rank, world_size, *args)`; each rank's return value comes back to the test.
"""
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, out_dir, fn, args, extra_env):
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"), **extra_env,
    })
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # the test process re-raises with the rank's traceback
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_on_ranks(fn, world_size: int, *args, env: dict | None = None, timeout: float = 600) -> list:
    """fn(rank, world_size, *args) on `world_size` processes; returns the per-rank results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker, args=(world_size, free_port(), out_dir, fn, args, env or {}),
            nprocs=world_size, join=False, start_method="spawn",
        )
        _wait(ctx, out_dir, world_size, timeout)
        outcomes = [_read(out_dir, rank) for rank in range(world_size)]
        for rank, (status, value) in enumerate(outcomes):
            if status == "error":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
        for rank, (status, _) in enumerate(outcomes):
            if status != "ok":
                raise AssertionError(f"rank {rank} of {world_size} exited without a result")
        results = [value for _, value in outcomes]
        return results


def _wait(ctx, out_dir, world_size, timeout):
    """Join all ranks; a rank that failed leaves its peers blocked in a collective, so stop them."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while not ctx.join(timeout=1):
        now = time.monotonic()
        if failed_at is None and _any_failed(out_dir, world_size):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 10):
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
            if failed_at is None:
                raise AssertionError(f"{world_size}-rank run did not finish within {timeout:.0f} s")
            return


def _any_failed(out_dir, world_size) -> bool:
    for rank in range(world_size):
        try:
            if _read(out_dir, rank)[0] == "error":
                return True
        except (EOFError, pickle.UnpicklingError):
            pass
    return False


def _read(out_dir, rank):
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return ("missing", None)
    with open(path, "rb") as f:
        return pickle.load(f)
