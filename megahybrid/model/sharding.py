"""Tensor-parallel shards <-> full tensors, following megatron's parameter tags
(`tensor_model_parallel`, `partition_dim`, `partition_stride`). Used by tests and checkpoint conversion."""
import torch
import torch.distributed as dist


def is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def merge_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of megatron's CPU init split: the master weight is cut into world*stride pieces along `dim`,
    piece i going to rank i % world (stride 2 = SwiGLU's interleaved gate/up halves)."""
    world = len(shards)
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    ordered = [pieces[i % world][i // world] for i in range(world * stride)]
    return torch.cat(ordered, dim=dim)


def gather_full(tensor: torch.Tensor, like: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather this rank's shard of a TP-sharded tensor (tagged like `like`) into the full tensor."""
    if not is_tp_sharded(like) or dist.get_world_size(tp_group) == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, tensor.detach().contiguous(), group=tp_group)
    return merge_shards(shards, like.partition_dim, getattr(like, "partition_stride", 1))


def full_named_tensors(model: torch.nn.Module, tp_group, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, or their gradients, keyed by parameter name; identical on every TP rank."""
    out = {}
    for name, param in model.named_parameters():
        source = param.grad if grads else param
        if source is None:
            continue
        out[name] = gather_full(source, param, tp_group).float().cpu()
    return out


def shard_of(full: torch.Tensor, dim: int, stride: int, world: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of a full tensor: the inverse of merge_shards (pieces rank, rank + world, ...)."""
    pieces = torch.chunk(full, world * stride, dim=dim)
    return torch.cat([pieces[rank + k * world] for k in range(stride)], dim=dim)
