"""DeepSpeed ZeRO 1/2/3 x TP on gloo: every supported combination trains the tiny model to the same losses as
one process with ZeRO-1, and unsupported ones fail at config time. The runs clip (optimizer.grad_clip 0.5, below
the tiny model's first gradient norms of 0.8-0.95): ZeRO-1/2 clip inside the optimizer step on the device,
ZeRO-3 and `optimizer.clip_on_device=false` through DeepSpeed, and all must agree."""
import contextlib

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
        "batch.micro_batch_size": 2, "train.deterministic": True, "optimizer.grad_clip": 0.5,
    }
    base.update(overrides)
    return load_config("demo", [f"{k}={v}" for k, v in base.items()])


def _train_variants(rank, world, root, data_dir, variants, keep_groups=False):
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
    if not keep_groups:
        shutdown()
    return losses


def _single_process_checks(rank, world, root, data_dir):
    """The ZeRO variants, then a poisoned (NaN) step that must leave weights and optimizer state untouched."""
    import os

    losses = _train_variants(rank, world, root, data_dir, SINGLE, keep_groups=True)
    nan = {stage: _nan_step_check(os.path.join(root, f"nan_{stage}"), data_dir, world, stage)
           for stage in ("zero1", "zero3")}
    reads = _host_reads(os.path.join(root, "reads"), data_dir, world)
    order = _run_order(os.path.join(root, "order"), data_dir, world)
    order_stop_at_once = _run_order(os.path.join(root, "order_max1"), data_dir, world,
                                    **{"debug.nan_loss_steps": "[2]", "train.max_consecutive_nonfinite": 1})
    from megahybrid.distributed import shutdown

    shutdown()
    return losses, nan, reads, (order, order_stop_at_once)


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@contextlib.contextmanager
def host_reads_call(on_read):
    """Inside the block, every host read of a tensor (HOST_READS) first calls on_read(method name), then reads."""
    import torch

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def patched(name):
        def read(self, *args, **kwargs):
            on_read(name)
            return saved[name](self, *args, **kwargs)
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, patched(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _host_reads(run_dir, data_dir, world):
    """Where a second ZeRO-1 step reads tensors on the host (each read waits for the device to drain): lists of
    (method, innermost file:function) pairs while the step is queued and while it is read."""
    import os
    import traceback

    from megahybrid.train.trainer import Trainer, make_plan

    trainer = Trainer(make_plan(train_config(run_dir, data_dir), world), resume=False)
    batches = iter(trainer.loader)
    trainer.train_step(batches)
    reads = []

    def record(name):
        frame = traceback.extract_stack()[-3]  # the caller of the patched method
        reads.append((name, f"{os.path.basename(frame.filename)}:{frame.name}"))

    with host_reads_call(record):
        queued = trainer.queue_step(batches)
    queue_reads, reads = reads, []
    with host_reads_call(record):
        trainer.conclude(queued)
    trainer.logger.close()
    return queue_reads, reads


def _run_order(run_dir, data_dir, world, **overrides):
    """`megahybrid train`'s loop (Trainer.run) over 6 steps, console line every 3rd, a NaN loss at step 4 unless
    `overrides` say otherwise: the order in which steps are queued (q) and read (r), and the steps and skip counts
    it logged."""
    import json
    import os

    from megahybrid.train.trainer import Trainer, make_plan

    cfg = train_config(run_dir, data_dir, **{"train.steps": 6, "logging.interval": 3, "debug.nan_loss_steps": "[4]",
                                             **overrides})
    trainer = Trainer(make_plan(cfg, world), resume=False)
    events, queue, conclude = [], trainer.queue_step, trainer.conclude

    def queued(batches):
        step = queue(batches)
        events.append(f"q{step.step}")
        return step

    def read(step):
        events.append(f"r{step.step}")
        return conclude(step)

    trainer.queue_step, trainer.conclude = queued, read
    code = trainer.run()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logged = [(r["step"], r["train/skipped_steps"]) for r in map(json.loads, f) if "train/loss" in r]
    return code, events, logged


def _nan_step_check(run_dir, data_dir, world, stage):
    """On CPU (fp32) DeepSpeed's invalid-grad-norm check already drops the step; our AdamW flag is what drops it
    for bf16 ZeRO-1/2, where DeepSpeed does not check. Either way the update must not happen.
    Compares ZeRO's flat fp32 master partitions, which hold the weights under every stage."""
    import torch

    from megahybrid.train.trainer import Trainer, make_plan

    cfg = train_config(run_dir, data_dir, **{"debug.nan_loss_steps": "[2]", "train.deepspeed_config": stage})
    trainer = Trainer(make_plan(cfg, world), resume=False)
    zero = trainer.engine.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    masters = lambda: [p.detach().clone() for p in flats]
    batches = iter(trainer.loader)
    first = trainer.train_step(batches)
    before = masters()
    moments = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
    poisoned = trainer.train_step(batches)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, masters())) and len(before) > 0
    moments_kept = all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, trainer.optimizer.state.values()))
    after = trainer.train_step(batches)
    changed = not all(torch.equal(a, b) for a, b in zip(before, masters()))
    trainer.logger.close()
    return dict(first=first, poisoned=poisoned, after=after, unchanged=unchanged, changed=changed,
                moments_kept=moments_kept and len(moments) > 0, skipped=trainer.skipped)


