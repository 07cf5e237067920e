"""The decoder on a GPU: bf16 forward/backward agrees with fp32 on the same weights."""
import pytest
import torch

from tests.dist import run_on_ranks
from tests.utils import assert_close, requires_gpu

BF16_LOSS_TOL = 2e-2  # relative error of the mean loss, bf16 vs fp32 weights and activations
BF16_GRAD_TOL = 8e-2  # relative RMS error of the full gradient vector


def _bf16_vs_fp32(rank, world):
    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model, lm_loss
    from megahybrid.parallel import ParallelLayout

    cfg = preset("tiny", seq_length=256)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), device="cuda")
    out = {}
    for precision in ("fp32", "bf16"):
        init_distributed(ParallelLayout(), seed=7)
        model = build_model(cfg, ParallelLayout(), precision)
        loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:], torch.ones_like(tokens[:, 1:]))
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        out[precision] = (loss.item(), grads.cpu())
    shutdown()
    return out


@pytest.mark.gpu
@requires_gpu
def test_bf16_matches_fp32_on_gpu():
    out = run_on_ranks(_bf16_vs_fp32, 1)[0]
    assert out["bf16"][0] == pytest.approx(out["fp32"][0], rel=BF16_LOSS_TOL)
    assert_close(out["bf16"][1], out["fp32"][1], BF16_GRAD_TOL, "bf16 gradients")
