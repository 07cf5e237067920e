"""Run configuration: typed sections, YAML loading with `key=value` overrides, and validation that runs before
any process group starts. Every failure raises `ConfigError` (or the data pipeline's `DataError`) with one line
that names the field and the fix.
"""
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megahybrid.data.config import DataConfig
from megahybrid.errors import ConfigError
from megahybrid.model.config import preset
from megahybrid.model.mixers import check_context_parallel, max_chunk_size
from megahybrid.parallel import ParallelLayout

PACKAGE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# ds_configs/ of the checkout (editable install, PYTHONPATH) or its installed copy megahybrid/ds_configs (wheel)
DS_CONFIG_DIRS = (Path(__file__).resolve().parent.parent.parent / "ds_configs",
                  Path(__file__).resolve().parent.parent / "ds_configs")
# DeepSpeed keys our config owns; a DeepSpeed JSON that sets them is rejected so nothing is set twice.
OWNED_DS_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "bf16", "fp16", "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown",
)
DATA_PLACEHOLDER = "SET_ME"


@dataclass
class ModelSection:
    """A preset from megahybrid.model.config.PRESETS plus any ModelConfig field as an override."""

    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)


@dataclass
class ParallelSection:
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False


@dataclass
class DataSection:
    """Either the built-in corpus (prepared under `builtin_dir` on first use) or preprocessed .bin/.idx prefixes.
    All other keys are megahybrid.data.config.DataConfig fields (prefixes, weights, split, tokenizer_model, ...).
    `synthetic`: uniformly random tokens instead (benchmarks, smoke tests); no data file is read."""

    builtin: bool = False
    synthetic: bool = False
    builtin_dir: str = "data/builtin"
    builtin_vocab_size: int = 2048
    builtin_num_docs: int = 12000
    fields: dict = field(default_factory=dict)


@dataclass
class BatchSection:
    global_batch_size: int = 8
    micro_batch_size: int = 4


@dataclass
class OptimizerSection:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 100
    schedule: str = "cosine"
    grad_clip: float = 1.0
    # ZeRO-1/2: clip and skip non-finite steps inside the fused AdamW step on the device, without reading the
    # gradient norm on the host (false: DeepSpeed clips, one host read per param group)
    clip_on_device: bool = True
    # On resume the schedule saved in the checkpoint is kept (a larger train.steps continues at its end);
    # true replaces it with the one this config describes.
    reschedule: bool = False


@dataclass
class TrainSection:
    steps: int = 1000
    seed: int = 1234
    precision: str = "auto"
    deepspeed_config: str = "zero1"
    deterministic: bool = False
    max_consecutive_nonfinite: int = 5
    # torch.compile the model through the DeepSpeed engine: auto = on with a GPU (measured faster, issue #15) but
    # not under ZeRO-3 there; true / false force it. The mixers measured slower compiled (their records'
    # gpu_compile) stay eager inside the compiled model (Trainer.compile_model).
    compile: bool | str = "auto"
    # What one torch.compile region covers: model = the whole model in one graph (fusion across layers); layers =
    # each decoder layer, the final norm and the output layer with the loss as regions of their own (per-block
    # compile, as torchtitan's), layers of one kind sharing one compiled graph: compile time stops growing with depth.
    compile_scope: str = "model"
    # Where torch.compile's graphs and the Triton kernels are cached (megahybrid/train/compile_cache.py): run =
    # <run_dir>/compile_cache, which a resumed run finds warm; torch = torch's own /tmp (node-local); or a directory
    # (one for several runs of a model). TORCHINDUCTOR_CACHE_DIR in the environment wins.
    compile_cache: str = "run"


@dataclass
class CheckpointSection:
    dir: str | None = None
    interval: int = 500
    keep: int = 3
    resume: bool = True
    # Start from these weights (a training checkpoint at any layout, a consolidated or Hugging Face directory)
    # with a fresh optimizer at step 0, unless checkpoint.dir already holds checkpoints to resume.
    init_from: str | None = None
    # Resuming carries Adam's moments and step, also to another layout or ZeRO stage (resharded); false keeps
    # the weights, step and data position but restarts the optimizer state (the --model-only choice).
    load_optimizer: bool = True


@dataclass
class LoggingSection:
    interval: int = 10
    tensorboard: bool = True
    tensorboard_dir: str | None = None
    peak_tflops: float = 786.0


@dataclass
class EvalSection:
    interval: int = 500
    iters: int = 10


