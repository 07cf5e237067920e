"""One run per run directory.

`RunDirLock` makes a directory exclusive: the holder keeps an flock on `.megahybrid.lock` (the kernel drops it when
the process dies, however it dies) and writes its pid and host into the file for the message a second run prints.
Where the filesystem has no flock the record alone decides: a record of a dead pid on this host is stale and is
taken over; a live pid, or any pid on another host, holds the directory.
"""
import errno
import fcntl
import json
import os
import socket
import time

from megahybrid.errors import UserError

LOCK_NAME = ".megahybrid.lock"


def output_dirs(cfg) -> dict[str, str]:
    """Config field -> directory, for every directory a run writes into."""
    dirs = {"run_dir": cfg.run_dir, "checkpoint.dir": cfg.checkpoint_dir}
    if cfg.logging.tensorboard:
        dirs["logging.tensorboard_dir"] = cfg.tensorboard_dir
    return dirs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """An exclusive claim on one directory, held until `release()` or the end of the process."""

    def __init__(self, directory: str, field: str = "run_dir"):
        self.path = os.path.join(directory, LOCK_NAME)
        self.field, self.directory, self.fd = field, directory, None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise self._busy(holder) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            self._check_record(fd)
        self.fd = fd
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        os.fsync(fd)

    def _check_record(self, fd: int) -> None:
        """No flock here: a record naming a live process (or any process on another host) holds the directory."""
        holder = self._holder(fd)
        if not holder:
            return
        if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", -1))):
            return
        os.close(fd)
        raise self._busy(holder)

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            return {}

    def _busy(self, holder: dict) -> UserError:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
        return UserError(
            f"{self.field}={self.directory} is in use by another run (pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')} since {since}): wait for it, stop it, or choose another {self.field}; "
            f"if that run has ended, delete {self.path}"
        )

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None


_HELD: list[RunDirLock] = []


def lock_outputs(cfg) -> None:
    """Lock run_dir, and checkpoint.dir when it lies outside run_dir (two runs may share neither)."""
    dirs = {"run_dir": cfg.run_dir}
    run_dir = os.path.realpath(cfg.run_dir)
    if os.path.commonpath([run_dir, os.path.realpath(cfg.checkpoint_dir)]) != run_dir:
        dirs["checkpoint.dir"] = cfg.checkpoint_dir
    for field, path in dirs.items():
        lock = RunDirLock(path, field)
        lock.acquire()
        _HELD.append(lock)


def release_all() -> None:
    while _HELD:
        _HELD.pop().release()
