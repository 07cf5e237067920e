"""Run configs: shipped configs load, overrides apply, bad configs and bad data give one-line errors naming the
field (in-process and through the CLI: one line on stderr, exit code 2), LR schedule, FLOP formula, hooks."""
import math
import os
import subprocess
import sys

import pytest
import yaml

from megahybrid.errors import UserError
from megahybrid.model.config import count_parameters, preset
from megahybrid.model.mixers import state_floats
from megahybrid.train.config import PACKAGE_CONFIGS, load_config, validate
from tests.utils import subprocess_pythonpath


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    from megahybrid.data.builtin import prepare_builtin

    return prepare_builtin(str(tmp_path_factory.mktemp("builtin")), vocab_size=512, num_docs=2000)


def _demo(builtin, *overrides):
    base = [f"data.builtin_dir={os.path.dirname(builtin.prefix)}", "data.builtin_vocab_size=512",
            "data.builtin_num_docs=2000", "model.vocab_size=512"]
    return load_config("demo", base + list(overrides))


SHIPPED = sorted(p.stem for p in PACKAGE_CONFIGS.glob("*.yaml"))
# Parameter range (millions) by the size a shipped config's name starts with.
SIZE_RANGES_M = {"demo": (0.1, 1), "repro-small": (19, 23), "125m": (130, 140), "350m": (370, 385),
                 "natsl-340m": (330, 385),
                 "760m": (775, 790), "natsl-760m": (690, 800), "1.3b": (1340, 1365)}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name):
    data = [] if name.startswith("demo") else ["data.prefixes=[/data/x]", "data.tokenizer_model=/data/x.model"]
    cfg = load_config(name, data)
    layout_world = 2 if name.startswith("demo") else 1 if name == "repro-small" else cfg.parallel.tp * 8
    model, layout, ds, precision = validate(cfg, layout_world, has_gpu=True, check_data=False)
    assert precision == "bf16" and layout.dp == layout_world // cfg.parallel.tp and ds["zero_optimization"]["stage"] in (1, 2, 3)
    assert cfg.batch.global_batch_size % (cfg.batch.micro_batch_size * layout.dp) == 0
    size = max((s for s in SIZE_RANGES_M if name.startswith(s)), key=len)
    low, high = SIZE_RANGES_M[size]
    assert low <= count_parameters(model) / 1e6 <= high, (name, count_parameters(model))
    assert cfg.run_dir == f"runs/{name}"  # an array of several configs needs one run_dir each


def test_study_configs_inherit_their_recipe_and_match_the_state_budget():
    """Every `-s4d` of the scaling study keeps the `-interdomain` recipe and state floats of its size; the ablation
    cells differ from 125m-interdomain only in their interdomain options; every study names shipped configs."""
    for size in ("125m", "350m", "760m", "1.3b"):
        configs = {kind: load_config(f"{size}-{kind}") for kind in ("interdomain", "s4d", "paper")}
        recipe = {kind: (c.optimizer, c.batch, c.train) for kind, c in configs.items()}
        assert recipe["s4d"] == recipe["interdomain"] == recipe["paper"], size
        models = {kind: preset(c.model.preset, **c.model.overrides) for kind, c in configs.items()}
        assert state_floats(models["s4d"], 4096)["D"] == state_floats(models["interdomain"], 4096)["I"], size
    full = load_config("125m-interdomain").to_dict()
    for variant in ("normalized", "generic-query", "dual-contraction"):
        cell = load_config(f"125m-interdomain-{variant}").to_dict()
        assert cell["model"].pop("interdomain") == {"variant": variant} and cell.pop("run_dir") != full["run_dir"]
        assert cell == {k: v for k, v in full.items() if k != "run_dir"}
    for study in (PACKAGE_CONFIGS / "studies").glob("*.yaml"):
        assert set(yaml.safe_load(study.read_text())["configs"]) <= set(SHIPPED), study


def test_base_key_merges_and_refuses_a_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("base: demo\nrun_dir: runs/a\nmodel:\n  pattern: SS\n")
    cfg = load_config(str(tmp_path / "a.yaml"), ["train.steps=3"])
    demo = load_config("demo")
    assert (cfg.run_dir, cfg.model.overrides["pattern"], cfg.train.steps) == ("runs/a", "SS", 3)
    assert cfg.model.overrides["seq_length"] == demo.model.overrides["seq_length"] and cfg.optimizer == demo.optimizer
    (tmp_path / "b.yaml").write_text("base: c.yaml\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\n")
    with pytest.raises(UserError, match="leads back to itself"):
        load_config(str(tmp_path / "b.yaml"))


