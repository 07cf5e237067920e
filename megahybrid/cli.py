"""The `megahybrid` command: `megahybrid train --config NAME_OR_PATH [key=value ...]`, `megahybrid data ...`,
`megahybrid convert ...`, `megahybrid slurm submit ...`, `megahybrid eval ppl|recall|harness ...` and
`megahybrid generate ...`.

User errors (config, data, launch environment, checkpoints) print one line `error: ...` to stderr and exit with
code 2, without a traceback. Training exit codes are listed in megahybrid/train/trainer.py.
"""
import argparse
import os
import shutil
import subprocess
import sys

EXIT_USER_ERROR = 2


def _add_train_command(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a model from a run config (alone, torchrun, srun or mpirun)")
    train.add_argument("--config", required=True, help="a YAML file, or a shipped config name: demo, 125m, 350m, 1.3b")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.steps=200 model.pattern=S")
    train.add_argument("--no-resume", action="store_true", help="start fresh even if checkpoints exist (refused "
                       "when checkpoint.dir already holds some)")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="megahybrid", description=__doc__.splitlines()[0])
    subparsers = top.add_subparsers(dest="command", required=True)
    _add_train_command(subparsers)
    from megahybrid.data.cli import add_data_commands

    add_data_commands(subparsers)
    from megahybrid.convert.cli import add_convert_command

    add_convert_command(subparsers)
    from megahybrid.slurm import add_slurm_commands

    add_slurm_commands(subparsers)
    from megahybrid.eval.cli import add_eval_commands, add_generate_command

    add_eval_commands(subparsers)
    add_generate_command(subparsers)
    return top


def prepare_launch_env() -> None:
    """Ranks from torchrun / srun / mpirun into RANK, WORLD_SIZE, LOCAL_RANK, and a MASTER_ADDR that is not the
    machine's public address, before torch.distributed or DeepSpeed read the environment."""
    from megahybrid.distributed import resolve_launch_env
    from megahybrid.errors import UserError

    if "MASTER_ADDR" not in os.environ and "RANK" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if nodelist and int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1"))) > 1:
            os.environ["MASTER_ADDR"] = _first_slurm_host(nodelist)
        if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
            _mpi_rendezvous_env()
    resolve_launch_env()


def _mpi_rendezvous_env() -> None:
    """MASTER_ADDR/PORT for mpirun from mpi4py; without it only a one-node launch can default to 127.0.0.1."""
    from megahybrid.errors import UserError
    from megahybrid.mpi import mpi_rendezvous

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
    from megahybrid.errors import UserError

    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    raise UserError(f"cannot expand SLURM_JOB_NODELIST={nodelist}: export MASTER_ADDR=<first node's address>")


def run_train(args) -> int:
    from megahybrid.train.config import load_config

    cfg = load_config(args.config, args.overrides)
    from megahybrid.mpi import check_config_agreement

    check_config_agreement(cfg.to_dict())
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.print_config:
        from megahybrid.train.config import validate

        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), _has_gpu(), check_data=False)
        print(cfg.to_yaml(), end="")
        return 0
    from megahybrid.train.trainer import train

    return train(cfg, resume=not args.no_resume)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    from megahybrid.errors import UserError
    from megahybrid.slurm import record_exit_code
    from megahybrid.train.signals import Interrupted, install_stop_handlers

    args = parser().parse_args(argv)
    if args.command == "data":
        from megahybrid.data.cli import run

        return run(args)
    try:
        if args.command == "convert":
            from megahybrid.convert.cli import run

            return run(args)
        if args.command == "slurm":
            from megahybrid.slurm import run

            return run(args)
        if args.command in ("eval", "generate"):
            from megahybrid.eval.cli import run

            return run(args)
        # Before torch is imported: a SIGTERM or Ctrl-C in the first seconds gets a message and an exit code too.
        install_stop_handlers()
        prepare_launch_env()
        code = run_train(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        code = EXIT_USER_ERROR
    except Interrupted as stop:
        print(stop.message(), file=sys.stderr, flush=True)
        code = stop.exit_code
    record_exit_code(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