@dataclass
class DebugSection:
    """Test hooks: poison the loss of the listed steps (1-based) with NaN; SIGKILL this process after a step, or in
    the middle of the checkpoint save of a step; sleep after each step (to deliver signals mid-run)."""

    nan_loss_steps: list = field(default_factory=list)
    sigkill_after_step: int | None = None
    sigkill_in_save_at_step: int | None = None
    sleep_per_step: float = 0.0


SECTIONS = {
    "model": ModelSection, "parallel": ParallelSection, "data": DataSection, "batch": BatchSection,
    "optimizer": OptimizerSection, "train": TrainSection, "checkpoint": CheckpointSection,
    "logging": LoggingSection, "eval": EvalSection, "debug": DebugSection,
}


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    batch: BatchSection = field(default_factory=BatchSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    debug: DebugSection = field(default_factory=DebugSection)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

    @property
    def tensorboard_dir(self) -> str:
        return self.logging.tensorboard_dir or os.path.join(self.run_dir, "tensorboard")

    def to_dict(self) -> dict:
        """The nested plain-dict form, as written in YAML (model overrides and data fields flattened back)."""
        out = {"run_dir": self.run_dir}
        for name in SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            flat = {**section.pop("overrides", {}), **section.pop("fields", {})}
            out[name] = {**section, **flat}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a config shipped in megahybrid/configs (`demo`, `125m`, ...)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = PACKAGE_CONFIGS / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in PACKAGE_CONFIGS.glob("*.yaml"))
    raise ConfigError(f"--config {name_or_path}: no such file and no shipped config of that name; use a path or one of {names}")


