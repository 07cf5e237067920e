"""Resume a training checkpoint at another layout (tp, cp, dp or ZeRO stage) with its optimizer state.

Our own mapping rather than DeepSpeed's universal checkpoint: ds_to_universal needs per-parameter TP patterns
(`universal_checkpoint_info`) our model does not declare, and DeepSpeed's universal loader reads its files with
`weights_only=False`. Here the saved fp32 master weights and both Adam moments are merged into full tensors
under our parameter names (zero.rank_states applies DeepSpeed's own zero_to_fp32 merge to each flat state;
sources merges the TP shards by partition tags), cut to this rank's TP piece (init.local_shard) and written into
the new engine's ZeRO partitions. Adam's step counter is the saved one, so bias correction continues; step, data
position and LR schedule come from trainer_state.json as for any resume. Per-rank RNG states are not carried
(the ranks differ); the model has no dropout, so training does not depend on them.
"""
import torch

from megahybrid.convert import sources
from megahybrid.convert.init import local_shard
from megahybrid.convert.local import partition_tags
from megahybrid.convert.zero import adam_step

MOMENTS = ("exp_avg", "exp_avg_sq")


def _flat_partitions(zero) -> list[tuple[torch.Tensor, dict]]:
    """(flat fp32 partition, its parameter group) of every ZeRO 1/2 group or ZeRO-3 sub-group of this rank."""
    groups = zero.optimizer.param_groups
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        flats = zero.fp32_partitioned_groups_flat
        return [(flat, groups[zero.sub_group_to_group_id[i]]) for i, flat in enumerate(flats)]
    return [(flat, groups[i]) for i, flat in enumerate(zero.single_partition_of_fp32_groups)]


def _init_adam_state(zero, step: int) -> None:
    """Adam's state of every flat partition, which torch would create at the first step: the saved step counter
    (on the device only where fused or capturable AdamW wants it, as torch does) and moments to be written."""
    for flat, group in _flat_partitions(zero):
        device = flat.device if group.get("fused") or group.get("capturable") else "cpu"
        zero.optimizer.state[flat] = {"step": torch.tensor(float(step), device=device),
                                      "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._lazy_init_hp_params_optimizer_state()  # ZeRO 1/2: each parameter's fragment views the new state


def _set_partition(zero, param, value: torch.Tensor, key: str | None) -> None:
    """This rank's part of `param`'s fp32 master (key None) or Adam state `key`, from the TP-local `value`."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if not hasattr(param, "ds_id"):
        if key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, key)
        return
    # ZeRO-3: DeepSpeed's setter reads past the end for the padded last partition, so the copy stops at the end.
    part, _ = zero._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    start = part.numel() * zero._get_param_partition_rank(param)
    piece = value.flatten()[start:start + part.numel()]
    part.narrow(0, 0, piece.numel()).copy_(piece)


@torch.no_grad()
def load_resharded(engine, step_dir: str, with_optimizer: bool = True) -> int:
    """Weights and fp32 masters of `step_dir`, and with `with_optimizer` Adam's moments and step, into `engine`
    at its own layout. Returns Adam's step (0 without the optimizer: moments start at zero)."""
    import deepspeed  # seconds to import: only when an engine exists

    model, mpu = engine.module, engine.mpu
    tp_rank, tp_world = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    tags = partition_tags(model)
    keys = ("fp32", *MOMENTS) if with_optimizer else ("fp32",)
    _, full = sources.read_checkpoint_states(step_dir, tags, keys)
    step = adam_step(step_dir) if with_optimizer else 0
    if with_optimizer:
        _init_adam_state(engine.optimizer, step)
    for name, param in model.named_parameters():
        local = {key: local_shard(full[key].get(name), param, tags[name], tp_rank, tp_world,
                                  f"checkpoint {step_dir}: {key} of {name}") for key in keys}
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.copy_(local["fp32"])
        for key, value in local.items():
            _set_partition(engine.optimizer, param, value, None if key == "fp32" else key)
    return step
