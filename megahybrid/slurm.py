"""`megahybrid slurm submit`: render an sbatch script from slurm/ for a resolved run config, write it next to the
run (`<run_dir>/slurm/job.sbatch`), and submit it, with optional follow-up steps (`--then CMD`, run only after the
training succeeded). Several `--config`, or a `--study` (a list of configs in megahybrid/configs/studies/), make
one job array, one config per task.

The job's own behaviour (signal forwarding, requeue on exit 3, the requeue limit) lives in slurm/lib.sh.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megahybrid.errors import UserError

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = {"srun": REPO / "slurm" / "srun.sbatch", "torchrun": REPO / "slurm" / "torchrun.sbatch"}
STUDIES = REPO / "megahybrid" / "configs" / "studies"
TIME_FORMAT = re.compile(r"^(?:(\d+)-)?(\d{1,3}):([0-5]\d):([0-5]\d)$")


@dataclass
class SlurmJob:
    """What `megahybrid slurm submit` was asked for (one entry of `configs` per array task)."""

    configs: list[str]
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    time: str
    partition: str | None = None
    launcher: str = "srun"
    signal_lead: int = 300
    max_requeues: int = 10
    cpus_per_rank: int | None = None
    setup: str | None = None
    after: str | None = None
    then: list[str] = field(default_factory=list)
    sbatch_options: list[str] = field(default_factory=list)
    study: str | None = None

    @property
    def tasks_per_node(self) -> int:
        """Ranks per node: one per GPU; in CPU mode (gpus_per_node 0) one gloo rank per node."""
        return max(self.gpus_per_node, 1)

    def check(self) -> None:
        if not self.configs:
            raise UserError("nothing to submit: give --config NAME (repeatable) or --study NAME")
        if self.cpus_per_rank is None:
            self.cpus_per_rank = 8 if self.gpus_per_node else 1
        if self.cpus_per_rank < 1:
            raise UserError(f"--cpus-per-rank {self.cpus_per_rank}: use 1 or more")
        if self.nodes < 1:
            raise UserError(f"--nodes {self.nodes}: use 1 or more")
        if self.gpus_per_node < 0:
            raise UserError(f"--gpus-per-node {self.gpus_per_node}: use 0 (CPU, one rank per node) or more")
        limit = time_limit_s(self.time)
        if not 0 < self.signal_lead < limit:
            raise UserError(f"--signal-lead {self.signal_lead}: use more than 0 and less than --time {self.time} "
                            f"({limit} s) so the ranks can save before the limit")
        if self.max_requeues < 0:
            raise UserError(f"--max-requeues {self.max_requeues}: use 0 or more")
        for option in self.sbatch_options:
            if not option.startswith("-") or "\n" in option:
                raise UserError(f"--sbatch {option!r}: give one sbatch option, e.g. --sbatch=--account=proj")
        if self.setup and not os.path.isfile(self.setup):
            raise UserError(f"--setup {self.setup}: no such file (a shell script sourced before the launch)")


def time_limit_s(text: str) -> int:
    match = TIME_FORMAT.match(text)
    if not match:
        raise UserError(f"--time {text}: use HH:MM:SS or D-HH:MM:SS, e.g. --time 04:00:00")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def add_slurm_commands(subparsers) -> None:
    slurm = subparsers.add_parser("slurm", help="submit training to Slurm (templates in slurm/)")
    commands = slurm.add_subparsers(dest="slurm_command", required=True)
    submit = commands.add_parser("submit", help="render <run_dir>/slurm/job.sbatch and run sbatch on it")
    submit.add_argument("--config", action="append", default=[], help="config name or YAML path; repeat it "
                        "for a job array with one config per task")
    submit.add_argument("--study", help="a study name (megahybrid/configs/studies/: interdomain-scaling, "
                        "interdomain-ablation, natsl) or YAML path: a job array of its configs")
    submit.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every config")
    submit.add_argument("--nodes", type=int, required=True)
    submit.add_argument("--gpus-per-node", type=int, required=True, help="0: CPU mode, one gloo rank per node")
    submit.add_argument("--time", required=True, help="HH:MM:SS or D-HH:MM:SS")
    submit.add_argument("--partition")
    submit.add_argument("--launcher", choices=sorted(TEMPLATES), default="srun",
                        help="srun: one task per GPU; torchrun: one torchrun per node")
    submit.add_argument("--signal-lead", type=int, default=300, help="seconds before the time limit at which "
                        "the job is told to save and requeue")
    submit.add_argument("--max-requeues", type=int, default=10, help="a job stopped more often is not requeued")
    submit.add_argument("--cpus-per-rank", type=int, help="CPU cores per rank (default 8 with GPUs, 1 without)")
    submit.add_argument("--setup", help="shell script sourced first (modules, venv); default: this venv")
    submit.add_argument("--after", metavar="JOBID", help="start only after this job succeeded (afterok)")
    submit.add_argument("--then", action="append", default=[], metavar="CMD",
                        help="a command run as its own job after the previous step succeeded; repeatable")
    submit.add_argument("--sbatch", action="append", default=[], metavar="OPTION", help="an extra #SBATCH line, "
                        "e.g. --sbatch=--account=proj --sbatch=--qos=high; repeatable")
    submit.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")


def run(args) -> int:
    configs = [*(study_configs(args.study) if args.study else []), *args.config]
    job = SlurmJob(configs=configs, study=args.study, overrides=args.overrides, nodes=args.nodes,
                   gpus_per_node=args.gpus_per_node, time=args.time, partition=args.partition,
                   launcher=args.launcher, signal_lead=args.signal_lead, max_requeues=args.max_requeues,
                   cpus_per_rank=args.cpus_per_rank, setup=args.setup and os.path.abspath(args.setup),
                   after=args.after, then=args.then, sbatch_options=args.sbatch)
    job.check()
    run_dirs = write_configs([resolve_config(job, name) for name in job.configs])
    script_path = run_dirs[0] / "slurm" / "job.sbatch"
    script = render(job, run_dirs, script_path.parent)
    script_path.write_text(script)
    if args.dry_run:
        print(script, end="")
        return 0
    job_ids = submit(job, script_path)
    print_watch_hints(job_ids, run_dirs, script_path.parent)
    return 0


def study_configs(name_or_path: str) -> list[str]:
    """The configs a study lists (`configs: [...]`): shipped names, or YAML paths relative to the study file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = STUDIES / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in STUDIES.glob("*.yaml"))
        raise UserError(f"--study {name_or_path}: no such file and no shipped study of that name; use one of {names}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        raw = None
    configs = raw.get("configs") if isinstance(raw, dict) else None
    if not isinstance(configs, list) or not configs or not all(isinstance(c, str) for c in configs):
        raise UserError(f"--study {path}: give a list of config names or paths as `configs: [a, b]`")
    return [str(path.parent / c) if (path.parent / c).is_file() else c for c in configs]


def resolve_config(job: SlurmJob, name: str):
    """Load one config with the overrides, run_dir made absolute, validated for the job's world size."""
    from megahybrid.train.config import load_config, validate  # numpy, sentencepiece: not at CLI start

    cfg = load_config(name, job.overrides)
    cfg.run_dir = os.path.abspath(cfg.run_dir)
    validate(cfg, job.nodes * job.tasks_per_node, job.gpus_per_node > 0, check_data=False)
    return cfg


def write_configs(configs: list) -> list[Path]:
    """Each resolved config into <run_dir>/slurm/config.yaml (what the job trains); the run dirs."""
    run_dirs = [Path(cfg.run_dir) for cfg in configs]
    if len(set(run_dirs)) != len(run_dirs):
        raise UserError("the job array's configs share a run_dir; give each its own (run_dir=... in its YAML)")
    for cfg, run_dir in zip(configs, run_dirs):
        (run_dir / "slurm" / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "slurm" / "config.yaml").write_text(cfg.to_yaml())
    return run_dirs


def render(job: SlurmJob, run_dirs: list[Path], slurm_dir: Path) -> str:
    array = len(run_dirs) > 1
    extra = [f"#SBATCH --partition={job.partition}" if job.partition else "",
             f"#SBATCH --gpus-per-node={job.gpus_per_node}" if job.gpus_per_node else "",
             f"#SBATCH --array=0-{len(run_dirs) - 1}" if array else "",
             f"#SBATCH --dependency=afterok:{job.after}" if job.after else "",
             *(f"#SBATCH {option}" for option in job.sbatch_options)]
    values = {
        "job_name": f"mh-{Path(job.study or job.configs[0]).stem}" if job.study or not array else "mh-sweep",
        "nodes": job.nodes, "tasks_per_node": job.tasks_per_node, "time": job.time,
        "cpus_per_task": job.cpus_per_rank * (job.tasks_per_node if job.launcher == "torchrun" else 1),
        "signal_lead": job.signal_lead, "max_requeues": job.max_requeues, "workdir": os.getcwd(),
        "batch_log": slurm_dir / "logs" / ("%x-%A_%a.out" if array else "%x-%j.out"),
        "sbatch_extra": "\n".join(line for line in extra if line), "setup": setup_lines(job.setup), "repo": REPO,
        "configs": " ".join(shlex.quote(str(d / "slurm" / "config.yaml")) for d in run_dirs),
        "run_dirs": " ".join(shlex.quote(str(d)) for d in run_dirs),
    }
    return fill(TEMPLATES[job.launcher].read_text(), values)


def fill(template: str, values: dict) -> str:
    missing = sorted(set(re.findall(r"\{\{(\w+)\}\}", template)) - set(values))
    if missing:
        raise UserError(f"slurm template placeholders without a value: {missing}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(values[m.group(1)]), template)


def setup_lines(setup: str | None) -> str:
    """The environment preamble: the user's script (modules, conda), else activate the venv we run from."""
    if setup:
        return f"source {shlex.quote(setup)}"
    if sys.prefix != sys.base_prefix:
        return f"source {shlex.quote(os.path.join(sys.prefix, 'bin', 'activate'))}"
    return f"export PATH={shlex.quote(os.path.dirname(sys.executable))}:$PATH"


def submit(job: SlurmJob, script_path: Path) -> list[str]:
    """sbatch the training, then each --then command as a job that starts only after the previous one succeeded
    (and is cancelled, not left pending, when it failed)."""
    if not shutil.which("sbatch"):
        raise UserError("sbatch not found: run this on a Slurm login node (or use --dry-run)")
    ids = [sbatch([str(script_path)])]
    for step, command in enumerate(job.then, start=1):
        log = script_path.parent / "logs" / f"then{step}-%j.out"
        ids.append(sbatch([f"--dependency=afterok:{ids[-1]}", "--kill-on-invalid-dep=yes", f"--job-name=mh-then{step}",
                           f"--output={log}", f"--chdir={os.getcwd()}", "--nodes=1", "--ntasks=1",
                           *([f"--partition={job.partition}"] if job.partition else []), f"--time={job.time}",
                           f"--wrap={command}"]))
    return ids


def sbatch(args: list[str]) -> str:
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"sbatch refused the job: {done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode}")
    return done.stdout.strip().split(";")[0]


def print_watch_hints(job_ids: list[str], run_dirs: list[Path], slurm_dir: Path) -> None:
    print(f"submitted job {job_ids[0]}" + (f" (then {', '.join(job_ids[1:])})" if job_ids[1:] else ""))
    print(f"  watch:   squeue -j {','.join(job_ids)}   |   sacct -j {job_ids[0]} --format=JobID,State,ExitCode,Elapsed")
    print(f"  logs:    {slurm_dir / 'logs'}/ (batch) and <run_dir>/slurm/logs/ (one file per rank)")
    print(f"  cancel:  scancel {job_ids[0]}   (scancel --signal=USR1 --batch {job_ids[0]}: save, requeue, resume)")
    for run_dir in run_dirs:
        print(f"  run:     {run_dir}  (checkpoints/, metrics.jsonl; "
              f"python -m tensorboard.main --logdir {run_dir / 'tensorboard'})")


def record_exit_code(code: int) -> None:
    """Under the slurm/ templates every rank leaves its exit code for the batch script (see slurm/lib.sh)."""
    exit_dir = os.environ.get("MEGAHYBRID_EXIT_DIR")
    if exit_dir and os.path.isdir(exit_dir):
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        with open(os.path.join(exit_dir, f"rank{rank}"), "w") as f:
            f.write(f"{code}\n")