def load_config(name_or_path: str, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config (with its `base:` chain), apply `section.key=value` overrides (values parsed as
    YAML) and build RunConfig."""
    raw = _read_with_base(resolve_config_path(name_or_path), ())
    for item in overrides:
        apply_override(raw, item)
    return from_dict(raw)


def _read_with_base(path: Path, seen: tuple) -> dict:
    """The YAML mapping at `path`; a top-level `base: NAME_OR_PATH` names a config whose mapping it is merged onto
    (section by section, key by key), so a study's variant states only what it changes."""
    raw = _read_yaml(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base={base!r} must be a config name or a YAML path")
    sibling = path.parent / base
    base_path = sibling if sibling.is_file() else resolve_config_path(base)
    if base_path.resolve() in seen + (path.resolve(),):
        raise ConfigError(f"{path}: base {base!r} leads back to itself; break the cycle of base: keys")
    return _merged(_read_with_base(base_path, seen + (path.resolve(),)), raw)


def _merged(base: dict, child: dict) -> dict:
    out = dict(base)
    for key, value in child.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, train:, ...)")
    return raw


def apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not key=value; write e.g. train.steps=100")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(raw: dict) -> RunConfig:
    unknown = sorted(set(raw) - set(SECTIONS) - {"run_dir"})
    if unknown:
        raise ConfigError(f"unknown config section(s) {unknown}; known: run_dir, {', '.join(SECTIONS)}")
    cfg = RunConfig()
    if "run_dir" in raw:
        cfg.run_dir = _typed("run_dir", raw["run_dir"], str)
    for name, cls in SECTIONS.items():
        values = raw.get(name) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{name}: must be a mapping of fields, got {values!r}")
        setattr(cfg, name, _build_section(name, cls, values))
    return cfg


def _build_section(name: str, cls, values: dict):
    known = {f.name: f for f in dataclasses.fields(cls)}
    catch_all = "overrides" if "overrides" in known else "fields" if "fields" in known else None
    kwargs, extra = {}, {}
    for key, value in values.items():
        if key in known and key != catch_all:
            kwargs[key] = _typed(f"{name}.{key}", value, known[key].type)
        elif catch_all:
            extra[key] = value
        else:
            raise ConfigError(f"{name}.{key} is not a known field; known: {sorted(known)}")
    if catch_all:
        kwargs[catch_all] = extra
    return cls(**kwargs)


def _typed(path: str, value, annotation):
    """Check a YAML value against the field's annotation (ints accepted for floats, None for optional)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    optional = "None" in text
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path} must not be empty; give a value")
    base = text.replace("| None", "").strip()
    if base == "float" and isinstance(value, str):
        # YAML 1.1 reads 1e-3 (no dot) as a string.
        try:
            value = float(value)
        except ValueError:
            pass
    checks = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "list": lambda v: isinstance(v, list),
        "dict": lambda v: isinstance(v, dict),
    }
    check = checks.get(base)
    if check and not check(value):
        raise ConfigError(f"{path}={value!r} must be of type {base}")
    return float(value) if base == "float" else value


def validate(cfg: RunConfig, world_size: int, has_gpu: bool, check_data: bool = True):
    """Check the whole config for `world_size` ranks; returns (ModelConfig, ParallelLayout, DeepSpeed dict,
    precision).

    Nothing here starts a process group; data files are checked when `check_data` (after built-in preparation).
    """
    model = preset(cfg.model.preset, **cfg.model.overrides)
    p = cfg.parallel
    layout = ParallelLayout.for_world(world_size, tp=p.tp, cp=p.cp, sequence_parallel=p.sequence_parallel)
    layout.check_model(model.num_heads, model.kv_heads, model.seq_length, max_chunk_size(model.pattern))
    check_context_parallel(model.pattern, layout.cp)
    _check_numbers(cfg)
    _check_batch(cfg, layout)
    precision = resolved_precision(cfg, has_gpu)
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    resolved_compile(cfg, has_gpu, ds)
    _check_zero(ds, has_gpu)
    check_data_fields(cfg)
    if check_data and not cfg.data.builtin and not cfg.data.synthetic:
        data_config(cfg).validate(model.seq_length, model.vocab_size)
    return model, layout, ds, precision


def _check_numbers(cfg: RunConfig) -> None:
    positive = {
        "train.steps": cfg.train.steps, "checkpoint.interval": cfg.checkpoint.interval,
        "checkpoint.keep": cfg.checkpoint.keep, "logging.interval": cfg.logging.interval,
        "eval.interval": cfg.eval.interval, "train.max_consecutive_nonfinite": cfg.train.max_consecutive_nonfinite,
        "batch.global_batch_size": cfg.batch.global_batch_size, "batch.micro_batch_size": cfg.batch.micro_batch_size,
        "logging.peak_tflops": cfg.logging.peak_tflops,
    }
    for name, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{name}={value} must be > 0")
    o = cfg.optimizer
    if not (o.lr > 0 and math.isfinite(o.lr)):
        raise ConfigError(f"optimizer.lr={o.lr} must be a positive finite number, e.g. 3e-4")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must lie in [0, optimizer.lr={o.lr}]")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            raise ConfigError(f"optimizer.{name}={getattr(o, name)} must lie in [0, 1)")
    if o.eps <= 0 or o.weight_decay < 0 or o.grad_clip < 0:
        raise ConfigError("optimizer.eps must be > 0, optimizer.weight_decay and optimizer.grad_clip >= 0 (0 = off)")
    if not 0 <= o.warmup_steps <= cfg.train.steps:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} must lie in [0, train.steps={cfg.train.steps}]")
    if o.schedule not in ("cosine", "linear", "constant"):
        raise ConfigError(f"optimizer.schedule={o.schedule!r}: choose cosine, linear or constant")
    if cfg.eval.iters < 0:
        raise ConfigError(f"eval.iters={cfg.eval.iters} must be >= 0 (0 = no validation)")
    if cfg.data.builtin and cfg.data.synthetic:
        raise ConfigError("data.builtin=true and data.synthetic=true: choose one")
    if cfg.data.builtin and cfg.data.fields.get("prefixes"):
        raise ConfigError("data.builtin=true and data.prefixes are both set: use the built-in corpus or your prefixes")


def _check_batch(cfg: RunConfig, layout) -> None:
    b = cfg.batch
    per_step = b.micro_batch_size * layout.dp
    if b.global_batch_size % per_step:
        raise ConfigError(
            f"batch.global_batch_size={b.global_batch_size} is not a multiple of batch.micro_batch_size x dp = "
            f"{b.micro_batch_size} x {layout.dp}; change one of them or the number of ranks"
        )


def resolved_precision(cfg: RunConfig, has_gpu: bool) -> str:
    value = cfg.train.precision
    if value not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.precision={value!r}: choose auto (bf16 on GPU, fp32 on CPU), bf16 or fp32")
    if value == "auto":
        return "bf16" if has_gpu else "fp32"
    if value == "bf16" and not has_gpu:
        raise ConfigError("train.precision=bf16 needs a GPU; use auto or fp32 on CPU")
    return value


COMPILE_SCOPES = ("model", "layers")


def resolved_compile(cfg: RunConfig, has_gpu: bool, ds: dict) -> bool:
    """auto compiles on a GPU (except under ZeRO-3, below), true wherever asked; either way the mixers measured
    slower compiled stay eager inside the compiled model (Trainer.compile_model, issue #15)."""
    value = cfg.train.compile
    from megahybrid.train import compile_cache

    if error := compile_cache.check(cfg.train.compile_cache):
        raise ConfigError(error)
    if cfg.train.compile_scope not in COMPILE_SCOPES:
        raise ConfigError(f"train.compile_scope={cfg.train.compile_scope!r}: choose {' or '.join(COMPILE_SCOPES)}")
    if value not in (True, False, "auto"):
        raise ConfigError(f"train.compile={value!r}: choose auto (on with a GPU, off on CPU), true or false")
    # Measured on the H200 image (torch 2.11): under ZeRO-3's parameter hooks dynamo fails an internal assertion
    # tracing megatron's vocab-parallel cross entropy (tests/test_reliability.py); torch 2.13 on CPU compiles it.
    zero3_gpu = has_gpu and zero_stage(ds) == 3
    if value is True and zero3_gpu:
        raise ConfigError("train.compile=true with ZeRO-3 on a GPU fails in torch.compile (megatron's "
                          "vocab-parallel cross entropy); use train.compile=auto or false, or ZeRO-1/2")
    return has_gpu and not zero3_gpu if value == "auto" else value


def resolve_deepspeed_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    for root in (Path.cwd() / "ds_configs", *DS_CONFIG_DIRS):
        candidate = root / f"{name_or_path.removesuffix('.json')}.json"
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"train.deepspeed_config={name_or_path!r}: no such file; use a path or one of zero1, zero2, zero3, "
        "zero2_offload, zero3_offload (ds_configs/)"
    )


def load_deepspeed_config(name_or_path: str) -> dict:
    path = resolve_deepspeed_path(name_or_path)
    try:
        ds = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"train.deepspeed_config: {path} is not valid JSON ({err}); fix it") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"train.deepspeed_config: {path} holds a JSON {type(ds).__name__}, not an object "
                          '{"zero_optimization": {...}, ...}; see ds_configs/zero1.json')
    checkpoint = ds.get("checkpoint") if isinstance(ds.get("checkpoint"), dict) else {}
    engines = [key for key in ("writer", "load_universal") if checkpoint.get(key)]
    if engines or ds.get("datastates_ckpt"):
        raise ConfigError(
            f"train.deepspeed_config: {path} selects another checkpoint engine ({engines or ['datastates_ckpt']}); "
            "checkpoints are ours (README 'Checkpoints'): remove the setting"
        )
    owned = [key for key in OWNED_DS_KEYS if key in ds]
    if owned:
        raise ConfigError(
            f"train.deepspeed_config: {path} sets {owned}, which our config owns (batch.*, optimizer.*, "
            "train.precision); remove them from the JSON"
        )
    return ds


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def zero_offload(ds: dict) -> bool:
    """Whether the DeepSpeed config offloads optimizer state or parameters to the CPU."""
    zero = ds.get("zero_optimization", {})
    return any(zero.get(key, {}).get("device", "none") != "none" for key in ("offload_optimizer", "offload_param"))


