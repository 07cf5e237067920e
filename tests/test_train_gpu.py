"""`megahybrid train`'s step on a GPU for every mixer: eager and compiled (a mixer whose record says
`gpu_compile=False`, measured slower compiled, would stay eager inside the compiled model; none does today), every
loss finite, no skipped step, compiled losses equal to eager within bf16 noise.

The shapes are the presets' own head dims (125M: 12 x 64; NAtS-L: 6 GDN heads x 128, V = 256, 12 attention
heads) with few layers, at 1024 tokens, with the layers' real gates (strong decays), which kernel tests with
mild random inputs did not reach.
"""
import math

import pytest

from tests.dist import run_on_ranks
from tests.utils import requires_gpu

STEPS = 4
COMPILE_LOSS_TOL = 3e-2  # relative, per step: bf16 compute, inductor fuses and reorders the elementwise work


def _train(rank, world, pattern: str, compile_: bool, run_dir: str, preset: str = "125m", seq: int = 1024):
    from megahybrid.train.config import from_dict
    from megahybrid.train.trainer import Trainer, make_plan

    cfg = from_dict({
        "run_dir": run_dir,
        "model": {"preset": preset, "pattern": pattern * (4 // len(pattern)), "num_layers": 4,
                  "seq_length": seq},
        "data": {"synthetic": True},
        "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "optimizer": {"warmup_steps": 1},
        "train": {"steps": STEPS, "compile": compile_},
        "logging": {"tensorboard": False},
        "eval": {"iters": 0},
    })
    trainer = Trainer(make_plan(cfg, 1))
    batches = iter(trainer.loader)
    return [trainer.train_step(batches) for _ in range(STEPS)]


def _runs(pattern, tmp_path):
    runs = {}
    for compile_ in (False, True):
        runs[compile_] = run_on_ranks(_train, 1, pattern, compile_, str(tmp_path / f"c{int(compile_)}"),
                                      env={"TRITON_INTERPRET": "0"}, timeout=400)[0]
    for compile_, steps in runs.items():
        bad = [s for s in steps if s["skip"] or not math.isfinite(s["loss"])]
        assert not bad, f"{pattern} compile={compile_}: non-finite or skipped steps {bad}"
    return runs


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("pattern", ["S", "I", "D", "N", "G", "INSG"])
def test_training_steps_on_gpu(pattern, tmp_path):
    runs = _runs(pattern, tmp_path)
    eager, compiled = ([s["loss"] for s in runs[c]] for c in (False, True))
    print(pattern, "eager", eager, "compiled", compiled)
    assert compiled == pytest.approx(eager, rel=COMPILE_LOSS_TOL)


def _clip_and_skip(rank, world, run_dir: str, on_device: bool):
    """bf16 ZeRO-1 steps that clip (a small max norm) with a NaN loss at step 2: per step the result and whether
    the fp32 master weights moved."""
    import torch

    from megahybrid.train.config import from_dict
    from megahybrid.train.trainer import Trainer, make_plan

    cfg = from_dict({
        "run_dir": run_dir, "model": {"preset": "125m", "pattern": "S", "num_layers": 2, "seq_length": 512},
        "data": {"synthetic": True}, "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "optimizer": {"warmup_steps": 1, "grad_clip": 0.05, "clip_on_device": on_device},
        "train": {"steps": STEPS, "compile": False}, "debug": {"nan_loss_steps": [2]},
        "logging": {"tensorboard": False}, "eval": {"iters": 0},
    })
    trainer = Trainer(make_plan(cfg, 1))
    assert (trainer.optimizer.device_clip is not None) == on_device
    masters = trainer.engine.optimizer.single_partition_of_fp32_groups
    batches, steps = iter(trainer.loader), []
    for _ in range(STEPS):
        before = [m.detach().clone() for m in masters]
        result = trainer.train_step(batches)
        steps.append({**result, "moved": any(not torch.equal(a, b) for a, b in zip(before, masters))})
    return steps


@pytest.mark.gpu
@requires_gpu
def test_bf16_clip_and_skip_on_the_device_equal_deepspeeds(tmp_path):
    """optimizer.clip_on_device: in bf16 DeepSpeed checks no norm, so the NaN step is cancelled by our flag alone;
    the device clip and skip must give DeepSpeed's clipped losses and norms."""
    runs = {on: run_on_ranks(_clip_and_skip, 1, str(tmp_path / f"d{int(on)}"), on, env={"TRITON_INTERPRET": "0"},
                             timeout=400)[0] for on in (True, False)}
    for on, steps in runs.items():
        assert [s["skip"] for s in steps] == [False, True, False, False], (on, steps)
        assert [s["moved"] for s in steps] == [True, False, True, True], (on, steps)
        assert all(s["grad_norm"] > 0.05 for s in steps if not s["skip"]), (on, steps)  # so the steps clip
    finite = [i for i, s in enumerate(runs[True]) if not s["skip"]]
    for key in ("loss", "grad_norm"):
        device, host = ([runs[on][i][key] for i in finite] for on in (True, False))
        assert device == pytest.approx(host, rel=1e-2), key
