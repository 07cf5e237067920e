"""megahybrid.model.loss: the vocab-parallel cross entropy against torch's in fp64, on one rank and split over two
gloo ranks (the vocabulary in halves, as TP = 2 holds it), loss and the logits' gradient; odd sizes."""
import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_on_ranks
from tests.utils import assert_close, requires_gpu

FP32_TOL = 1e-6
BF16_GRAD_TOL = 8e-3  # the gradient rounded to bf16 (relative step 2^-8; RMS about a third of it)


def _inputs(dtype, S=7, B=3, V=50, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(S, B, V, generator=gen) * 4).to(dtype)
    target = torch.randint(0, V, (S, B), generator=gen)
    upstream = torch.rand(S, B, generator=gen, dtype=torch.float64)
    return logits.to(device), target.to(device), upstream.to(device)


def _reference(logits, target, upstream):
    """fp64 per-token loss [s, b] and the gradient of sum(loss * upstream) by the logits."""
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad


def _ours(logits, target, upstream, group=None, fn=None):
    from megahybrid.model.loss import vocab_parallel_cross_entropy

    x = logits.clone().requires_grad_()
    loss = (fn or vocab_parallel_cross_entropy)(x, target, group)
    (loss * upstream.float()).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype, grad_tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_GRAD_TOL)])
def test_cross_entropy_matches_torch_on_one_rank(dtype, grad_tol):
    logits, target, upstream = _inputs(dtype)
    loss, grad = _ours(logits, target, upstream)
    ref_loss, ref_grad = _reference(logits, target, upstream)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    assert_close(grad, ref_grad, grad_tol, "logits grad")


def _two_ranks(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    logits, target, upstream = _inputs(torch.float32, V=50)
    shard = logits.chunk(world, dim=-1)[rank]
    loss, grad = _ours(shard, target, upstream, dist.group.WORLD)
    dist.destroy_process_group()
    return loss, grad


@pytest.mark.dist
def test_cross_entropy_over_two_vocab_shards_matches_torch():
    logits, target, upstream = _inputs(torch.float32, V=50)
    ref_loss, ref_grad = _reference(logits, target, upstream)
    for rank, (loss, grad) in enumerate(run_on_ranks(_two_ranks, 2)):
        assert_close(loss, ref_loss, FP32_TOL, f"rank {rank} loss")
        assert_close(grad, ref_grad.chunk(2, dim=-1)[rank], FP32_TOL, f"rank {rank} logits grad")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cross_entropy_bf16_on_gpu(compiled):
    """The 125M preset's vocabulary, bf16 logits, eager and under torch.compile (the trainer's default on a GPU,
    which fuses the backward's softmax recomputation)."""
    from megahybrid.model.loss import vocab_parallel_cross_entropy

    logits, target, upstream = _inputs(torch.bfloat16, S=512, B=2, V=32000, device="cuda")
    fn = torch.compile(vocab_parallel_cross_entropy) if compiled else None
    loss, grad = _ours(logits, target, upstream, fn=fn)
    ref_loss, ref_grad = _reference(logits, target, upstream)
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    assert_close(grad, ref_grad, BF16_GRAD_TOL, "logits grad")
