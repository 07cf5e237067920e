"""`megahybrid slurm submit` and the slurm/ templates against a real two-node Slurm on this machine (CPU, gloo):
a 2-node training job, the same job signalled mid-run (saved, requeued, resumed to the same losses), afterok
chains after success and failure, a study (job array) of two configs through the torchrun template; and the
rendered script (also of a shipped study) and flag errors without a cluster. Skipped, with the reason printed, where the daemons cannot start
(`make test` installs slurm-wlm and munge with apt when it can)."""
import contextlib
import io
import os
import re
import subprocess
import time

import pytest
import yaml

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
    """`megahybrid slurm submit` (in this process: no second start-up) of the tiny run on 2 CPU nodes, or of the
    YAML `configs` as an array; the job ids it printed, the training's first."""
    from megahybrid.cli import main

    config_args = [f"--config={c}" for c in configs] if configs is not None else _args(run_dir, data_dir, STEPS, *extra)[1:]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        for key, value in _env({"SLURM_CONF": cluster.conf}).items():
            patch.setenv(key, value)
        code = main(["slurm", "submit", *config_args, "--nodes=2", "--gpus-per-node=0", "--time=00:10:00",
                     "--signal-lead=60", *flags])
    assert code == 0, printed.getvalue()
    first = re.search(r"submitted job (\d+)(?: \(then ([\d, ]+)\))?", printed.getvalue())
    assert first, printed.getvalue()
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
def jobs(cluster, data_dir, tmp_path_factory):  # noqa: F811
    """Every cluster job of this module, submitted at once so that they overlap: the uninterrupted run chained to
    a command, the run to be signalled, a failing run chained to a command, and a study (job array) of two configs."""
    root = tmp_path_factory.mktemp("slurm-runs")
    out = {"root": root}
    out["signalled"] = submit(cluster, str(root / "signalled"), data_dir, extra=("debug.sleep_per_step=2",))[0]
    out["reference"] = submit(cluster, str(root / "reference"), data_dir, f"--then=date > {root / 'after-ok'}")
    out["failing"] = submit(cluster, str(root / "failing"), data_dir, f"--then=date > {root / 'after-failure'}",
                            extra=("data.builtin=false", "data.prefixes=[/nonexistent/corpus]"))
    out["array"] = submit(cluster, None, data_dir, "--launcher=torchrun", f"--study={_study(root, data_dir)}",
                          configs=[])[0]
    return out


def _study(root, data_dir):  # noqa: F811
    """A study file listing two tiny configs (paths relative to it) that differ in the learning rate."""
    from megahybrid.train.config import load_config

    names = []
    for lr in ("1e-3", "2e-3"):
        cfg = load_config("demo", [*_args(str(root / f"lr-{lr}"), data_dir, STEPS)[3:], f"optimizer.lr={lr}"])
        names.append(f"lr-{lr}.yaml")
        (root / names[-1]).write_text(cfg.to_yaml())
    (root / "lr-study.yaml").write_text(f"configs: [{', '.join(names)}]\n")
    return root / "lr-study.yaml"


def _read(run_dir, name):
    with open(os.path.join(run_dir, "slurm", "logs", name)) as f:
        return f.read()


@pytest.mark.dist
@pytest.mark.slow
def test_signal_saves_requeues_and_resumes_to_the_same_losses(cluster, jobs):
    job, run_dir = jobs["signalled"], str(jobs["root"] / "signalled")
    deadline = time.monotonic() + 240
    while not _logged_a_loss(run_dir):
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), \
            cluster.job(job)
        time.sleep(0.3)
    cluster.run(["scancel", "--signal=USR1", "--batch", job])
    batch_log = assert_finished(cluster, job, run_dir, restarts=1)
    first_run = _read(run_dir, f"{job}.0-rank0.log")
    stopped = int(re.search(r"saved \S+step_(\d+); exiting with code 3", first_run).group(1))
    assert 1 <= stopped < STEPS, first_run[-2000:]
    assert "got SIGUSR1, forwarding it" in batch_log and "requeueing job" in batch_log
    assert f"step_{stopped:08d} at step {stopped}" in _read(run_dir, f"{job}.1-rank0.log")
    reference = str(jobs["root"] / "reference")
    assert_finished(cluster, jobs["reference"][0], reference)
    assert losses(run_dir) == losses(reference)


def _logged_a_loss(run_dir) -> bool:
    try:
        return bool(losses(run_dir))
    except (OSError, ValueError):  # not written yet, or a line half written
        return False


@pytest.mark.dist
@pytest.mark.slow
def test_two_node_job_trains_and_checkpoints(cluster, jobs):
    run_dir, (train, _) = str(jobs["root"] / "reference"), jobs["reference"]
    batch_log = assert_finished(cluster, train, run_dir)
    assert "megahybrid: training finished" in batch_log
    rank_logs = sorted(os.listdir(os.path.join(run_dir, "slurm", "logs")))
    assert f"{train}.0-rank0.log" in rank_logs and f"{train}.0-rank1.log" in rank_logs, rank_logs
    assert "world_size=2" in _read(run_dir, f"{train}.0-rank0.log")
    curve = losses(run_dir)
    assert curve[STEPS] < curve[1], curve
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", f"step_{STEPS:08d}", "manifest.json"))
    assert os.listdir(os.path.join(run_dir, "tensorboard"))


