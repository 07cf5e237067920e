"""Issue 21: hostile or careless inputs to `megahybrid train` and the data tools get a one-line error or a safe
outcome. The checks that end before (or soon after) the first step run in ONE subprocess that calls the CLI's
`main` once per case (one import of torch/DeepSpeed for all); the signal checks need their own processes."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.test_train_resume import REPO, _args, _env, _wait_for_step, finish, launch, losses
from tests.utils import requires_gpu

MODEL_FILE = "mp_rank_00_model_states.pt"


class _Payload:
    """A pickle that runs a shell command when unpickled with weights_only=False."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(step_dir, rel, marker) -> None:
    """Replace a checkpoint file by a malicious pickle and re-sign the manifest, as an attacker would."""
    import hashlib

    import torch

    path = os.path.join(step_dir, rel)
    torch.save({"module": _Payload(marker)}, path)
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    with open(path, "rb") as f:
        manifest["files"][rel] = {"size": os.path.getsize(path), "sha256": hashlib.sha256(f.read()).hexdigest()}
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def _copy(root, name) -> str:
    dst = os.path.join(root, name)
    shutil.copytree(os.path.join(root, "trained"), dst)
    return dst


def _ckpt(run_dir, tag="step_00000002") -> str:
    return os.path.join(run_dir, "checkpoints", tag)


def _snapshot(run_dir) -> dict:
    """Every file under checkpoints/ with its bytes' hash: proves a run left them alone."""
    import hashlib

    out = {}
    for base, _, files in os.walk(os.path.join(run_dir, "checkpoints")):
        for name in files:
            with open(os.path.join(base, name), "rb") as f:
                out[os.path.relpath(os.path.join(base, name), run_dir)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _main(argv, fsize=None) -> dict:
    """megahybrid's CLI in this process; returns exit code and output (a file-size limit simulates a full disk)."""
    import contextlib
    import io
    import resource

    from megahybrid.cli import main

    out, err = io.StringIO(), io.StringIO()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if fsize:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, limits[1]))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _cases(root: str, data_dir: str) -> dict:
    """Runs in the subprocess: a 2-step run with a checkpoint, then each hostile case on a copy of it."""
    from megahybrid.train.rundir import RunDirLock

    def args(run_dir, steps, *extra):
        return _args(run_dir, data_dir, steps, "checkpoint.interval=2", "data.split=100,0,0", *extra)

    trained = os.path.join(root, "trained")
    results = {"trained": _main(args(trained, 2))}
    code = _copy(root, "code")
    _plant(_ckpt(code), MODEL_FILE, os.path.join(root, "pwned-model"))
    results["code"] = _main(args(code, 4))
    rng = _copy(root, "rng")
    _plant(_ckpt(rng), "rng/rank_00000.pt", os.path.join(root, "pwned-rng"))
    results["rng"] = _main(args(rng, 4))
    unusable = _copy(root, "unusable")
    os.remove(os.path.join(_ckpt(unusable), "manifest.json"))
    results["unusable_before"] = _snapshot(unusable)
    results["unusable"] = _main(args(unusable, 4))
    results["unusable_after"] = _snapshot(unusable)
    results["arch"] = _main(args(_copy(root, "arch"), 4, "model.hidden_size=128", "model.num_layers=4"))
    locked = _copy(root, "locked")
    lock = RunDirLock(locked)
    lock.acquire()
    results["locked"] = _main(args(locked, 4))
    lock.release()
    results["locked_released"] = _main(args(locked, 3))
    results["proc"] = _main(args(os.path.join(root, "proc"), 4, "checkpoint.dir=/proc/ckpt"))
    open(os.path.join(root, "a_file"), "w").close()
    results["file_run_dir"] = _main(args(os.path.join(root, "a_file"), 4))
    results["disk_full"] = _main(args(_copy(root, "disk_full"), 3), fsize=300_000)
    results["lr"] = _main(args(os.path.join(root, "lr"), 8, "optimizer.lr=1e4", "optimizer.min_lr=0",
                               "train.max_consecutive_nonfinite=2", "checkpoint.interval=100"))
    zero3 = os.path.join(root, "zero3")
    results["zero3"] = [_main(args(zero3, steps, "train.deepspeed_config=zero3")) for steps in (2, 3)]
    return results


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from megahybrid.data.builtin import prepare_builtin

    path = tmp_path_factory.mktemp("builtin")
    prepare_builtin(str(path), vocab_size=512, num_docs=2000)
    return str(path)


