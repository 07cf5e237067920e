"""Model configuration: one typed dataclass, a few derived dials, and the presets users start from."""
import dataclasses
from dataclasses import dataclass

from megahybrid.errors import ConfigError


RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mlp")
# Fields that change how a model is initialized or run, not its weights: a checkpoint resumes across them.
NOT_IN_WEIGHTS = ("init_std", "recompute", "recompute_modules", "recompute_num_layers")


@dataclass
class InterdomainOptions:
    """Options of the Interdomain family (`I`, `D`); set as `model.interdomain.<field>=...`."""

    modes: int = 64
    head_dim: int = 64
    conv_size: int = 4


@dataclass
class NatsOptions:
    """Options of the NAtS-L family (`N`, `G`); set as `model.nats.<field>=...`."""

    gdn_head_dim: int = 128
    conv_size: int = 4


# Fields of ModelConfig that hold one mixer family's options; YAML / overrides give them as mappings.
OPTION_SECTIONS = {"interdomain": InterdomainOptions, "nats": NatsOptions}


@dataclass
class ModelConfig:
    """Llama-style decoder. `pattern` has one character per mixer kind (see megahybrid.model.mixers.MIXERS);
    a pattern shorter than num_layers is tiled ("IIIS" x 6 = 24 layers)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int = 512
    seq_length: int = 128
    pattern: str = "S"
    tie_embeddings: bool = False
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    interdomain: InterdomainOptions = dataclasses.field(default_factory=InterdomainOptions)
    nats: NatsOptions = dataclasses.field(default_factory=NatsOptions)
    # Activation recomputation (megatron-core's recompute_granularity): "none"; "selective" recomputes the
    # `recompute_modules` of each layer (core_attn, mlp; default core_attn); "full" recomputes whole layers:
    # every layer, or the first `recompute_num_layers` when given (megatron's block method).
    recompute: str = "none"
    recompute_modules: list | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self):
        self.validate()

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """SwiGLU width: 8/3 of d_model rounded up to a multiple of 256 (Llama), unless given."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return -(-(8 * self.hidden_size // 3) // 256) * 256

    @property
    def layer_pattern(self) -> str:
        """The per-layer mixer string, num_layers long."""
        return self.pattern * (self.num_layers // len(self.pattern))

    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}; "
                "change one of them"
            )
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            raise ConfigError(
                f"model.num_kv_heads={self.kv_heads} must divide model.num_heads={self.num_heads} (GQA groups)"
            )
        if not self.pattern:
            raise ConfigError('model.pattern is empty; use e.g. "S" (all softmax) or "IIIS"')
        from megahybrid.model.mixers import mixer_for

        for char in dict.fromkeys(self.pattern):
            mixer_for(char)
        if self.num_layers % len(self.pattern):
            raise ConfigError(
                f"model.pattern {self.pattern!r} (length {len(self.pattern)}) does not tile "
                f"model.num_layers={self.num_layers}; give a pattern whose length divides num_layers"
            )
        self._validate_recompute()

    def _validate_recompute(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"model.recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        if self.recompute_modules is not None:
            if self.recompute != "selective":
                raise ConfigError("model.recompute_modules applies to model.recompute=selective only; remove it")
            bad = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
            if bad or not self.recompute_modules:
                raise ConfigError(f"model.recompute_modules={self.recompute_modules}: choose from "
                                  f"{list(RECOMPUTE_MODULES)} (others need TransformerEngine)")
        if self.recompute_num_layers is not None:
            if self.recompute != "full":
                raise ConfigError("model.recompute_num_layers applies to model.recompute=full only; remove it")
            if not 1 <= self.recompute_num_layers <= self.num_layers:
                raise ConfigError(f"model.recompute_num_layers={self.recompute_num_layers} must lie in "
                                  f"[1, model.num_layers={self.num_layers}]")

    def replace(self, **overrides) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s) {unknown}; known fields: {sorted(known)}")
        for name, cls in OPTION_SECTIONS.items():
            if name in overrides:
                overrides[name] = _options(name, cls, getattr(self, name), overrides[name])
        return dataclasses.replace(self, **overrides)


def _options(name: str, cls, current, value):
    """A family's options from a mapping of overrides on top of `current` (or an instance given directly)."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"model.{name} must be a mapping of fields, e.g. model.{name}.{dataclasses.fields(cls)[0].name}=...")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown model.{name} field(s) {unknown}; known: {sorted(known)}")
    return dataclasses.replace(current, **value)


# Llama proportions; parameter counts (vocab 32000, untied) are in docs and checked by tests/test_model.py.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=512, seq_length=128),
    "125m": ModelConfig(num_layers=12, hidden_size=768, num_heads=12, vocab_size=32000, seq_length=4096),
    "350m": ModelConfig(num_layers=24, hidden_size=1024, num_heads=16, vocab_size=32000, seq_length=4096),
    "760m": ModelConfig(num_layers=24, hidden_size=1536, num_heads=12, vocab_size=32000, seq_length=4096),
    "1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=32000, seq_length=4096),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else dataclasses.replace(PRESETS[name])


def count_parameters(cfg: ModelConfig) -> int:
    """Analytic parameter count (norm weights included), independent of parallelism: each layer's mixer from its
    record (megahybrid.model.mixers), plus the SwiGLU MLP, two norms per layer, embeddings and the final norm."""
    from megahybrid.model.mixers import mixer_params

    d = cfg.hidden_size
    per_layer_rest = 3 * d * cfg.ffn_size + 2 * d
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return mixer_params(cfg) + cfg.num_layers * per_layer_rest + embeddings + d
