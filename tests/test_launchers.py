"""A real `mpirun` launch (Open MPI) trains exactly like torchrun: ranks come from OMPI_*, and with no
MASTER_ADDR/MASTER_PORT exported the ranks agree on 127.0.0.1 and a free port through mpi4py; ranks given
different configs fail at once with one line naming the difference. Skipped, with the reason printed, where Open
MPI is not installed (`make test` installs it with apt when it can)."""
import shutil
import subprocess
import sys

import pytest

from tests.test_train_resume import REPO, _args, _env, data_dir, losses, run  # noqa: F401  (data_dir: fixture)

MPIRUN = shutil.which("mpirun")


@pytest.mark.dist
@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) not installed")
def test_mpirun_matches_torchrun(data_dir, tmp_path):  # noqa: F811
    via_torchrun, via_mpirun = str(tmp_path / "torchrun"), str(tmp_path / "mpirun")
    run(_args(via_torchrun, data_dir, 3), world=2, style="torchrun")
    env = {k: v for k, v in _env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    cmd = [MPIRUN, "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-x", "PYTHONPATH", "-x", "PYTHONWARNINGS",
           "-x", "TORCH_EXTENSIONS_DIR", sys.executable, "-m", "megahybrid", *_args(via_mpirun, data_dir, 3)]
    env.setdefault("TORCH_EXTENSIONS_DIR", f"{REPO}/.cache/torch_extensions")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world_size=2" in proc.stdout
    assert losses(via_mpirun) == losses(via_torchrun) and len(losses(via_mpirun)) == 3


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) not installed")
def test_mpirun_ranks_agree_on_a_free_port(tmp_path):
    pytest.importorskip("mpi4py", reason="mpi4py not installed")
    # Each rank writes its own file: the ranks' stdout lines interleave.
    probe = ("from megahybrid.cli import prepare_launch_env; import os, sys; prepare_launch_env(); "
             "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write("
             "os.environ['MASTER_ADDR'] + ' ' + os.environ['MASTER_PORT'])")
    env = {k: v for k, v in _env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([MPIRUN, "-np", "2", "--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH",
                           sys.executable, "-c", probe, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    agreed = {rank: (tmp_path / rank).read_text().split() for rank in ("0", "1")}
    assert agreed["0"] == agreed["1"] and agreed["0"][0] == "127.0.0.1", agreed
    assert agreed["0"][1] != "29500", "the fixed default port was used instead of the agreed one"


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) not installed")
def test_mpirun_ranks_with_different_configs_fail_naming_the_difference(tmp_path):
    pytest.importorskip("mpi4py", reason="mpi4py not installed")
    rank = [sys.executable, "-m", "megahybrid", "train", "--config", "demo", f"run_dir={tmp_path}"]
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH",
           "-np", "1", *rank, "train.steps=3", "--print-config", ":", "-np", "1", *rank, "train.steps=4", "--print-config"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = {line for line in proc.stderr.splitlines() if line.startswith("error:")}
    assert errors == {"error: rank 1 disagrees with rank 0 on train.steps: 4 on rank 1, 3 on rank 0; launch every "
                      "rank from the same checkout with the same --config and overrides"}, proc.stderr[-2000:]
