"""One training checkpoint's DeepSpeed files -> full-precision tensors of each TP rank's shard: the fp32 master
weights and, for a resume at another layout, Adam's moments and step counter.

The ZeRO partitions (stage 1/2: flat fp32 groups per data-parallel rank; stage 3: flat partitions of every
parameter) are stitched together by DeepSpeed's own zero_to_fp32 merge functions (Adam's moments have the masters'
flat layout, so the same merge serves them); only the file reading is ours, so that every file goes through
`torch.load(weights_only=True)` with a four-class allow-list.
"""
import contextlib
import glob
import io
import os
import pickle
import re

import torch

from megahybrid.errors import UserError
from megahybrid.train.checkpoint import deepspeed_globals


def load_pt(path: str):
    """torch.load(weights_only=True) on the CPU; a damaged file or a foreign Python object is a one-line error."""
    try:
        with torch.serialization.safe_globals(deepspeed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path} refers to Python objects a checkpoint may not contain; it was not loaded: use a "
                        "checkpoint from a trusted run") from None
    except (RuntimeError, EOFError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"{path} cannot be read ({reason}): the checkpoint is damaged; use another one") from None


def _rank_files(step_dir: str, kind: str, tp_rank: int) -> list[str]:
    """This TP rank's `kind` ("model" or "optim") files, in data-parallel rank order."""
    files = glob.glob(os.path.join(step_dir, f"*mp_rank_{tp_rank:02d}_{kind}_states.pt"))
    dp_rank = lambda f: int(m.group(1)) if (m := re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f))) else 0
    return sorted(files, key=dp_rank)


def tp_size(step_dir: str) -> int:
    ranks = {int(m.group(1)) for f in os.listdir(step_dir) if (m := re.search(r"mp_rank_(\d+)_model_states\.pt$", f))}
    if not ranks or ranks != set(range(len(ranks))):
        raise UserError(f"{step_dir} holds no complete set of DeepSpeed model files (mp_rank_*_model_states.pt): "
                        "not a training checkpoint, or a shard is missing")
    return len(ranks)


def _model_state(path: str):
    from deepspeed.utils import zero_to_fp32 as z  # DeepSpeed takes seconds to import: only when reading ZeRO files

    sd = load_pt(path)
    if "param_shapes" not in sd:
        raise UserError(f"{path} is not a DeepSpeed model-state file (no param_shapes)")
    buffers = {k: v.float() if v.is_floating_point() else v for k, v in sd["module"].items() if k in sd["buffer_names"]}
    return z.zero_model_state(buffers=buffers, param_shapes=sd["param_shapes"],
                              shared_params=list(map(list, sd["shared_params"].items())),
                              ds_version=sd.get("ds_version"), frozen_param_shapes=sd.get("frozen_param_shapes"),
                              frozen_param_fragments=sd.get("frozen_param_fragments"))


def _optim_state(path: str) -> dict:
    state = load_pt(path).get("optimizer_state_dict", {})
    if "zero_stage" not in state:
        raise UserError(f"{path} is not a DeepSpeed ZeRO optimizer file (no zero_stage)")
    return {**state, "path": path}


def _adam_state(optim: dict) -> dict:
    """The inner optimizer's state of one ZeRO file: flat group index -> step, exp_avg, exp_avg_sq."""
    inner = optim.get("base_optimizer_state" if int(optim["zero_stage"]) <= 2 else "optimizer_state_dict")
    return inner.get("state", {}) if isinstance(inner, dict) else {}


def _flat_groups(optim: dict, stage: int, key: str) -> list[torch.Tensor]:
    """One rank's flat partitions of `key` ("fp32" masters, or an Adam state such as "exp_avg"), one per
    parameter group (ZeRO 1/2) or sub-group (ZeRO 3): the inner optimizer's state i belongs to flat group i."""
    masters = optim["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"]
    if key == "fp32":
        return masters
    state = _adam_state(optim)
    if any(key not in state.get(i, {}) for i in range(len(masters))):
        raise UserError(f"{optim['path']} holds no Adam {key} for every parameter group (no step taken, or an "
                        "elastic or damaged ZeRO file): resume at the saving layout, or pass "
                        "checkpoint.load_optimizer=false")
    return [state[i][key] for i in range(len(masters))]


def adam_step(step_dir: str) -> int:
    """Adam's step counter (optimizer steps taken, skipped ones excluded) saved with the checkpoint; 0 before any."""
    state = _adam_state(_optim_state(_rank_files(step_dir, "optim", 0)[0])).get(0, {})
    return int(state["step"]) if "step" in state else 0


def saved_zero_stage(step_dir: str) -> int:
    files = _rank_files(step_dir, "optim", 0)
    if not files:
        raise UserError(f"{step_dir}: no ZeRO optimizer file for TP rank 0: a shard is missing")
    return int(_optim_state(files[0])["zero_stage"])


def rank_states(step_dir: str, tp_rank: int, keys=("fp32",)) -> dict[str, dict[str, torch.Tensor]]:
    """Per key ("fp32" master weights, "exp_avg", "exp_avg_sq"): the full-precision tensors of TP rank
    `tp_rank`, ZeRO partitions merged, keyed by parameter name."""
    from deepspeed.utils import zero_to_fp32 as z  # see _model_state

    model_states = [_model_state(f) for f in _rank_files(step_dir, "model", tp_rank)]
    optim = [_optim_state(f) for f in _rank_files(step_dir, "optim", tp_rank)]
    if not optim:
        raise UserError(f"{step_dir}: no ZeRO optimizer file for TP rank {tp_rank}: a shard is missing")
    stage, world = int(optim[0]["zero_stage"]), optim[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim) or (stage == 3 and world != len(model_states)):
        raise UserError(f"{step_dir}: TP rank {tp_rank} was saved by {world} data-parallel ranks but "
                        f"{len(optim)} optimizer files are present: a shard is missing")
    out = {}
    # The merge functions print progress lines and bars (every rank, when a resume reshards).
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for key in keys:
            flat = [_flat_groups(o, stage, key) for o in optim]
            if stage <= 2:
                merged = z._get_fp32_state_dict_from_zero2_checkpoint(world, flat, model_states, False,
                                                                      optim[0].get("param_alignment_paddings"))
            else:
                merged = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat, model_states, False)
            out[key] = z.to_torch_tensor(merged)
    return out

