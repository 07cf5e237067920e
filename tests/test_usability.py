"""What a new user meets: activation recomputation settings train like no recomputation, printed commands work
as printed, an extended run keeps its LR schedule, config errors under torchrun are one line and exit 2, and the
small command-line conveniences (--version, the torch extensions cache, prepare_wikipedia's defaults)."""
import pytest

from megahybrid.errors import ConfigError
from megahybrid.model.config import preset
from tests.dist import run_on_ranks
from tests.utils import rel_rms_error

RECOMPUTE_SETTINGS = {
    "selective": {"recompute": "selective"},
    "selective_mlp": {"recompute": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full": {"recompute": "full"},
    "full_block": {"recompute": "full", "recompute_num_layers": 2},
}
RECOMPUTE_LOSS_TOL = 1e-6  # fp32, the same kernels run again: only summation order could differ


def _losses_per_setting(rank, world):
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout
    from tests.minimal_train import train_steps

    groups = init_distributed(ParallelLayout())
    calls, original = [0], mp_random.CheckpointFunction.apply

    def counted(*args):
        calls[0] += 1
        return original(*args)

    mp_random.CheckpointFunction.apply = counted
    out = {}
    for name, fields in {"none": {}, **RECOMPUTE_SETTINGS}.items():
        calls[0] = 0
        cfg = preset("tiny", num_layers=4, **fields)
        torch.manual_seed(0)  # the same initial weights for every setting
        out[name] = (train_steps(build_model(cfg, groups.layout), cfg, groups, 3, 4), calls[0])
    shutdown()
    return out


def test_recompute_settings_train_like_no_recompute():
    import torch

    results = run_on_ranks(_losses_per_setting, 1)[0]
    reference, calls = results["none"]
    assert calls == 0
    for name in RECOMPUTE_SETTINGS:
        losses, calls = results[name]
        assert calls > 0, f"{name}: nothing was recomputed"
        err = rel_rms_error(torch.tensor(losses), torch.tensor(reference))
        assert err <= RECOMPUTE_LOSS_TOL, f"{name}: losses {losses} vs {reference} (rel RMS {err:.2e})"


@pytest.mark.parametrize("fields,message", [
    ({"recompute": "some"}, "model.recompute='some': choose one of none, selective, full"),
    ({"recompute": "selective", "recompute_modules": ["layernorm"]}, "others need TransformerEngine"),
    ({"recompute_num_layers": 2}, "applies to model.recompute=full only"),
    ({"recompute": "full", "recompute_num_layers": 9}, "must lie in [1, model.num_layers=2]"),
])
def test_bad_recompute_messages(fields, message):
    with pytest.raises(ConfigError, ) as err:
        preset("tiny", **fields)
    assert message in str(err.value)
