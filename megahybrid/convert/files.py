"""Output directories written atomically, and safetensors weights (one file, or shards with an index) read and
written with one-line errors for damaged or missing files."""
import contextlib
import json
import os
import shutil

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megahybrid.errors import UserError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30


@contextlib.contextmanager
def staged_output(out_dir: str, force: bool):
    """Yield a temporary sibling of `out_dir` to write into; it replaces `out_dir` only when the block succeeds,
    so a failed conversion leaves nothing behind (and an existing output untouched)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not force:
        raise UserError(f"--output {out_dir} already exists; pass --force to replace it or choose another directory")
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, size = [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_weights(tensors: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  metadata: dict | None = None) -> list[str]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` + the index json above `max_shard_bytes`."""
    shards = _shards({k: v.contiguous() for k, v in tensors.items()}, max_shard_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                for i in range(len(shards))]
    for name, shard in tqdm(list(zip(names, shards)), desc="writing weights", disable=len(shards) == 1):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt", **(metadata or {})})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump(index, f, indent=1)
    return names


def has_weights(path: str) -> bool:
    return os.path.isfile(os.path.join(path, WEIGHTS)) or os.path.isfile(os.path.join(path, INDEX))


def _weight_files(path: str) -> list[str]:
    index_path = os.path.join(path, INDEX)
    if not os.path.isfile(index_path):
        return [WEIGHTS]
    try:
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{index_path} is not a valid safetensors index ({err}); export the weights again") from None
    missing = [n for n in files if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise UserError(f"{path}: shard {missing[0]} named in {INDEX} is missing; copy it there or export again")
    return files


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors weights in `path` (one file or an index with shards), on the CPU."""
    out = {}
    files = _weight_files(path)
    for name in tqdm(files, desc="reading weights", disable=len(files) == 1):
        full = os.path.join(path, name)
        try:
            with safe_open(full, framework="pt") as f:
                out.update({key: f.get_tensor(key) for key in f.keys()})
        except (SafetensorError, OSError) as err:
            raise UserError(f"{full} is not a readable safetensors file ({str(err).splitlines()[0]}): it is "
                            "truncated or damaged; export it again") from None
    return out
