"""`megahybrid convert --checkpoint PATH --to consolidated|hf --output DIR [--dtype fp32|bf16] [--force]`."""
import re

from megahybrid.errors import UserError


def add_convert_command(subparsers) -> None:
    convert = subparsers.add_parser(
        "convert", help="a training checkpoint (any tp/dp/ZeRO), consolidated or Hugging Face directory -> "
                        "consolidated full-tensor weights or a Hugging Face export")
    convert.add_argument("--checkpoint", required=True, help="a step directory, a checkpoint directory (its "
                         "latest), a consolidated or a Hugging Face directory (detected)")
    convert.add_argument("--to", required=True, choices=("consolidated", "hf"))
    convert.add_argument("--output", required=True, help="the directory to create (written atomically)")
    convert.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    convert.add_argument("--max-shard-size", default="5GB", help="split the weights into shards above this size")
    convert.add_argument("--force", action="store_true", help="replace --output if it exists")


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise UserError(f"--max-shard-size {text!r}: write a size such as 5GB, 500MB or 1000000")
    unit = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[(match.group(2) or "").upper()]
    return int(float(match.group(1)) * unit)


def run(args) -> int:
    from megahybrid.convert.api import convert  # torch: not at CLI start

    out = convert(args.checkpoint, args.to, args.output, args.dtype, args.force, parse_size(args.max_shard_size))
    print(f"wrote {args.to} weights ({args.dtype}) to {out}", flush=True)
    return 0