@pytest.fixture(scope="module")
def cases(data_dir, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cases"))
    # Another job holds the default-looking port: a one-rank run must not need it (issue case 10).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = _env({"MASTER_PORT": str(busy.getsockname()[1])})
        script = (f"import json, sys; from tests.test_reliability import _cases; "
                  f"json.dump(_cases({root!r}, {data_dir!r}), open({root!r} + '/results.json', 'w'))")
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(root, "results.json")) as f:
        return root, json.load(f)


def _error_line(result, code=2) -> str:
    """The run's exit code is `code` and its last stderr line is one `error: ...` line without a traceback."""
    assert result["code"] == code, (result["code"], result["stderr"][-3000:])
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    last = result["stderr"].strip().splitlines()[-1]
    assert last.startswith("error: "), result["stderr"][-3000:]
    return last


def test_trained_run_warns_once_about_empty_validation_and_needs_no_port(cases):
    _, results = cases
    result = results["trained"]
    assert result["code"] == 0, result["stderr"][-3000:]
    assert result["stderr"].count("warning: eval.iters=1 but the validation split is empty") == 1


@pytest.mark.parametrize("case,marker", [("code", "pwned-model"), ("rng", "pwned-rng")])
def test_checkpoint_that_runs_code_is_refused(cases, case, marker):
    root, results = cases
    line = _error_line(results[case])
    assert "refers to Python objects a checkpoint may not contain (posix.system)" in line, line
    assert not os.path.exists(os.path.join(root, marker)), "the pickle ran"


def test_all_checkpoints_unusable_stops_and_touches_nothing(cases):
    _, results = cases
    line = _error_line(results["unusable"])
    assert "holds checkpoints ['step_00000002'] and none can be loaded" in line and "--no-resume" in line, line
    assert results["unusable_after"] == results["unusable_before"]


def test_resume_with_another_architecture_names_the_fields(cases):
    _, results = cases
    line = _error_line(results["arch"])
    assert "model.hidden_size 64 -> 128" in line and "model.num_layers 2 -> 4" in line, line


def test_second_run_on_a_locked_run_dir_is_refused(cases):
    root, results = cases
    line = _error_line(results["locked"])
    assert f"run_dir={os.path.join(root, 'locked')} is in use by another run (pid" in line, line
    assert f"on host {socket.gethostname()}" in line
    assert results["locked_released"]["code"] == 0, results["locked_released"]["stderr"][-3000:]


def test_stale_lock_of_a_killed_run_is_taken_over(tmp_path):
    from megahybrid.train.rundir import RunDirLock

    holder = ("import os, sys; from megahybrid.train.rundir import RunDirLock; "
              f"RunDirLock({str(tmp_path)!r}).acquire(); os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", holder], env=_env(), cwd=REPO)
    assert proc.returncode == -signal.SIGKILL
    with open(tmp_path / ".megahybrid.lock") as f:
        assert json.load(f)["pid"] != os.getpid()
    lock = RunDirLock(str(tmp_path))
    lock.acquire()
    lock.release()


def test_lock_without_flock_decides_by_pid_and_host(tmp_path, monkeypatch):
    import errno
    import fcntl

    from megahybrid.errors import UserError
    from megahybrid.train.rundir import RunDirLock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"pid": int(dead.stdout), "host": socket.gethostname(), "since": 0}
    (tmp_path / ".megahybrid.lock").write_text(json.dumps(record))
    first = RunDirLock(str(tmp_path))
    first.acquire()  # the recorded pid is gone: stale
    with pytest.raises(UserError, match=f"in use by another run \\(pid {os.getpid()} on host"):
        RunDirLock(str(tmp_path)).acquire()
    first.release()


def test_unwritable_outputs_fail_before_the_first_step(cases):
    root, results = cases
    line = _error_line(results["proc"])
    assert "checkpoint.dir=/proc/ckpt is not a writable directory" in line, line
    assert not os.path.exists(os.path.join(root, "proc", "metrics.jsonl")), "it trained before failing"
    line = _error_line(results["file_run_dir"])
    assert f"run_dir={os.path.join(root, 'a_file')} is not a writable directory" in line, line


