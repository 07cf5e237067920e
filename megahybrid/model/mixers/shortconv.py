"""The causal depthwise short convolution in front of the recurrent mixers (`I`, `D`, `N`, `G`).

Written as K shifted multiply-adds rather than `F.conv1d(groups=C)`: on the H200 cuDNN's depthwise conv backward
took 1.4 ms per layer call at 8 x 4096 tokens (10% of a 125M `I` training step,
f1e3960:tools/results/bench_train-2026-12-01.md), while the shifted form is elementwise work that torch.compile
fuses into the neighbouring kernels, forward and backward. Products and sums are fp32, as the conv's accumulator was.
"""
import torch

__all__ = ["causal_depthwise_conv"]


def causal_depthwise_conv(x_BTC: torch.Tensor, weight_CK: torch.Tensor,
                          tail_BKC: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y[:, t, c] = sum_j weight[c, j] * x[:, t + j - (K - 1), c], with the K - 1 inputs before x taken from tail
    [B, K - 1, C] (zeros when None: the sequence starts here). Returns y [B, T, C] in x's dtype and the new tail,
    the last K - 1 inputs (what the next call, a decode step or the next CP shard, continues from)."""
    B, T, C = x_BTC.shape
    K = weight_CK.shape[-1]
    if tail_BKC is None:
        tail_BKC = x_BTC.new_zeros(B, K - 1, C)
    xp = torch.cat((tail_BKC.to(x_BTC.dtype), x_BTC), 1)
    xf, w = xp.float(), weight_CK.float()
    y = xf[:, :T] * w[:, 0]
    for j in range(1, K):
        y = y + xf[:, j:j + T] * w[:, j]
    return y.to(x_BTC.dtype), xp[:, xp.shape[1] - (K - 1):]
