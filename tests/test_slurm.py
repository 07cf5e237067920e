"""`megahybrid slurm submit` and the slurm/ templates against a real two-node Slurm on this machine (CPU, gloo):
a 2-node training job, the same job signalled mid-run (saved, requeued, resumed to the same losses), afterok
chains after success and failure, a job array of two configs through the torchrun template; and the rendered
script and flag errors without a cluster. Skipped, with the reason printed, where the daemons cannot start
(`make test` installs slurm-wlm and munge with apt when it can)."""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.slurm_cluster import Cluster, ClusterUnavailable
from tests.test_train_resume import REPO, _args, _env, data_dir, latest, losses  # noqa: F401  (data_dir: fixture)

STEPS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    slurm = Cluster(str(tmp_path_factory.mktemp("slurm-state")))
    try:
        slurm.start()
    except ClusterUnavailable as err:
        pytest.skip(f"no test Slurm cluster: {err}")
    yield slurm
    slurm.stop()


def submit(cluster, run_dir, data_dir, *flags, extra=(), configs=None):
    """`megahybrid slurm submit` of the tiny run on 2 CPU nodes (or of the YAML `configs` as an array); the job
    ids it printed, the training's first."""
    config_args = [f"--config={c}" for c in configs] if configs else _args(run_dir, data_dir, STEPS, *extra)[1:]
    cmd = [sys.executable, "-m", "megahybrid", "slurm", "submit", *config_args,
           "--nodes=2", "--gpus-per-node=0", "--time=00:10:00", "--signal-lead=60", *flags]
    done = subprocess.run(cmd, env=_env({"SLURM_CONF": cluster.conf}), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first = re.search(r"submitted job (\d+)(?: \(then ([\d, ]+)\))?", done.stdout)
    assert first, done.stdout
    return [first.group(1), *(first.group(2).split(", ") if first.group(2) else [])]


def assert_finished(cluster, job_id, run_dir, restarts=0):
    fields = cluster.wait_done(job_id)
    batch_log = "".join(open(os.path.join(run_dir, "slurm", "logs", f)).read()
                        for f in os.listdir(os.path.join(run_dir, "slurm", "logs")) if f.endswith(".out"))
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{fields}\n{batch_log[-3000:]}"
    assert fields["Restarts"] == str(restarts), fields
    assert latest(run_dir) == f"step_{STEPS:08d}"
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    return batch_log


@pytest.fixture(scope="module")
def reference(cluster, data_dir, tmp_path_factory):  # noqa: F811
    """The uninterrupted 2-node run, chained to a command that must run after it succeeded."""
    run_dir = str(tmp_path_factory.mktemp("slurm-ref") / "run")
    marker = os.path.join(os.path.dirname(run_dir), "after-ok")
    train, then = submit(cluster, run_dir, data_dir, f"--then=date +%s.%N > {marker}")
    return run_dir, train, then, marker


@pytest.mark.dist
@pytest.mark.slow
def test_two_node_job_trains_and_checkpoints(cluster, reference):
    run_dir, train, _, _ = reference
    batch_log = assert_finished(cluster, train, run_dir)
    assert "megahybrid: training finished" in batch_log
    rank_logs = sorted(os.listdir(os.path.join(run_dir, "slurm", "logs")))
    assert f"{train}.0-rank0.log" in rank_logs and f"{train}.0-rank1.log" in rank_logs, rank_logs
    rank0 = open(os.path.join(run_dir, "slurm", "logs", f"{train}.0-rank0.log")).read()
    assert "world_size=2" in rank0
    curve = losses(run_dir)
    assert curve[STEPS] < curve[1], curve
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", f"step_{STEPS:08d}", "manifest.json"))
    assert os.listdir(os.path.join(run_dir, "tensorboard"))


@pytest.mark.dist
@pytest.mark.slow
def test_signal_saves_requeues_and_resumes_to_the_same_losses(cluster, reference, data_dir, tmp_path):  # noqa: F811
    run_dir = str(tmp_path / "signalled")
    job, = submit(cluster, run_dir, data_dir, extra=("debug.sleep_per_step=1.5",))
    deadline = time.monotonic() + 180
    while not (os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and losses(run_dir)):
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING")
        time.sleep(0.3)
    cluster.run(["scancel", "--signal=USR1", "--batch", job])
    batch_log = assert_finished(cluster, job, run_dir, restarts=1)
    first_run = open(os.path.join(run_dir, "slurm", "logs", f"{job}.0-rank0.log")).read()
    stopped = int(re.search(r"saved \S+step_(\d+); exiting with code 3", first_run).group(1))
    assert 1 <= stopped < STEPS, first_run[-2000:]
    assert "got SIGUSR1, forwarding it" in batch_log and "requeueing job" in batch_log
    rerun = open(os.path.join(run_dir, "slurm", "logs", f"{job}.1-rank0.log")).read()
    assert f"step_{stopped:08d} at step {stopped}" in rerun
    assert losses(run_dir) == losses(reference[0])


@pytest.mark.dist
@pytest.mark.slow
def test_dependency_chain_runs_only_after_success(cluster, reference, data_dir, tmp_path):  # noqa: F811
    run_dir, train, then, marker = reference
    assert cluster.wait_done(then)["JobState"] == "COMPLETED"
    ended = cluster.job(train)["EndTime"]
    assert cluster.job(then)["StartTime"] >= ended
    assert os.path.exists(marker)
    bad_run, bad_marker = str(tmp_path / "bad"), str(tmp_path / "after-failure")
    train, then = submit(cluster, bad_run, data_dir, f"--then=touch {bad_marker}",
                         extra=("data.builtin=false", "data.prefixes=[/nonexistent/corpus]"))
    assert cluster.wait_done(train)["ExitCode"] == "2:0"
    follower = cluster.wait_done(then)
    assert follower["JobState"] == "CANCELLED" and follower["Reason"] == "DependencyNeverSatisfied", follower
    assert not os.path.exists(bad_marker)
    batch_log = open(os.path.join(bad_run, "slurm", "logs", f"mh-demo-{train}.out")).read()
    assert "config or data error (exit 2)" in batch_log


@pytest.mark.dist
@pytest.mark.slow
def test_job_array_of_two_configs_through_torchrun(cluster, data_dir, tmp_path):  # noqa: F811
    from megahybrid.train.config import load_config

    configs, run_dirs = [], []
    for name, lr in (("small-lr", "1e-4"), ("large-lr", "1e-3")):
        run_dir = str(tmp_path / name)
        cfg = load_config("demo", [*_args(run_dir, data_dir, STEPS)[3:], f"optimizer.lr={lr}"])
        configs.append(tmp_path / f"{name}.yaml")
        configs[-1].write_text(cfg.to_yaml())
        run_dirs.append(run_dir)
    job, = submit(cluster, None, data_dir, "--launcher=torchrun", configs=configs)
    for task, run_dir in enumerate(run_dirs):
        assert_finished(cluster, f"{job}_{task}", run_dir)
    assert losses(run_dirs[0])[STEPS] != losses(run_dirs[1])[STEPS]


def test_dry_run_renders_and_bad_flags_fail_in_one_line(tmp_path, capsys):
    from megahybrid.cli import main

    run_dir = str(tmp_path / "run")
    base = ["slurm", "submit", "--config=demo", f"run_dir={run_dir}", "batch.global_batch_size=256",
            "--nodes=4", "--gpus-per-node=8", "--time=1-00:00:00", "--partition=gpu", "--dry-run"]
    assert main(base) == 0
    script = open(os.path.join(run_dir, "slurm", "job.sbatch")).read()
    assert capsys.readouterr().out == script and "{{" not in script
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1-00:00:00", "#SBATCH --signal=B:USR1@300",
                 f"MH_CONFIGS=({run_dir}/slurm/config.yaml)", f"source {REPO}/slurm/lib.sh"):
        assert line in script.splitlines(), line
    bad = {"--time=90min": "--time 90min: use HH:MM:SS", "--nodes=0": "--nodes 0: use 1 or more",
           "--signal-lead=100000": "--signal-lead 100000: use more than 0 and less than --time",
           "batch.global_batch_size=12": "batch.global_batch_size=12 is not a multiple"}
    for flag, message in bad.items():
        assert main([*base[:5], flag, *base[5:]] if not flag.startswith("--") else [*base, flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