def test_full_disk_during_save_is_one_line_and_keeps_the_previous_checkpoint(cases):
    from megahybrid.train.checkpoint import CheckpointManager

    root, results = cases
    line = _error_line(results["disk_full"])
    assert "saving checkpoint step_00000003" in line and "step_00000002 and latest are intact" in line, line
    ckpts = os.path.join(root, "disk_full", "checkpoints")
    assert sorted(n for n in os.listdir(ckpts) if not n.startswith(".megahybrid")) == ["latest", "step_00000002"]
    assert CheckpointManager(ckpts, keep=2).find_loadable() == "step_00000002"


def test_nonfinite_grad_norm_counts_as_skipped_and_stops(cases):
    root, results = cases
    line = _error_line(results["lr"], code=4)
    assert "steps in a row had a non-finite loss or gradient norm" in line, line
    with open(os.path.join(root, "lr", "metrics.jsonl")) as f:
        records = [json.loads(r) for r in f if "train/grad_norm" in r]
    bad = [r["step"] for r in records if r["train/grad_norm"] in ("inf", "nan")]
    assert len(bad) == 2 and records[-1]["train/skipped_steps"] == 2, records


def test_safe_load_reads_every_file_of_a_real_checkpoint(cases):
    from megahybrid.train.checkpoint import safe_load

    root, _ = cases
    step = _ckpt(os.path.join(root, "trained"))
    names = [MODEL_FILE, "rng/rank_00000.pt"] + [n for n in os.listdir(step) if n.endswith("optim_states.pt")]
    for name in names:
        assert isinstance(safe_load(os.path.join(step, name)), dict), name


def test_zero3_checkpoint_resumes_through_the_safe_loader(cases):
    _, results = cases
    first, resumed = results["zero3"]
    assert first["code"] == 0 and resumed["code"] == 0, resumed["stderr"][-3000:]
    assert "step_00000002 at step 2" in resumed["stdout"]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_bf16_checkpoint_resumes_through_the_safe_loader_on_gpu(data_dir, tmp_path, stage):
    """bf16 ZeRO files may pickle other DeepSpeed classes than fp32 ones: the allow-list must cover them."""
    run_dir = str(tmp_path / stage)
    for steps in (2, 3):
        results = finish(launch(_args(run_dir, data_dir, steps, "checkpoint.interval=2",
                                      f"train.deepspeed_config={stage}")))
        code, stdout, stderr = results[0]
        assert code == 0, stderr[-3000:]
    assert "step_00000002 at step 2" in stdout


def _wait_for_handler(pid: int, sig: int, timeout: float = 60) -> None:
    """Until process `pid` catches `sig` (its SigCgt mask in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} installed no handler for signal {sig}")


def _ctrl_c_until_exit(proc, every: float = 0.2, timeout: float = 120) -> None:
    """Ctrl-C, then again every `every` s until the process ends. Two SIGINTs that arrive while the main thread is
    inside one long C call (a busy machine) run Python's handler once, so a single second press cannot be
    relied on to be seen as second; the step's 0.5 s sleep leaves time for a later one."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGINT)
        time.sleep(every)


def test_signals_ctrl_c_saves_second_aborts_early_sigterm_says_so(data_dir, tmp_path):
    runs = {name: str(tmp_path / name) for name in ("once", "twice", "early")}
    slow = ("debug.sleep_per_step=0.5", "checkpoint.interval=1000")
    procs = {name: launch(_args(path, data_dir, 200, *slow)) for name, path in runs.items()}
    _wait_for_handler(procs["early"][0].pid, signal.SIGTERM)  # installed first thing; torch is still importing
    procs["early"][0].send_signal(signal.SIGTERM)
    _wait_for_step(runs["once"], 2, procs["once"])
    procs["once"][0].send_signal(signal.SIGINT)
    _wait_for_step(runs["twice"], 2, procs["twice"])
    _ctrl_c_until_exit(procs["twice"][0])
    (once,), (twice,), (early,) = (finish(procs[name]) for name in ("once", "twice", "early"))
    assert once[0] == 3 and "received SIGINT: saved" in once[1] and "Traceback" not in once[2], once[2][-3000:]
    assert "received SIGINT: saving at the end of this step (Ctrl-C again aborts without saving)" in once[2]
    stopped = max(losses(runs["once"]))
    assert os.path.isdir(os.path.join(runs["once"], "checkpoints", f"step_{stopped:08d}"))
    assert twice[0] == 130 and "Traceback" not in twice[2], twice[2][-3000:]
    assert twice[2].strip().splitlines()[-1].startswith("error: second SIGINT: aborted without saving")
    assert early[0] == 3 and "Traceback" not in early[2], early[2][-3000:]
    assert "received SIGTERM during start-up, before the first step: nothing to save" in early[2]