SINGLE = {"zero1": {}, "zero2": {"train.deepspeed_config": "zero2"}, "zero3": {"train.deepspeed_config": "zero3"},
          "zero1_host_clip": {"optimizer.clip_on_device": False}}
TWO_RANKS = {
    "zero1_dp2": {}, "zero2_dp2": {"train.deepspeed_config": "zero2"}, "zero3_dp2": {"train.deepspeed_config": "zero3"},
    "zero1_tp2": {"parallel.tp": 2}, "zero2_tp2": {"parallel.tp": 2, "train.deepspeed_config": "zero2"},
    "zero3_tp2": {"parallel.tp": 2, "train.deepspeed_config": "zero3"},
    "zero2_tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.deepspeed_config": "zero2"},
    # ZeRO-3 gathers each layer's parameters in hooks, which the recomputing backward runs again
    "zero3_tp2_sp_full": {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.deepspeed_config": "zero3",
                          "model.recompute": "full"},
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from megahybrid.data.builtin import prepare_builtin

    path = tmp_path_factory.mktemp("builtin")
    prepare_builtin(str(path), vocab_size=512, num_docs=2000)
    return str(path)


@pytest.mark.dist
def test_zero_stages_and_tp_match_single_process(data_dir, tmp_path):
    single, nan_checks, reads, order = run_on_ranks(_single_process_checks, 1, str(tmp_path / "one"), data_dir)[0]
    # Each step is read after the next one is queued, except where host work follows it (the console line at
    # steps 3 and 6, the last step) and after a skipped step (the non-finite stop is decided at once)
    (code, events, logged), (code_max1, events_max1, logged_max1) = order
    assert code == 0 and events == "q1 q2 r1 q3 r2 r3 q4 q5 r4 r5 q6 r6".split(), events
    assert logged == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)], logged
    # With train.max_consecutive_nonfinite=1 one non-finite step ends the run: every step is read at once, so
    # the run stops at the NaN step and no later update is queued
    assert code_max1 == 4 and events_max1 == "q1 r1 q2 r2".split(), events_max1
    assert logged_max1 == [(1, 0), (2, 1)], logged_max1
    # queueing the step reads only DeepSpeed's overflow check, in fp32 (bf16 has none; DeepSpeed's clipping read
    # the norm once per param group before); ours is one read (loss, skip, stop, norm), which `run` makes after
    # the next step is queued
    queue_reads, conclude_reads = reads
    assert queue_reads == [("__bool__", "utils.py:is_invalid_grad_norm")], queue_reads
    assert conclude_reads == [("tolist", "trainer.py:conclude")], conclude_reads
    for nan in nan_checks.values():
        assert nan["poisoned"]["skip"] and nan["poisoned"]["loss"] != nan["poisoned"]["loss"], nan
        assert nan["unchanged"] and nan["moments_kept"] and nan["skipped"] == 1, nan
        assert not nan["after"]["skip"] and nan["after"]["loss"] < nan["first"]["loss"] and nan["changed"], nan
    reference = single["zero1"]
    assert all(x == x for x in reference) and reference[-1] < reference[0], reference
    for name, losses in single.items():
        assert losses == pytest.approx(reference, rel=LOSS_TOL), f"{name}: {losses} vs {reference}"
    for rank_losses in run_on_ranks(_train_variants, 2, str(tmp_path / "two"), data_dir, TWO_RANKS):
        for name, losses in rank_losses.items():
            assert losses == pytest.approx(reference, rel=LOSS_TOL), f"{name}: {losses} vs {reference}"


def _params(seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
    for p in params:
        p.grad = 3 * torch.randn(p.shape, generator=gen)
    return params


def _no_host_reads(step):
    """Run step() with every host read of a tensor raising: the device path must not wait for the device."""
    def refuse(name):
        raise AssertionError(f"host read ({name}) in the optimizer step")

    with host_reads_call(refuse):
        step()


def test_device_clip_equals_zero_clipping_and_skips_without_host_reads():
    import torch

    from megahybrid.train.engine import SkippableAdamW

    ref, ours = _params(0), _params(0)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref]))
    assert norm > 2.0  # so a max norm of 2 clips
    for p in ref:  # DeepSpeed ZeRO's clip: grad / max(1, (norm + 1e-6) / max_norm)
        p.grad /= max(1.0, (norm.item() + 1e-6) / 2.0)
    reference = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, fused=True)
    optimizer = SkippableAdamW(ours, lr=0.1, weight_decay=0.1, fused=True)
    optimizer.device_clip = (2.0, lambda: norm)
    reference.step()
    _no_host_reads(optimizer.step)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, _params(0)[0 if a.dim() == 2 else 1]), "the step did not move the weights"

    before = [p.detach().clone() for p in ours]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in ours]
    for skip, bad_norm in ((torch.tensor(True), norm), (torch.tensor(False), torch.tensor(float("nan")))):
        optimizer.skip_flag = skip
        optimizer.device_clip = (2.0, lambda: bad_norm)
        _no_host_reads(optimizer.step)
        assert all(torch.equal(a, b) for a, b in zip(before, ours)), f"skip={skip} norm={bad_norm}: weights moved"
        assert all(torch.equal(m, optimizer.state[p]["exp_avg"]) for m, p in zip(moments, ours))
        assert all(optimizer.state[p]["step"].item() == 1 for p in ours)
