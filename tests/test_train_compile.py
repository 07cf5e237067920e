"""train.compile=true (torch.compile through the DeepSpeed engine) trains the same as eager, with the mixers
measured slower compiled on a GPU kept eager inside the compiled model; parameters stay 16-byte aligned under ZeRO
(unaligned ones made compiled kernels fault on the H200)."""
import os
import re

import pytest

from tests.test_train_resume import _args, data_dir, losses, run  # noqa: F401  (data_dir is a fixture)

COMPILE_LOSS_TOL = 1e-4  # relative; inductor may fuse fp32 reductions in another order


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["S", "IG", "DG"])
def test_compiled_training_matches_eager(pattern, data_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the mixers' CPU path is torch; the interpreter is slow
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    run(_args(eager, data_dir, 3, f"model.pattern={pattern}"))
    run(_args(compiled, data_dir, 3, f"model.pattern={pattern}", "train.compile=true"))
    eager_losses, compiled_losses = losses(eager), losses(compiled)
    assert len(eager_losses) == 3
    assert compiled_losses == pytest.approx(eager_losses, rel=COMPILE_LOSS_TOL)


@pytest.mark.slow
def test_compiled_full_recompute_matches_eager(data_dir, tmp_path):  # noqa: F811
    """model.recompute=full under train.compile=true: the recomputing backward inside the compiled graph."""
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    run(_args(eager, data_dir, 3))
    run(_args(compiled, data_dir, 3, "model.recompute=full", "train.compile=true"))
    assert losses(compiled) == pytest.approx(losses(eager), rel=COMPILE_LOSS_TOL)


@pytest.mark.slow
def test_compiled_by_layers_matches_eager(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """train.compile_scope=layers: each decoder layer (N's mixer kept eager inside it) and the loss compiled apart."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    run(_args(eager, data_dir, 3, "model.pattern=SN"))
    run(_args(compiled, data_dir, 3, "model.pattern=SN", "train.compile=true", "train.compile_scope=layers"))
    assert losses(compiled) == pytest.approx(losses(eager), rel=COMPILE_LOSS_TOL)


class _Engine:
    def __init__(self, module):
        self.module, self.compiled = module, False

    def compile(self):
        self.compiled = True


def _compile_tiny(rank, world, pattern, kept_eager):
    import dataclasses

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model
    from megahybrid.model.mixers import MIXERS
    from megahybrid.parallel import ParallelLayout
    from megahybrid.train.trainer import compile_model

    records = {c: MIXERS[c].gpu_compile for c in pattern}
    for char in kept_eager:  # a record measured slower compiled (none is today: D was until its FFT contraction)
        MIXERS[char] = dataclasses.replace(MIXERS[char], gpu_compile=False)
    cfg = preset("tiny", pattern=pattern, num_layers=len(pattern))
    engine = _Engine(build_model(cfg, init_distributed(ParallelLayout()).layout))
    compile_model(engine, cfg)
    wrapped = {char: getattr(layer.self_attention.forward, "_torchdynamo_disable", False)
               for layer, char in zip(engine.module.decoder.layers, pattern)}
    shutdown()
    return engine.compiled, wrapped, records


def test_compile_model_keeps_the_recorded_mixers_eager():
    from tests.dist import run_on_ranks

    compiled, wrapped, records = run_on_ranks(_compile_tiny, 1, "SIDNG", "DN")[0]
    assert compiled
    assert all(records.values()), records  # every mixer measured faster compiled on the H200
    assert wrapped == {"S": False, "I": False, "D": True, "N": True, "G": False}


def _misaligned_params(rank, world, stage, run_dir):
    from megahybrid.distributed import shutdown
    from megahybrid.train.config import from_dict
    from megahybrid.train.trainer import Trainer, make_plan

    cfg = from_dict({"run_dir": run_dir, "model": {"preset": "125m", "pattern": "GI", "num_layers": 2, "seq_length": 64},
                     "data": {"synthetic": True}, "batch": {"global_batch_size": 2, "micro_batch_size": 2},
                     "optimizer": {"warmup_steps": 1}, "train": {"steps": 1, "deepspeed_config": stage},
                     "logging": {"tensorboard": False}, "eval": {"iters": 0}})
    model = Trainer(make_plan(cfg, 1)).engine.module
    misaligned = [(name, p.numel()) for name, p in model.named_parameters() if p.data_ptr() % 16]
    shutdown()  # a process group left open at exit can abort the interpreter ("terminate called ...")
    return misaligned


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_flattened_parameters_stay_16_byte_aligned(stage, tmp_path, monkeypatch):
    """ZeRO makes parameters views into one flat buffer per group: a per-head parameter (6 heads at 125M: 24 bytes)
    would shift every later one off the 16-byte alignment compiled kernels load with (issue #15)."""
    from tests.dist import run_on_ranks

    misaligned = run_on_ranks(_misaligned_params, 1, stage, str(tmp_path), env={"TRITON_INTERPRET": "0"})[0]
    assert misaligned == [], misaligned


def _graph_breaks_in_layers(rank, world, pattern):
    import torch

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout

    cfg = preset("tiny", pattern=pattern, num_layers=len(pattern))
    model = build_model(cfg, init_distributed(ParallelLayout()).layout)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    positions = torch.arange(64)[None].expand(2, -1)
    explained = torch._dynamo.explain(lambda t: model(t, positions, None, labels=t).float().mean())(tokens)
    shutdown()
    return [(b.reason.splitlines()[0], [f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in b.user_stack])
            for b in explained.break_reasons]


def test_compiled_layers_have_no_graph_breaks():
    """Every decoder layer, each mixer, traces as one graph on rank 0 (issue #15): megatron-core 0.16.1's
    RowParallelLinear warned at every call there (a break), and the Interdomain op broke the graph once per frame
    before it became a custom op. TRITON_INTERPRET=1: the kernel path, as on a GPU."""
    from tests.dist import run_on_ranks

    breaks = run_on_ranks(_graph_breaks_in_layers, 1, "SIDNG", env={"TRITON_INTERPRET": "1"})[0]
    in_layers = [(reason, stack) for reason, stack in breaks if any("transformer_layer" in f for f in stack)]
    assert in_layers == [], in_layers


def _ops_captured(rank, world, num_layers, scope):
    """Ops dynamo captured into compiled graphs over one forward and backward of a tiny `S` model."""
    import torch

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout
    from megahybrid.train.trainer import compile_model

    cfg = preset("tiny", pattern="S", num_layers=num_layers)
    engine = _Engine(build_model(cfg, init_distributed(ParallelLayout()).layout))
    compile_model(engine, cfg, scope)
    if engine.compiled:  # the stub engine stands in for DeepSpeed's, whose compile() is the module's
        engine.module.compile()
    torch._dynamo.utils.counters.clear()
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    positions = torch.arange(64)[None].expand(2, -1)
    engine.module(tokens, positions, None, labels=tokens).float().mean().backward()
    captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
    shutdown()
    return captured


def test_compile_by_layers_traces_one_layer_whatever_the_depth():
    """train.compile_scope=layers: layers of one kind share one compiled graph, so what dynamo traces (and inductor
    compiles) does not grow with depth, while the whole-model graph does."""
    from tests.dist import run_on_ranks

    by_layers = [run_on_ranks(_ops_captured, 1, n, "layers")[0] for n in (2, 4)]
    whole = [run_on_ranks(_ops_captured, 1, n, "model")[0] for n in (2, 4)]
    assert by_layers[0] == by_layers[1] > 0, by_layers
    assert whole[1] > whole[0] > 0, whole


@pytest.mark.slow
def test_a_resumed_run_compiles_from_its_run_directory(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """train.compile_cache's default: torch.compile's graphs are cached under the run directory, so a resumed run
    (another node's empty /tmp included) loads them instead of compiling; the first step says how many it loaded."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    run_dir = str(tmp_path / "run")
    first = run(_args(run_dir, data_dir, 2, "model.pattern=SG", "train.compile=true"))[0][1]
    again = run(_args(run_dir, data_dir, 4, "model.pattern=SG", "train.compile=true"))[0][1]
    cold = re.search(r"first step [\d.]+ s with torch.compile \(0 of (\d+) compiled graphs from the cache\)", first)
    warm = re.search(r"first step [\d.]+ s with torch.compile \((\d+) of (\d+) compiled graphs from the cache\)", again)
    assert cold and warm, (first[-2000:], again[-2000:])
    assert int(cold.group(1)) > 0 and warm.group(1) == warm.group(2), warm.group(0)
    assert f"cache {tmp_path / 'run' / 'compile_cache'}" in first
    assert os.path.isdir(tmp_path / "run" / "compile_cache" / "fxgraph")


def test_compile_cache_names_the_fix_for_a_file(tmp_path):
    from megahybrid.errors import ConfigError
    from megahybrid.train.config import RunConfig, resolved_compile

    target = tmp_path / "not-a-dir"
    target.write_text("")
    cfg = RunConfig()
    cfg.train.compile_cache = str(target)
    with pytest.raises(ConfigError, match="is a file; give run, torch or a directory"):
        resolved_compile(cfg, False, {})
