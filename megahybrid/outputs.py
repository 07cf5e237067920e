"""Output directories, checked before any work: a run or a data tool that cannot write fails in seconds; and the
commit that results record (a light module: the benchmark tools import it without megatron)."""
import os
import socket
import subprocess

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


def git_commit() -> str:
    """The short commit of the code that ran, for the results' records: MEGAHYBRID_COMMIT where set (a copy of the
    working tree on a device machine may carry an older .git), else HEAD ("unknown" outside a checkout)."""
    if os.environ.get("MEGAHYBRID_COMMIT"):
        return os.environ["MEGAHYBRID_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "unknown"
