"""train.compile=true (torch.compile through the DeepSpeed engine) trains the same as eager."""
import pytest

from tests.test_train_resume import _args, data_dir, losses, run  # noqa: F401  (data_dir is a fixture)

COMPILE_LOSS_TOL = 1e-4  # relative; inductor may fuse fp32 reductions in another order


@pytest.mark.slow
def test_compiled_training_matches_eager(data_dir, tmp_path):  # noqa: F811
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    run(_args(eager, data_dir, 3))
    run(_args(compiled, data_dir, 3, "train.compile=true"))
    eager_losses, compiled_losses = losses(eager), losses(compiled)
    assert len(eager_losses) == 3
    assert compiled_losses == pytest.approx(eager_losses, rel=COMPILE_LOSS_TOL)
