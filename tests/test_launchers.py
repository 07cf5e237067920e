"""A real `mpirun` launch (Open MPI) trains exactly like torchrun: ranks come from OMPI_* and the rendezvous
stays on 127.0.0.1. Skipped, with the reason printed, where Open MPI is not installed (`make setup` installs it
with apt when it can)."""
import shutil
import subprocess
import sys

import pytest

from tests.dist import free_port
from tests.test_train_resume import REPO, _args, _env, data_dir, losses, run  # noqa: F401  (data_dir: fixture)

MPIRUN = shutil.which("mpirun")


@pytest.mark.dist
@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) not installed")
def test_mpirun_matches_torchrun(data_dir, tmp_path):  # noqa: F811
    via_torchrun, via_mpirun = str(tmp_path / "torchrun"), str(tmp_path / "mpirun")
    run(_args(via_torchrun, data_dir, 3), world=2, style="torchrun")
    env = _env({"MASTER_PORT": str(free_port())})
    cmd = [MPIRUN, "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-x", "PYTHONPATH", "-x", "MASTER_PORT", "-x", "MASTER_ADDR", "-x", "PYTHONWARNINGS",
           "-x", "TORCH_EXTENSIONS_DIR", sys.executable, "-m", "megahybrid", *_args(via_mpirun, data_dir, 3)]
    env.setdefault("TORCH_EXTENSIONS_DIR", f"{REPO}/.cache/torch_extensions")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world_size=2" in proc.stdout
    assert losses(via_mpirun) == losses(via_torchrun) and len(losses(via_mpirun)) == 3
