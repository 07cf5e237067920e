"""The `megahybrid` command: `megahybrid train --config NAME_OR_PATH [key=value ...]`, `megahybrid data ...`,
`megahybrid convert ...`, `megahybrid slurm submit ...`, `megahybrid eval ppl|recall|harness ...` and
`megahybrid generate ...`.

User errors (config, data, launch environment, checkpoints) print one line `error: ...` to stderr and exit with
code 2, without a traceback. Training exit codes are listed in megahybrid/train/trainer.py.
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from megahybrid import __version__, slurm
from megahybrid.convert import cli as convert_cli
from megahybrid.data import cli as data_cli
from megahybrid.errors import EXIT_USER_ERROR, ConfigError, UserError
from megahybrid.eval import cli as eval_cli
from megahybrid.mpi import check_config_agreement, mpi_rendezvous
from megahybrid.train.signals import Interrupted, install_stop_handlers


def _add_train_command(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a model from a run config (alone, torchrun, srun or mpirun)")
    train.add_argument("--config", required=True, help="a YAML file, or a shipped config name: demo, 125m, 350m, 1.3b")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.steps=200 model.pattern=S")
    train.add_argument("--no-resume", action="store_true", help="do not resume: start from step 0 (refused when "
                       "checkpoint.dir already holds checkpoints; give another run_dir)")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--nproc-per-node", type=int, metavar="N", help="start N local ranks (torchrun) after "
                       "validating the config once here; exits with the first failed rank's code")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="megahybrid", description=__doc__.splitlines()[0])
    top.add_argument("--version", action="version", version=f"megahybrid {__version__}")
    subparsers = top.add_subparsers(dest="command", required=True)
    _add_train_command(subparsers)
    data_cli.add_data_commands(subparsers)
    convert_cli.add_convert_command(subparsers)
    slurm.add_slurm_commands(subparsers)
    eval_cli.add_eval_commands(subparsers)
    eval_cli.add_generate_command(subparsers)
    return top


def prepare_launch_env() -> None:
    """Ranks from torchrun / srun / mpirun into RANK, WORLD_SIZE, LOCAL_RANK, and a MASTER_ADDR that is not the
    machine's public address, before torch.distributed or DeepSpeed read the environment."""
    from megahybrid.distributed import resolve_launch_env  # imports torch: only a training launch needs it

    if "MASTER_ADDR" not in os.environ and "RANK" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if nodelist and int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1"))) > 1:
            os.environ["MASTER_ADDR"] = _first_slurm_host(nodelist)
        if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
            _mpi_rendezvous_env()
    resolve_launch_env()


def _mpi_rendezvous_env() -> None:
    """MASTER_ADDR/PORT for mpirun from mpi4py; without it only a one-node launch can default to 127.0.0.1."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    agreed = mpi_rendezvous(int(size))
    if agreed is not None:
        os.environ["MASTER_ADDR"] = agreed[0]
        os.environ.setdefault("MASTER_PORT", agreed[1])
        return
    if size and size != os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size):
        raise UserError("mpirun across several nodes: install mpi4py (pip install 'megahybrid[mpi]') or export "
                        "MASTER_ADDR=<first node's address> (and MASTER_PORT)")


def _first_slurm_host(nodelist: str) -> str:
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    raise UserError(f"cannot expand SLURM_JOB_NODELIST={nodelist}: export MASTER_ADDR=<first node's address>")


def run_train(args) -> int:
    # train.config pulls in numpy and sentencepiece, trainer torch, megatron and DeepSpeed: not at CLI start.
    from megahybrid.train.config import load_config, validate

    cfg = load_config(args.config, args.overrides)
    check_config_agreement(cfg.to_dict())
    if args.print_config:
        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), _has_gpu(), check_data=False)
        print(cfg.to_yaml(), end="")
        return 0
    from megahybrid.train.trainer import train

    return train(cfg, resume=not args.no_resume)


def launch_local(args, argv: list[str]) -> int:
    """Validate for N ranks in this process (a config error is one line here, not one per rank plus torchrun's
    report), then run torchrun's launcher in-process and return the first failed rank's exit code."""
    # torch and the run config are loaded here, not at CLI start (see run_train).
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from megahybrid.train.config import load_config, validate

    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} must be >= 1")
    validate(load_config(args.config, args.overrides), args.nproc_per_node, _has_gpu())
    launcher = get_args_parser().parse_args([
        f"--nproc-per-node={args.nproc_per_node}", "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
        "-m", "megahybrid", *_without_nproc(argv)])
    try:
        torchrun(launcher)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode != EXIT_USER_ERROR:  # a user error printed its own line
            print(f"error: rank {rank} exited with code {failure.exitcode}; its output is above", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc-per-node":
            skip = True
        elif not item.startswith("--nproc-per-node="):
            out.append(item)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_torch_extensions_dir() -> str:
    """Where DeepSpeed caches the ops it compiles (its CPU op: ~26 s to build): `.cache/torch_extensions` of a
    source checkout (as the Makefile sets), else the user's cache directory."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and os.access(root, os.W_OK):
        return str(root / ".cache" / "torch_extensions")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "megahybrid", "torch_extensions")


def _has_gpu() -> bool:
    import torch  # not at CLI start: --help and the data commands do not need it

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_torch_extensions_dir())
    if args.command == "data":
        return data_cli.run(args)
    try:
        if args.command == "convert":
            return convert_cli.run(args)
        if args.command == "slurm":
            return slurm.run(args)
        if args.command in ("eval", "generate"):
            return eval_cli.run(args)
        if args.nproc_per_node is not None:
            return launch_local(args, argv)
        # Before torch is imported: a SIGTERM or Ctrl-C in the first seconds gets a message and an exit code too.
        install_stop_handlers()
        prepare_launch_env()
        code = run_train(args)
    except UserError as err:
        # Every rank validates the same config: one copy of a config error is enough. One write per message:
        # under mpirun two ranks' separate text and newline writes can interleave into one line.
        if not isinstance(err, ConfigError) or os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {err}\n")
            sys.stderr.flush()
        code = EXIT_USER_ERROR
    except Interrupted as stop:
        print(stop.message(), file=sys.stderr, flush=True)
        code = stop.exit_code
    slurm.record_exit_code(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