def _prefix_copy(data_dir, tmp_path) -> str:
    prefix = str(tmp_path / "corpus")
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(os.path.join(data_dir, "builtin_text_document" + ext), prefix + ext)
    return prefix


def test_bin_shorter_than_its_idx_is_refused_at_start(data_dir, tmp_path):
    from megahybrid.data.config import DataConfig, DataError

    prefix = _prefix_copy(data_dir, tmp_path)
    size = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", size // 2)
    config = DataConfig(prefixes=[prefix], tokenizer_model=os.path.join(data_dir, "builtin-tokenizer.model"),
                        split="100,0,0", cache_dir=str(tmp_path / "idx"))
    with pytest.raises(DataError, match=f"corpus.bin has {size // 2} bytes but its .idx describes {size} "):
        config.validate(128, 512)


def test_bad_data_inputs_are_one_line(data_dir, tmp_path, capsys):
    from megahybrid.data import cli
    from megahybrid.data.config import DataConfig, DataError

    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(os.urandom(1000))
    config = DataConfig(prefixes=[_prefix_copy(data_dir, tmp_path)], tokenizer_model=str(garbage))
    with pytest.raises(DataError, match="garbage.model is not a SentencePiece model"):
        config.validate(128, 512)
    tokenizer = os.path.join(data_dir, "builtin-tokenizer.model")
    (tmp_path / "int.jsonl").write_text('{"text": "hello world"}\n{"text": 5}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n')
    (tmp_path / "ok.jsonl").write_text('{"text": "a b c"}\n')
    expected = {
        "int.jsonl": "record 2 has text=5 (int), not a string",
        "bad.jsonl": "bad.jsonl line 3 is not valid JSON",
        "ok.jsonl": "--output-prefix directory=/proc/x is not a writable directory",
    }
    for name, message in expected.items():
        out = "/proc/x/out" if name == "ok.jsonl" else str(tmp_path / "out")
        argv = ["preprocess", "--input", str(tmp_path / name), "--tokenizer", tokenizer, "--output-prefix", out,
                "--hf-cache", str(tmp_path / "hf")]
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and message in err[-1] and "Traceback" not in "".join(err), err
    argv = ["preprocess", "--input", str(tmp_path / "ok.jsonl"), "--tokenizer", str(garbage), "--output-prefix",
            str(tmp_path / "out")]
    assert cli.main(argv) == 2 and "is not a SentencePiece model" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [
    ('[{"zero_optimization": {"stage": 1}}]', "holds a JSON list, not an object"),
    ('{"zero_optimization": {"stage": 1}, "checkpoint": {"writer": {"type": "fast"}}}', "another checkpoint engine"),
    ('{"zero_optimization": {"stage": 1}, "checkpoint": {"load_universal": true}}', "another checkpoint engine"),
])
def test_deepspeed_json_that_is_not_ours_to_load(tmp_path, text, message):
    from megahybrid.errors import ConfigError
    from megahybrid.train.config import load_deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_deepspeed_config(str(path))


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) of the sockets listening on `port`."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {row[1].split(":")[0] for row in rows if row[3] == "0A" and int(row[1].split(":")[1], 16) == port}


def test_one_node_rendezvous_is_loopback_only(monkeypatch):
    import datetime
    import threading

    import torch.distributed as dist

    from megahybrid.distributed import _loopback_store
    from megahybrid.errors import UserError
    from tests.dist import free_port

    port = free_port()
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
                       "NCCL_SOCKET_IFNAME": "lo"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    timeout = datetime.timedelta(seconds=60)
    assert isinstance(_loopback_store(0, 1, timeout), dist.HashStore)  # one rank: no socket, no port
    stores = {}
    master = threading.Thread(target=lambda: stores.update(master=_loopback_store(0, 2, timeout)))
    master.start()
    time.sleep(0.5)
    stores["worker"] = _loopback_store(1, 2, timeout)
    master.join(60)
    stores["worker"].set("k", "v")
    assert stores["master"].get("k") == b"v"
    assert _listening_addresses(port) == {"0100007F"}, "the store listens beyond 127.0.0.1"
    with pytest.raises(UserError, match=f"MASTER_PORT={port} on 127.0.0.1 is taken"):
        _loopback_store(0, 2, timeout)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert _loopback_store(0, 2, timeout) is None  # several nodes: torch's env:// rendezvous (README)
