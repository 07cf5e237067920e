"""DeepSpeed engine setup: the `mpu` adapter over our process groups, the DeepSpeed config filled from our run
config, AdamW with a skippable step, and the warmup + decay learning-rate schedule.
"""
import copy
import math

import torch
import torch.distributed as dist

from megahybrid.distributed import Groups
from megahybrid.train.checkpoint import safe_checkpoint_engine
from megahybrid.train.config import zero_offload, zero_stage


class MegatronMPU:
    """The `mpu` interface DeepSpeed queries, answered from a `Groups` (megatron's tp/cp/dp groups).

    DeepSpeed's "data parallel" group is our dp x cp group: gradients are averaged over both, as in megatron.
    Its "sequence parallel" means Ulysses, which we do not use, so it reports size 1.
    """

    def __init__(self, groups: Groups):
        self.groups = groups

    def get_model_parallel_group(self):
        return self.groups.tp_group

    def get_model_parallel_rank(self):
        return self.groups.tp_rank

    def get_model_parallel_world_size(self):
        return self.groups.layout.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return dist.get_global_rank(self.groups.tp_group, 0)

    def get_data_parallel_group(self):
        return self.groups.dp_cp_group

    def get_data_parallel_rank(self):
        return dist.get_rank(self.groups.dp_cp_group)

    def get_data_parallel_world_size(self):
        return self.groups.layout.dp * self.groups.layout.cp

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0

    def get_sequence_parallel_world_size(self):
        return 1

    def get_sequence_parallel_rank(self):
        return 0


def deepspeed_config(base: dict, cfg, layout, precision: str) -> dict:
    """Our batch sizes, accumulation, clipping and precision filled into the DeepSpeed JSON (which may not set them)."""
    ds = copy.deepcopy(base)
    micro = cfg.batch.micro_batch_size
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = cfg.batch.global_batch_size // (micro * layout.dp)
    ds["gradient_clipping"] = float(cfg.optimizer.grad_clip)
    ds["bf16"] = {"enabled": precision == "bf16"}
    ds["steps_per_print"] = 2**31 - 1
    ds["wall_clock_breakdown"] = False
    # Our AdamW subclass (for the skippable step) is torch's AdamW, which DeepSpeed only knows by class name.
    ds["zero_allow_untested_optimizer"] = True
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("offload_optimizer", {}).get("device", "none") != "none":
        # The client AdamW below runs on the offloaded fp32 partitions; DeepSpeed asks for its CPU Adam otherwise.
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds


