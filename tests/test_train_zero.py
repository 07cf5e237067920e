"""DeepSpeed ZeRO 1/2/3 x TP on gloo: every supported combination trains the tiny model to the same losses as
one process with ZeRO-1, and unsupported ones fail at config time."""
import pytest

from tests.dist import run_on_ranks

LOSS_TOL = 2e-5  # fp32; only the order of reductions differs between layouts
STEPS = 3


def train_config(run_dir: str, data_dir: str, **overrides):
    """The test run config: tiny model on the small built-in corpus, deterministic, no validation."""
    from megahybrid.train.config import load_config

    base = {
        "run_dir": run_dir, "model.vocab_size": 512, "data.builtin_dir": data_dir, "data.builtin_vocab_size": 512,
        "data.builtin_num_docs": 2000, "train.steps": STEPS, "optimizer.warmup_steps": 1, "eval.iters": 0,
        "logging.tensorboard": False, "checkpoint.interval": 1000, "batch.global_batch_size": 8,
        "batch.micro_batch_size": 2, "train.deterministic": True,
    }
    base.update(overrides)
    return load_config("demo", [f"{k}={v}" for k, v in base.items()])


def _train_variants(rank, world, root, data_dir, variants):
    import os

    import torch.distributed as dist

    from megahybrid.distributed import shutdown
    from megahybrid.train.trainer import Trainer, make_plan

    losses = {}
    for name, overrides in variants.items():
        cfg = train_config(os.path.join(root, name), data_dir, **overrides)
        trainer = Trainer(make_plan(cfg, world), resume=False)
        batches = iter(trainer.loader)
        losses[name] = [trainer.train_step(batches)["loss"] for _ in range(STEPS)]
        trainer.logger.close()
        dist.barrier()
    shutdown()
    return losses


SINGLE = {"zero1": {}, "zero2": {"train.deepspeed_config": "zero2"}, "zero3": {"train.deepspeed_config": "zero3"}}
TWO_RANKS = {
    "zero1_dp2": {}, "zero2_dp2": {"train.deepspeed_config": "zero2"}, "zero3_dp2": {"train.deepspeed_config": "zero3"},
    "zero1_tp2": {"parallel.tp": 2}, "zero2_tp2": {"parallel.tp": 2, "train.deepspeed_config": "zero2"},
    "zero3_tp2": {"parallel.tp": 2, "train.deepspeed_config": "zero3"},
    "zero2_tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.deepspeed_config": "zero2"},
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from megahybrid.data.builtin import prepare_builtin

    path = tmp_path_factory.mktemp("builtin")
    prepare_builtin(str(path), vocab_size=512, num_docs=2000)
    return str(path)


@pytest.mark.dist
def test_zero_stages_and_tp_match_single_process(data_dir, tmp_path):
    single = run_on_ranks(_train_variants, 1, str(tmp_path / "one"), data_dir, SINGLE)[0]
    reference = single["zero1"]
    assert all(x == x for x in reference) and reference[-1] < reference[0], reference
    for name, losses in single.items():
        assert losses == pytest.approx(reference, rel=LOSS_TOL), f"{name}: {losses} vs {reference}"
    for rank_losses in run_on_ranks(_train_variants, 2, str(tmp_path / "two"), data_dir, TWO_RANKS):
        for name, losses in rank_losses.items():
            assert losses == pytest.approx(reference, rel=LOSS_TOL), f"{name}: {losses} vs {reference}"
