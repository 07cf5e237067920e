"""The shifted-sum causal depthwise conv against torch's grouped conv1d, and its tail continuing a sequence."""
import pytest
import torch
import torch.nn.functional as F

from megahybrid.model.mixers.shortconv import causal_depthwise_conv
from tests.utils import assert_close

TOL = 1e-6  # fp32 relative RMS error: the same products summed in another order


def conv1d_reference(x, weight, tail):
    xp = torch.cat((tail, x), 1).transpose(1, 2)
    return F.conv1d(xp, weight[:, None, :], groups=x.shape[-1]).transpose(1, 2)


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3, 63, 100])
def test_matches_grouped_conv1d_with_gradients(K, T):
    torch.manual_seed(T + K)
    x = torch.randn(2, T, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, K, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(2, K - 1, 12, dtype=torch.float64, requires_grad=True)
    y, new_tail = causal_depthwise_conv(x.float(), w.float(), tail.float())
    ref = conv1d_reference(x, w, tail)
    assert_close(y.double(), ref, TOL, "y")
    assert torch.equal(new_tail.double(), torch.cat((tail, x), 1)[:, T:].float().double())
    dy = torch.randn_like(ref)
    grads = torch.autograd.grad(y.double(), (x, w, tail), dy)
    refs = torch.autograd.grad(ref, (x, w, tail), dy)
    for name, g, r in zip(("dx", "dw", "dtail"), grads, refs):
        if r.numel():
            assert_close(g, r, TOL, name)


def test_split_sequence_continues_through_the_tail():
    torch.manual_seed(0)
    x, w = torch.randn(3, 50, 8), torch.randn(8, 4)
    whole, _ = causal_depthwise_conv(x, w)
    first, tail = causal_depthwise_conv(x[:, :17], w)
    second, _ = causal_depthwise_conv(x[:, 17:], w, tail)
    assert_close(torch.cat((first, second), 1), whole, 0.0, "split")


def test_bf16_input_accumulates_in_fp32():
    torch.manual_seed(1)
    x, w = torch.randn(2, 64, 16), torch.randn(16, 4)
    y, _ = causal_depthwise_conv(x.bfloat16(), w)
    ref = conv1d_reference(x.bfloat16().float(), w, torch.zeros(2, 3, 16))
    assert y.dtype == torch.bfloat16
    assert_close(y.float(), ref, 4e-3, "y")