class SkippableAdamW(torch.optim.AdamW):
    """torch AdamW whose steps can be cancelled. ZeRO reduces, (clips) and then calls this step on its fp32
    partitions (once per param group). Two ways to cancel, weights and moments untouched either way:
    - `skipping`, a host flag the trainer sets around one optimizer step;
    - on the device, without a host read (`device_clip`, ZeRO-1/2 with the fused step): the step itself clips
      by the global norm ZeRO computed, as ZeRO would, and hands the fused kernel `found_inf` (the trainer's
      `skip_flag` or a non-finite norm), which makes it leave everything as it was. ZeRO's own clipping reads
      the norm on the host once per param group, and each read idles the GPU while the host catches up
      (tools/results/bench_train-profile.md)."""

    skipping = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_clip = None  # (max_norm, norm_fn): clip and skip here, norm_fn() the global norm (a tensor)
        self.skip_flag = None  # a bool tensor on the device for the next step: true cancels it

    def step(self, closure=None):
        if self.skipping:
            return None
        if self.device_clip is None:
            return super().step(closure)
        max_norm, norm_fn = self.device_clip
        norm = norm_fn()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if max_norm > 0 and grads:
            # ZeRO's formula: grad / max(1, (norm + 1e-6) / max_norm)
            torch._foreach_div_(grads, torch.clamp((norm + 1e-6) / max_norm, min=1.0))
        bad = ~torch.isfinite(norm)
        if self.skip_flag is not None:
            bad = bad | self.skip_flag
        self.found_inf = bad.float()
        try:
            return super().step(closure)
        finally:
            self.found_inf = None


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms (1-D) get none. Parameters a mixer tags with `lr_cap` (the SSM parameters and
    input norms of the Interdomain family) get their own group per cap: no weight decay, lr <= cap (set_lr)."""
    decay, no_decay, capped = [], [], {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        cap = getattr(param, "lr_cap", None)
        if cap is not None:
            capped.setdefault(cap, []).append(param)
        else:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups += [{"params": ps, "weight_decay": 0.0, "lr_cap": cap} for cap, ps in capped.items()]
    return [piece for group in groups for piece in _aligned_groups(group)]


# 16 bytes of bf16: the vector width inductor's kernels load parameters with.
ALIGN_ELEMENTS = 8


def _aligned_groups(group: dict) -> list[dict]:
    """`group` with every parameter at a 16-byte aligned address once DeepSpeed flattens it. ZeRO flattens a
    group into one buffer and makes each parameter a view into it, so one parameter of a size that is not a
    multiple of 16 bytes (Gated DeltaNet's A_log and dt_bias, Interdomain's log_dt: a value per head) shifts
    every later one off; compiled kernels read parameters with 16-byte loads and fault with "misaligned address"
    on the H200 (issue #15, tools/compile_bisect.py). Such parameters get groups of their own, same settings."""
    odd = [p for p in group["params"] if p.numel() % ALIGN_ELEMENTS]
    even = [p for p in group["params"] if not p.numel() % ALIGN_ELEMENTS]
    return [{**group, "params": ps} for ps in ([even] if even else []) + [[p] for p in odd]]


class LRSchedule:
    """Linear warmup to `lr`, then cosine / linear decay to `min_lr` at `total_steps` (or constant).
    A function of the step: resuming needs the step counter and these numbers (saved in trainer_state.json)."""

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, total_steps: int, kind: str = "cosine"):
        self.lr, self.min_lr, self.warmup, self.total, self.kind = lr, min_lr, warmup_steps, total_steps, kind

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1 - progress
        return self.min_lr + (self.lr - self.min_lr) * shape

    def state_dict(self) -> dict:
        return dict(lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup, total_steps=self.total, kind=self.kind)

    @classmethod
    def from_state(cls, state: dict) -> "LRSchedule":
        return cls(**state)

    def describe(self) -> str:
        if self.kind == "constant":
            return f"constant {self.lr:.3g} after {self.warmup} warmup steps"
        return f"{self.kind} {self.lr:.3g} -> {self.min_lr:.3g} at step {self.total}, {self.warmup} warmup steps"


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = min(lr, group.get("lr_cap", lr))


def build_engine(model, cfg, groups: Groups, ds_base: dict, precision: str):
    """(engine, client optimizer, DeepSpeed config) from DeepSpeed with our optimizer and mpu."""
    import deepspeed  # seconds to import: only when an engine is built (config checks and tests of parts skip it)

    o = cfg.optimizer
    optimizer = SkippableAdamW(
        param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    ds = deepspeed_config(ds_base, cfg, groups.layout, precision)
    device_clip = clips_on_device(ds, cfg)
    if device_clip:
        ds["gradient_clipping"] = 0.0  # the optimizer clips (SkippableAdamW.device_clip)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, mpu=MegatronMPU(groups))
    if device_clip:
        optimizer.device_clip = (float(o.grad_clip), lambda: engine.optimizer._global_grad_norm)
    # DeepSpeed's own engine unpickles with weights_only=False; ours refuses files that name Python objects.
    engine.checkpoint_engine = safe_checkpoint_engine(engine._config)
    return engine, optimizer, ds


def clips_on_device(ds: dict, cfg) -> bool:
    """Whether the optimizer step clips and skips on the device (optimizer.clip_on_device): ZeRO-1/2 without
    offload, whose step computes the global norm as a tensor before it calls ours (unless told not to). ZeRO-3
    reads its norm on the host in any case, and an offloaded step runs on CPU tensors: both keep ZeRO's clipping."""
    return (cfg.optimizer.clip_on_device and zero_stage(ds) in (1, 2) and not zero_offload(ds)
            and ds.get("zero_optimization", {}).get("compute_grad_norm", True))