def _check_zero(ds: dict, has_gpu: bool) -> None:
    stage = zero_stage(ds)
    if stage not in (1, 2, 3):
        raise ConfigError(f"train.deepspeed_config: zero_optimization.stage={stage}; use 1, 2 or 3")
    if zero_offload(ds) and not has_gpu:
        raise ConfigError("train.deepspeed_config: CPU offload needs a GPU (on CPU everything is already in host memory); use zero1/2/3")


def check_data_fields(cfg: RunConfig) -> None:
    """Unknown data-section names, refused before any data work (the built-in corpus takes seconds to build)."""
    known = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = sorted(set(cfg.data.fields) - known)
    if unknown:
        own = {f.name for f in dataclasses.fields(DataSection)} - {"fields"}
        raise ConfigError(f"data.{unknown[0]} is not a known field; known: {sorted(known | own)}")


def data_config(cfg: RunConfig, builtin=None):
    """The data pipeline's DataConfig from our data section (built-in paths filled in when given)."""
    fields = dict(cfg.data.fields)
    fields.setdefault("seed", cfg.train.seed)
    check_data_fields(cfg)
    if builtin is not None:
        return builtin.data_config(**fields)
    for name in ("prefixes", "tokenizer_model"):
        if DATA_PLACEHOLDER in str(fields.get(name, "")):
            raise ConfigError(f"data.{name} still holds the placeholder {DATA_PLACEHOLDER}: override it, e.g. data.{name}=...")
    try:
        return DataConfig(**fields)
    except TypeError as err:
        raise ConfigError(f"data: {err}") from None
