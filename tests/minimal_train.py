"""A minimal training loop for layout-equivalence tests: torch AdamW, manual DP gradient averaging, synthetic
tokens. It keeps DeepSpeed out of the comparison so a mismatch points at the model's parallel layers."""
import torch
import torch.distributed as dist

from megahybrid.distributed import Groups
from megahybrid.model.config import ModelConfig
from megahybrid.model.gpt import lm_loss


def synthetic_batch(cfg: ModelConfig, step: int, global_batch: int, seed: int = 0) -> torch.Tensor:
    """Token sequences with learnable structure (a noisy arithmetic progression mod vocab), same on every rank."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, cfg.vocab_size, (global_batch, 1), generator=gen)
    stride = torch.randint(1, 7, (global_batch, 1), generator=gen)
    seq = (start + stride * torch.arange(cfg.seq_length + 1)) % cfg.vocab_size
    noise = torch.rand(seq.shape, generator=gen) < 0.05
    return torch.where(noise, torch.randint_like(seq, cfg.vocab_size, generator=gen), seq)


def average_dp_grads(model: torch.nn.Module, groups: Groups) -> None:
    """Gradient mean over the data-parallel x context-parallel ranks (megatron's and DeepSpeed's convention)."""
    replicas = groups.layout.dp * groups.layout.cp
    if replicas == 1:
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=groups.dp_cp_group)
            param.grad /= replicas


def train_steps(model, cfg: ModelConfig, groups: Groups, steps: int, global_batch: int, lr: float = 3e-3,
                seed: int = 0) -> list[float]:
    """Run `steps` AdamW steps; return the global mean loss of each step (same on every rank). Under context
    parallelism each CP rank trains on its contiguous shard of the data-parallel rank's sequences."""
    from megahybrid.model.cp import shard_batch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    device = next(model.parameters()).device
    micro = global_batch // groups.layout.dp
    cp_group = groups.cp_group if groups.layout.cp > 1 else None
    losses = []
    for step in range(steps):
        batch = synthetic_batch(cfg, step, global_batch, seed)[groups.dp_rank * micro:(groups.dp_rank + 1) * micro]
        batch = batch.to(device)
        parts = shard_batch({"tokens": batch[:, :-1], "labels": batch[:, 1:]}, groups.cp_rank, groups.layout.cp)
        loss = lm_loss(model, parts["tokens"], parts["labels"], torch.ones_like(parts["tokens"]), cp_group)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_dp_grads(model, groups)
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=groups.dp_cp_group)
        losses.append(reported.item() / (groups.layout.dp * groups.layout.cp))
    return losses


def losses_and_grads(cfgs: dict, layouts: dict, steps: int, before=lambda pattern: None) -> dict:
    """(pattern, layout name) -> (per-step losses, full gradients) after `steps` steps of every model config
    `cfgs[pattern]` under every ParallelLayout `layouts[name]`; `before(pattern)` runs ahead of a pattern's runs."""
    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.gpt import build_model
    from megahybrid.model.sharding import full_named_tensors

    out = {}
    for pattern, cfg in cfgs.items():
        before(pattern)
        for name, layout in layouts.items():
            groups = init_distributed(layout)
            model = build_model(cfg, groups.layout)
            losses = train_steps(model, cfg, groups, steps, global_batch=4)
            out[pattern, name] = (losses, full_named_tensors(model, groups.tp_group, grads=True))
    shutdown()
    return out
