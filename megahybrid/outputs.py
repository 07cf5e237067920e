"""Output directories, checked before any work: a run or a data tool that cannot write fails in seconds."""
import os
import socket

from megahybrid.errors import UserError


def check_writable(field: str, path: str, error=UserError) -> None:
    """Create directory `path` and prove it takes a file (write, fsync, remove a probe); one-line `error` if not.
    `field` names the setting the user changes (run_dir, checkpoint.dir, --output-prefix, ...)."""
    probe = os.path.join(path, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as err:
        raise error(f"{field}={path} is not a writable directory ({err.strerror or err}); "
                    "choose another path") from None
