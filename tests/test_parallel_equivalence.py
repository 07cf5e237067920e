"""3 training steps of the tiny model give the same losses and gradients for TP=1, TP=2, TP=2+SP and DP=2, for
every mixer pattern in PATTERNS (a new mixer joins with one line)."""
import pytest

from tests.dist import run_on_ranks
from tests.utils import assert_close

LOSS_TOL = 1e-5  # fp32, reductions reordered across ranks
GRAD_TOL = 1e-4  # relative RMS error of each full (unsharded) gradient

PATTERNS = [
    "S",
]
LAYOUTS_2 = {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sequence_parallel=True), "dp2": dict(dp=2)}
LAYOUTS_4 = {"tp2_dp2_sp": dict(tp=2, dp=2, sequence_parallel=True)}


def _train_layouts(rank, world, layouts, steps):
    from tests.minimal_train import train_steps
    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model
    from megahybrid.model.sharding import full_named_tensors
    from megahybrid.parallel import ParallelLayout

    out = {}
    for pattern in PATTERNS:
        cfg = preset("tiny", pattern=pattern, num_layers=max(2, len(pattern)))
        for name, dims in layouts.items():
            groups = init_distributed(ParallelLayout(**dims))
            model = build_model(cfg, groups.layout)
            losses = train_steps(model, cfg, groups, steps, global_batch=4)
            out[pattern, name] = (losses, full_named_tensors(model, groups.tp_group, grads=True))
    shutdown()
    return out


@pytest.fixture(scope="module")
def reference():
    per_pattern = run_on_ranks(_train_layouts, 1, {"tp1": {}}, 3)[0]
    return {pattern: per_pattern[pattern, "tp1"] for pattern in PATTERNS}


@pytest.mark.dist
@pytest.mark.parametrize("world, layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["2ranks", "4ranks"])
def test_losses_and_grads_match_across_layouts(reference, world, layouts):
    per_rank = run_on_ranks(_train_layouts, world, layouts, 3)
    for rank_result in per_rank:
        for (pattern, name), (losses, grads) in rank_result.items():
            ref_losses, ref_grads = reference[pattern]
            where = f"pattern {pattern} {name}"
            assert len(ref_grads) > 10
            assert losses == pytest.approx(ref_losses, rel=LOSS_TOL), f"{where} losses {losses} vs {ref_losses}"
            assert grads.keys() == ref_grads.keys(), where
            for key in ref_grads:
                assert_close(grads[key], ref_grads[key], GRAD_TOL, f"{where} grad {key}")
            assert ref_losses[2] < ref_losses[0], f"{where}: training did not reduce the loss"