@pytest.mark.dist
@pytest.mark.slow
def test_dependency_chain_runs_only_after_success(cluster, jobs):
    train, then = jobs["reference"]
    assert cluster.wait_done(then)["JobState"] == "COMPLETED"
    assert cluster.job(then)["StartTime"] >= cluster.job(train)["EndTime"]
    assert (jobs["root"] / "after-ok").exists()
    train, then = jobs["failing"]
    assert cluster.wait_done(train)["ExitCode"] == "2:0"
    follower = cluster.wait_done(then)
    assert follower["JobState"] == "CANCELLED" and follower["Reason"] == "DependencyNeverSatisfied", follower
    assert not (jobs["root"] / "after-failure").exists()
    assert "config or data error (exit 2)" in _read(str(jobs["root"] / "failing"), f"mh-demo-{train}.out")


@pytest.mark.dist
@pytest.mark.slow
def test_study_array_of_two_configs_through_torchrun(cluster, jobs):
    run_dirs = [str(jobs["root"] / f"lr-{lr}") for lr in ("1e-3", "2e-3")]
    assert f"mh-lr-study-{jobs['array']}_0.out" in os.listdir(os.path.join(run_dirs[0], "slurm", "logs"))
    for task, run_dir in enumerate(run_dirs):
        assert_finished(cluster, f"{jobs['array']}_{task}", run_dir)
        assert "world_size=2" in _read(run_dir, f"{jobs['array']}_{task}.0-node0.log")
    assert losses(run_dirs[0])[STEPS] != losses(run_dirs[1])[STEPS]


def test_dry_run_renders_and_bad_flags_fail_in_one_line(tmp_path, capsys):
    from megahybrid.cli import main

    run_dir = str(tmp_path / "run")
    base = ["slurm", "submit", "--config=demo", f"run_dir={run_dir}", "batch.global_batch_size=256",
            "--nodes=4", "--gpus-per-node=8", "--time=1-00:00:00", "--partition=gpu", "--sbatch=--account=proj",
            "--dry-run"]
    assert main(base) == 0
    script = open(os.path.join(run_dir, "slurm", "job.sbatch")).read()
    assert capsys.readouterr().out == script and "{{" not in script
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=1-00:00:00", "#SBATCH --signal=B:USR1@300",
                 f"MH_CONFIGS=({run_dir}/slurm/config.yaml)", f"source {REPO}/slurm/lib.sh"):
        assert line in script.splitlines(), line
    bad = {"--time=90min": "--time 90min: use HH:MM:SS", "--nodes=0": "--nodes 0: use 1 or more",
           "--signal-lead=100000": "--signal-lead 100000: use more than 0 and less than --time",
           "batch.global_batch_size=12": "batch.global_batch_size=12 is not a multiple",
           "--sbatch=account": "--sbatch 'account': give one sbatch option",
           "--config=125m": "the job array's configs share a run_dir"}
    for flag, message in bad.items():
        assert main([*base[:5], flag, *base[5:]] if not flag.startswith("--") else [*base, flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err


def test_shipped_study_renders_one_array_task_per_config(tmp_path, monkeypatch, capsys):
    from megahybrid.cli import main
    from megahybrid.slurm import study_configs

    monkeypatch.chdir(tmp_path)
    names = study_configs("interdomain-ablation")
    assert main(["slurm", "submit", "--study=interdomain-ablation", "data.prefixes=[/data/x]",
                 "data.tokenizer_model=/data/x.model", "--nodes=2", "--gpus-per-node=8", "--time=1-00:00:00",
                 "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert f"#SBATCH --array=0-{len(names) - 1}" in script and "#SBATCH --job-name=mh-interdomain-ablation" in script
    configs = re.search(r"^MH_CONFIGS=\((.*)\)$", script, re.M).group(1).split()
    assert configs == [str(tmp_path / "runs" / name / "slurm" / "config.yaml") for name in names]
    cell = yaml.safe_load(open(tmp_path / "runs" / "125m-interdomain-dual-contraction" / "slurm" / "config.yaml"))
    assert cell["model"]["interdomain"]["variant"] == "dual-contraction" and cell["optimizer"]["lr"] == 3e-3
    (tmp_path / "bad.yaml").write_text("configs: 125m\n")
    for flags, message in ((["--study=nope"], "--study nope: no such file and no shipped study"),
                           (["--study=bad.yaml"], "--study bad.yaml: give a list of config names"),
                           ([], "nothing to submit: give --config NAME")):
        assert main(["slurm", "submit", *flags, "--nodes=1", "--gpus-per-node=0", "--time=01:00:00",
                     "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("rank_codes,launcher,restart,expect,says", [
    ("3 3", 1, 0, 3, "scontrol requeue 77"),  # torchrun's 1 hides the ranks' 3
    ("3 3", 3, 2, 3, "not requeued: 2 requeues reached MH_MAX_REQUEUES"),
    ("0 0", 0, 0, 0, "training finished"),
    ("2 2", 2, 0, 2, "config or data error"),
    ("3 0", 3, 0, 1, "crashed"),  # ranks disagree: a crash, whatever the launcher says
    ("", 137, 0, 137, "crashed"),
    ("3", 1, 0, 1, "crashed"),  # a rank died without a code
])
def test_batch_script_requeues_only_on_exit_3_below_the_limit(tmp_path, rank_codes, launcher, restart, expect, says):
    exit_dir = tmp_path / "exit"
    exit_dir.mkdir()
    for rank, code in enumerate(rank_codes.split()):
        (exit_dir / f"rank{rank}").write_text(f"{code}\n")
    script = (f"source {REPO}/slurm/lib.sh; scontrol() {{ echo scontrol \"$@\"; }}; SLURM_JOB_ID=77; "
              f"MEGAHYBRID_EXIT_DIR={exit_dir}; MH_LOG_DIR={tmp_path}; MH_RESTART={restart}; MH_MAX_REQUEUES=2; "
              f"MH_CODE={launcher}; mh_finish 2")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == expect and says in done.stdout, (done.returncode, done.stdout, done.stderr)
    assert ("scontrol requeue" in done.stdout) == (says == "scontrol requeue 77")