def test_overrides_and_yaml_round_trip(tmp_path):
    cfg = load_config("demo", ["train.steps=7", "model.pattern=S", "optimizer.lr=1e-3", "data.split=90,10,0"])
    assert cfg.train.steps == 7 and cfg.model.overrides["pattern"] == "S" and cfg.optimizer.lr == 1e-3
    assert cfg.data.fields["split"] == "90,10,0"
    path = tmp_path / "saved.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(str(path)).to_dict() == cfg.to_dict()


BAD_CONFIGS = [
    (["trian.steps=3"], "unknown config section(s) ['trian']"),
    (["train.stpes=3"], "train.stpes is not a known field"),
    (["train.steps=abc"], "train.steps='abc' must be of type int"),
    (["train.steps=0"], "train.steps=0 must be > 0"),
    (["model.preset=huge"], "unknown model preset 'huge'"),
    (["model.hidden_size=66"], "model.hidden_size=66 is not divisible by model.num_heads=4"),
    (["model.pattern=SX"], "model.pattern has unknown mixer 'X'"),
    (["parallel.tp=3"], "world size 2 is not divisible by tp*cp*pp = 3*1*1"),
    (["parallel.tp=1", "parallel.sequence_parallel=true"], "parallel.sequence_parallel needs tp > 1"),
    (["batch.global_batch_size=12"], "batch.global_batch_size=12 is not a multiple of batch.micro_batch_size x dp"),
    (["optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 must lie in [0, optimizer.lr=0.003]"),
    (["optimizer.warmup_steps=500"], "optimizer.warmup_steps=500 must lie in [0, train.steps=200]"),
    (["optimizer.schedule=step"], "optimizer.schedule='step': choose cosine, linear or constant"),
    (["train.precision=bf16"], "train.precision=bf16 needs a GPU"),
    (["train.precision=fp8"], "train.precision='fp8': choose auto"),
    (["train.deepspeed_config=zero9"], "train.deepspeed_config='zero9': no such file"),
    (["train.deepspeed_config=zero3_offload"], "CPU offload needs a GPU"),
    (["steps=3"], "unknown config section(s) ['steps']"),
    (["train.steps"], "override 'train.steps' is not key=value"),
    (["data.prefixes=[/x]"], "data.builtin=true and data.prefixes are both set"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS)
def test_bad_config_one_line(overrides, message):
    with pytest.raises(UserError) as err:
        validate(load_config("demo", overrides), world_size=2, has_gpu=False, check_data=False)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_deepspeed_json_may_not_set_owned_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "train_batch_size": 64}')
    with pytest.raises(UserError, match=r"sets \['train_batch_size'\], which our config owns"):
        validate(load_config("demo", [f"train.deepspeed_config={path}"]), 1, has_gpu=False, check_data=False)


def test_bad_data_one_line(builtin, tmp_path):
    from megahybrid.train.trainer import make_plan

    empty = tmp_path / "empty_text_document"
    cases = [
        (load_config("125m"), "data.prefixes still holds the placeholder SET_ME"),
        (_demo(builtin, "data.builtin=false", f"data.prefixes=[{tmp_path}/missing]",
               f"data.tokenizer_model={builtin.tokenizer_model}"), "missing.bin does not exist"),
        (_demo(builtin, "data.builtin=false", f"data.prefixes=[{builtin.prefix}]",
               f"data.tokenizer_model={tmp_path}/none.model"), "none.model does not exist"),
        (_demo(builtin, "model.vocab_size=256"), "has 512 tokens but the model's vocab_size is 256"),
        (_demo(builtin, "data.builtin=false", f"data.prefixes=[{empty}]",
               f"data.tokenizer_model={builtin.tokenizer_model}"), "holds no tokens"),
        (_demo(builtin, "data.splt=1"), "data.splt is not a known field"),
    ]
    _write_empty_indexed(str(empty))
    for cfg, message in cases:
        with pytest.raises(UserError) as err:
            make_plan(cfg, 1)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_unknown_data_field_is_refused_before_the_builtin_corpus_is_built(tmp_path):
    """A misspelt data key is one line before any data work: the built-in corpus (seconds to build on first use)
    is not prepared first, and the known names include the section's own (synthetic, builtin_vocab_size)."""
    from megahybrid.train.trainer import make_plan

    fresh = tmp_path / "builtin"
    cfg = load_config("demo", [f"data.builtin_dir={fresh}", "data.path=/x"])
    with pytest.raises(UserError, match=r"data.path is not a known field; known: .*'synthetic'") as err:
        make_plan(cfg, 1)
    assert "\n" not in str(err.value) and not fresh.exists()


def _write_empty_indexed(prefix: str) -> None:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.finalize(prefix + ".idx")


CLI_CASES = [
    (["--config", "demo", "train.stpes=3"], "train.stpes is not a known field"),
    (["--config", "nosuch"], "--config nosuch: no such file"),
    (["--config", "125m"], "data.prefixes still holds the placeholder"),
]


def test_cli_errors_exit_2_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(), "PYTHONWARNINGS": "ignore"}
    for args, message in CLI_CASES:
        proc = subprocess.run([sys.executable, "-m", "megahybrid", "train", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_lr_schedule():
    from megahybrid.train.engine import LRSchedule

    sched = LRSchedule(1.0, 0.1, warmup_steps=10, total_steps=110)
    assert sched(0) == pytest.approx(0.1) and sched(9) == pytest.approx(1.0)
    assert sched(60) == pytest.approx(0.55) and sched(110) == pytest.approx(0.1)
    assert LRSchedule(1.0, 0.0, 0, 100, "linear")(50) == pytest.approx(0.5)
    assert LRSchedule(1.0, 0.0, 0, 100, "constant")(99) == 1.0


def test_flops_formula_and_deepspeed_fill():
    from megahybrid.model.config import count_parameters, preset
    from megahybrid.parallel import ParallelLayout
    from megahybrid.train.engine import deepspeed_config
    from megahybrid.train.metrics import flops_per_token

    cfg = preset("125m")
    matmul = count_parameters(cfg) - cfg.vocab_size * cfg.hidden_size - (2 * cfg.num_layers + 1) * cfg.hidden_size
    expected = 3 * (2 * matmul + 2 * cfg.num_layers * cfg.seq_length * cfg.hidden_size)
    assert flops_per_token(cfg) == pytest.approx(expected)
    run = load_config("demo", ["batch.global_batch_size=32", "batch.micro_batch_size=2", "optimizer.grad_clip=0.5"])
    ds = deepspeed_config({"zero_optimization": {"stage": 2}}, run, ParallelLayout(tp=2, dp=4), "bf16")
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True} and "train_batch_size" not in ds


def test_model_metrics_collects_module_hooks():
    import torch

    from megahybrid.train.metrics import model_metrics

    class Mixer(torch.nn.Module):
        def tensorboard_scalars(self):
            return {"kept_fraction": 0.25}

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Mixer())
    assert model_metrics(model) == {"1/kept_fraction": 0.25}
    assert math.isclose(model_metrics(torch.nn.Sequential(Mixer()))["0/kept_fraction"], 0.25)


def test_resume_check_ignores_run_options_and_names_changed_section_fields(tmp_path):
    """A checkpoint resumes across fields that change how a model runs, not its weights (here the fused Interdomain
    input path), and a changed field of an option section is named as model.<section>.<field>."""
    from megahybrid.errors import UserError
    from megahybrid.model.config import preset
    from megahybrid.train.checkpoint import CheckpointManager
    from megahybrid.train.config import load_config

    cfg = load_config("demo-hybrid", ["model.pattern=IS"])
    os.makedirs(tmp_path / "step1")
    (tmp_path / "step1" / "config.yaml").write_text(cfg.to_yaml())
    manager = CheckpointManager(str(tmp_path), keep=1)
    same = preset(cfg.model.preset, **cfg.model.overrides)
    manager.check_model("step1", same.replace(interdomain={"fused_input": True}))
    with pytest.raises(UserError, match=r"holds another model \(model\.interdomain\.modes 64 -> 16\)"):
        manager.check_model("step1", same.replace(interdomain={"modes": 16}))
