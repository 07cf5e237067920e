"""Next-token cross entropy over vocab-parallel logits that keeps the logits, not their softmax, for the backward.

megatron-core's vocab_parallel_cross_entropy saves the fp32 softmax of every logit for its backward: at the 125M
preset's micro-batch (8 x 4096 tokens, 32000 words) a 4.2 GB tensor written in the forward and read in the
backward, which the H100 profile put at 11 ms a step in four memory-bound kernels against 6 ms for the compiled
plain-PyTorch baseline's log-softmax (tools/results/bench_train-profile.log). This function saves the logits as
they came (bf16 in bf16 training: half the bytes, and a tensor the output layer had produced anyway) and the
per-token log-sum-exp, and recomputes the softmax in the backward, where torch.compile fuses it into the one
kernel that writes the gradient. Same loss, same gradient (fp32 arithmetic throughout); over TP ranks the max,
the sum of exponentials and the target logit are reduced as megatron reduces them.
"""
import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_SBV, target_SB, group, start):
        vocab = logits_SBV.shape[-1]
        parallel = group is not None
        local_SB = target_SB - start
        inside_SB = (local_SB >= 0) & (local_SB < vocab)
        local_SB = local_SB.clamp(0, vocab - 1)
        # One fp32 temporary of the logits' size in eager mode (the difference, exponentiated in place): max and
        # gather are exact in the logits' own dtype, and a 16-bit tensor minus an fp32 one is formed in fp32.
        max_SB = logits_SBV.amax(-1).float()
        if parallel:
            dist.all_reduce(max_SB, dist.ReduceOp.MAX, group=group)
        sum_exp_SB = (logits_SBV - max_SB[..., None]).exp_().sum(-1)
        target_logit_SB = logits_SBV.gather(-1, local_SB[..., None]).squeeze(-1).float() * inside_SB
        if parallel:
            dist.all_reduce(sum_exp_SB, group=group)
            dist.all_reduce(target_logit_SB, group=group)
        lse_SB = max_SB + sum_exp_SB.log()
        ctx.save_for_backward(logits_SBV, lse_SB, local_SB, inside_SB)
        return lse_SB - target_logit_SB

    @staticmethod
    def backward(ctx, grad_SB):
        logits_SBV, lse_SB, local_SB, inside_SB = ctx.saved_tensors
        grad_SBV = (logits_SBV - lse_SB[..., None]).exp_()
        grad_SBV.scatter_add_(-1, local_SB[..., None], -inside_SB[..., None].float())
        grad_SBV.mul_(grad_SB[..., None])
        return grad_SBV.to(logits_SBV.dtype), None, None, None


def vocab_parallel_cross_entropy(logits_SBV: torch.Tensor, target_SB: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of this TP rank's vocabulary shard of the logits `[s, b, vocab / tp]` and the
    global target ids `[s, b]`; `group`: the tensor-parallel group (None or one rank: no communication)."""
    if group is None or dist.get_world_size(group) == 1:
        return _VocabParallelCrossEntropy.apply(logits_SBV, target_SB, None, 0)
    start = dist.get_rank(group) * logits_SBV.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits_SBV, target_SB, group, start)
