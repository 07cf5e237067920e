"""A private two-node Slurm cluster on this machine for tests: munge, slurmctld and two slurmd (n1, n2, both on
127.0.0.1 with their own ports), all state under one directory, stopped by their pid files.

Needs root and the Debian packages `slurm-wlm munge` (installed with apt where missing, like `make mpirun-tool`).
`Cluster.start()` raises `ClusterUnavailable` with the reason when the daemons cannot come up, so tests skip.
"""
import os
import shutil
import signal
import subprocess
import time

from tests.dist import free_port

NODES = ("n1", "n2")
CPUS_PER_NODE = 8
PACKAGES = ("slurm-wlm", "munge")


class ClusterUnavailable(RuntimeError):
    pass


def ensure_packages() -> None:
    """Install slurm-wlm and munge with apt when their daemons are missing (root only)."""
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterUnavailable("slurm-wlm/munge are not installed and apt-get as root is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise ClusterUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")


def _slurm_conf(state: str, ctld_port: int, node_ports: dict, srun_ports: tuple) -> str:
    nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                      f"CPUs={CPUS_PER_NODE} RealMemory=2000 State=UNKNOWN" for name, port in node_ports.items())
    # cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
    return f"""ClusterName=mhtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SrunPortRange={srun_ports[0]}-{srun_ports[1]}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.socket,cred_expire=5
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/%n/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/%n/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=10
InactiveLimit=0
MessageTimeout=10
SlurmdTimeout=30
{nodes}
PartitionName=debug Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class Cluster:
    """Start with `start()`, use `env` (SLURM_CONF) for sbatch/squeue/scontrol, stop with `stop()`."""

    def __init__(self, state_dir: str):
        self.state = state_dir
        self.conf = os.path.join(state_dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def start(self) -> None:
        if os.geteuid() != 0:
            raise ClusterUnavailable("the test cluster's daemons run as root (slurmd must start job steps)")
        ensure_packages()
        self._write_config()
        try:
            self._start_munge()
            self._daemon(["slurmctld", "-f", self.conf, "-i"], os.path.join(self.state, "slurmctld.pid"),
                         os.path.join(self.state, "slurmctld.log"))
            for name in NODES:
                self._daemon(["slurmd", "-f", self.conf, "-N", name], self._node_pid(name),
                             os.path.join(self.state, name, "slurmd.log"))
            self._wait_nodes_idle()
        except ClusterUnavailable:
            self.stop()
            raise

    def _write_config(self) -> None:
        os.makedirs(os.path.join(self.state, "ctld"), exist_ok=True)
        for name in NODES:
            os.makedirs(os.path.join(self.state, name, "spool"), exist_ok=True)
        ports = {name: free_port() for name in NODES}
        srun_low = 40000 + os.getpid() % 20000
        with open(self.conf, "w") as f:
            f.write(_slurm_conf(self.state, free_port(), ports, (srun_low, srun_low + 200)))

    def _start_munge(self) -> None:
        munge = os.path.join(self.state, "munge")
        os.makedirs(munge, mode=0o700, exist_ok=True)
        os.chmod(munge, 0o755)  # munged refuses a socket directory that others cannot enter
        key = os.path.join(munge, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._daemon(["munged", "--force", f"--key-file={key}", f"--socket={munge}/munge.socket",
                      f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                      f"--seed-file={munge}/munged.seed"], os.path.join(munge, "munged.pid"),
                     os.path.join(munge, "munged.log"))

    def _node_pid(self, name: str) -> str:
        return os.path.join(self.state, name, "slurmd.pid")

    def _daemon(self, cmd: list, pid_file: str, log_file: str, timeout: float = 20) -> None:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        deadline = time.monotonic() + timeout
        while done.returncode == 0 and time.monotonic() < deadline:
            if os.path.exists(pid_file) and os.path.getsize(pid_file):
                return
            time.sleep(0.2)
        log = open(log_file).read() if os.path.exists(log_file) else ""
        reason = (done.stderr + done.stdout + log).strip().splitlines()[-3:]
        raise ClusterUnavailable(f"{cmd[0]} did not start (exit {done.returncode}): {' | '.join(reason)}")

    def _wait_nodes_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if all(states.get(name) == "idle" for name in NODES):
                return
            time.sleep(0.5)
        raise ClusterUnavailable(f"nodes did not become idle: {states} (logs in {self.state})")

    def run(self, cmd: list, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def job(self, job_id: str) -> dict:
        """`scontrol show job` fields of one job (of its first record for an array)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout.splitlines()[0]
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_done(self, job_id: str, timeout: float = 240) -> dict:
        """Wait until the job is finished (not pending, running, requeued or completing); its final fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields["JobState"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING"):
                return fields
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not done after {timeout} s: {fields}")

    def stop(self) -> None:
        """Cancel every job, wait for an empty queue, stop the daemons by pid file, remove the state."""
        if os.path.exists(os.path.join(self.state, "slurmctld.pid")):
            self.run(["scancel", "--full", "--quiet", "-u", "root"], check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        pid_files = [self._node_pid(n) for n in NODES] + [os.path.join(self.state, "slurmctld.pid"),
                                                         os.path.join(self.state, "munge", "munged.pid")]
        for pid_file in pid_files:
            _stop_pid_file(pid_file)
        shutil.rmtree(self.state, ignore_errors=True)


def _stop_pid_file(pid_file: str, timeout: float = 15) -> None:
    try:
        with open(pid_file) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
