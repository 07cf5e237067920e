"""Model configuration: one typed dataclass, a few derived dials, and the presets users start from."""
import dataclasses
from dataclasses import dataclass

from megahybrid.errors import ConfigError
from megahybrid.model.mixers import mixer_for, mixer_params

INTERDOMAIN_VARIANTS = ("full", "normalized", "generic-query", "dual-contraction")

RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mlp")
# Fields that change how a model is initialized or run, not its weights: a checkpoint resumes across them
# (dotted: a field of an option section).
NOT_IN_WEIGHTS = ("init_std", "recompute", "recompute_modules", "recompute_num_layers", "interdomain.fused_input",
                  "interdomain.contraction", "nats.gdn_segments")
CONTRACTIONS = ("fft", "chunked")


@dataclass
class InterdomainOptions:
    """Options of the Interdomain family (`I`, `D`); set as `model.interdomain.<field>=...`.

    `variant` picks the ablation cell the `I` character builds (the paper's Appendix B.1; `D` is always the
    S4D-only cell): full (dual [xi(k), v] input, query-conditioned readout), normalized (full with the op's
    normalized readout), generic-query ([a, b] input, query-conditioned readout), dual-contraction (dual input,
    linear-contraction readout, no query).
    """

    modes: int = 64  # M complex modes per head (the op serves 1..64)
    head_dim: int | None = None  # d_h of values and outputs per head; None = the model's head_dim
    feature_dim: int | None = None  # R of query / key features per head; None = head_dim
    conv_size: int = 4
    rope: bool | None = None  # None = the cell's default: on for `I` cells, off for `D`
    output_gate: bool = False  # sigma(W_g x) * o before the output projection
    init: str = "inv"  # S4D-Inv ("inv") or S4D-Lin ("lin") imaginary parts of A
    variant: str = "full"
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    ssm_lr: float = 1e-3  # learning-rate cap of the SSM parameters and the input norms (no weight decay)
    # I's input path as fused Triton kernels (kernels/interdomain_input; 1.21x tok/s at 125m on the H200). None: on
    # CUDA tensors, torch steps on the CPU; true: wherever Triton runs, its CPU interpreter too (tests); false: never
    fused_input: bool | None = None
    # how the linear-contraction readout (`D`, dual-contraction) computes its S4D convolution: "chunked" (s4d_chunk.py:
    # 64-token chunks, dense products and a chunk-to-chunk carry, linear in T; 125M `D` trains at 180.2K tok/s on the
    # H200 against the FFT's 150.9K, tools/results/bench_train-s4d.md) or "fft" (s4d.py, O(T log T))
    contraction: str = "chunked"

    def heads(self, hidden_size: int, model_head_dim: int) -> tuple[int, int, int]:
        """(heads, d_h, R) of the mixer in a model of this width."""
        dh = self.head_dim or model_head_dim
        return hidden_size // dh, dh, self.feature_dim or dh

    def check(self, hidden_size: int, model_head_dim: int) -> None:
        dh = self.head_dim or model_head_dim
        if hidden_size % dh:
            raise ConfigError(f"model.interdomain.head_dim={dh} must divide model.hidden_size={hidden_size}")
        if not 1 <= self.modes <= 64:
            raise ConfigError(f"model.interdomain.modes={self.modes} must be in 1..64 (the op's limit)")
        if self.variant not in INTERDOMAIN_VARIANTS:
            raise ConfigError(f"model.interdomain.variant={self.variant!r}; choose one of {INTERDOMAIN_VARIANTS}")
        if self.contraction not in CONTRACTIONS:
            raise ConfigError(f"model.interdomain.contraction={self.contraction!r}; choose one of {CONTRACTIONS}")
        if self.init not in ("inv", "lin"):
            raise ConfigError(f"model.interdomain.init={self.init!r}; choose inv (S4D-Inv) or lin (S4D-Lin)")
        if self.conv_size < 1 or not 0 < self.dt_min <= self.dt_max:
            raise ConfigError("model.interdomain: conv_size must be >= 1 and 0 < dt_min <= dt_max")

    def extrapolation_note(self, pattern: str, seq_length: int) -> str | None:
        """A line of advice when `I`'s query readout cannot have seen saturated states in training. Its output is
        bilinear in two states that grow until about 2 / dt_min tokens (the slowest modes, Re(A) = -1/2); trained
        on shorter sequences it meets larger states past the training length. Measured on CPU (4 layers, d 128,
        256 tokens, gated `I`): perplexity at 512-1K was 2.09x that at 128-256 with dt_min 1e-3, 1.05x with 1e-2.
        The linear-contraction cells (`D`, dual-contraction) stay flat either way."""
        memory = 2 / self.dt_min
        if "I" not in pattern or self.variant == "dual-contraction" or seq_length >= memory:
            return None
        return (f"note: model.interdomain.dt_min={self.dt_min:g} gives `I`'s slowest modes a memory of ~{memory:.0f} "
                f"tokens, longer than model.seq_length={seq_length}: its perplexity rises past the training length; "
                f"set model.interdomain.dt_min={2 / seq_length:.2g} (2 / seq_length) or more to extrapolate")


@dataclass
class NatsOptions:
    """Options of the NAtS-L family (`N`, `G`); set as `model.nats.<field>=...` (megahybrid/model/mixers/nats.py).

    The GDN view has `gdn_heads` heads of q/k width `gdn_head_dim` (K) and value width `expand_v * K` (V); the
    `N` layer's attention view splits the same q, k, v channels into `attention_heads` heads. `selection`:
    "argmax" (straight-through) or "gumbel" (Gumbel-softmax, hard, in training). `kept_fraction` is the share of
    chunks assumed kept by attention in the FLOP, decode-state and context-parallel counts (1.0 = every chunk, the
    worst case; the CP counts read it as the share of the most-keeping head).
    """

    gdn_heads: int = 6
    gdn_head_dim: int = 128
    expand_v: int = 2
    attention_heads: int = 12
    conv_size: int = 4
    selection: str = "argmax"
    kept_fraction: float = 1.0
    # the GDN op over each sequence cut into this many segments of whole chunks, run side by side (exact; the op then
    # carries K + V value columns: megahybrid/model/mixers/gdn_segments.py); 1 = the whole sequence at once
    gdn_segments: int = 1

    @property
    def gdn_value_dim(self) -> int:
        return self.expand_v * self.gdn_head_dim

    @property
    def attn_qk_dim(self) -> int:
        return self.gdn_heads * self.gdn_head_dim // self.attention_heads

    @property
    def attn_v_dim(self) -> int:
        return self.gdn_heads * self.gdn_value_dim // self.attention_heads

    def validate(self) -> None:
        for name in ("gdn_heads", "gdn_head_dim", "expand_v", "attention_heads", "conv_size", "gdn_segments"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.nats.{name}={getattr(self, name)} must be >= 1")
        if self.attention_heads % self.gdn_heads:
            raise ConfigError(f"model.nats.attention_heads={self.attention_heads} must be a multiple of "
                              f"model.nats.gdn_heads={self.gdn_heads} (each attention head views one GDN head)")
        if self.gdn_head_dim % (self.attention_heads // self.gdn_heads):
            raise ConfigError(f"model.nats.gdn_head_dim={self.gdn_head_dim} must split into "
                              f"{self.attention_heads // self.gdn_heads} attention heads per GDN head")
        if self.selection not in ("argmax", "gumbel"):
            raise ConfigError(f"model.nats.selection={self.selection!r}: choose 'argmax' or 'gumbel'")
        if not 0.0 <= self.kept_fraction <= 1.0:
            raise ConfigError(f"model.nats.kept_fraction={self.kept_fraction} must be in [0, 1]")


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
    # Activation recomputation: "none"; "selective" recomputes the `recompute_modules` of each layer (core_attn,
    # mlp; default core_attn; megatron-core's recompute_granularity); "full" recomputes whole layers, every layer
    # or the first `recompute_num_layers` when given (torch.utils.checkpoint per layer: gpt.recompute_layers).
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
        for char in dict.fromkeys(self.pattern):
            mixer_for(char)
        if set(self.pattern) & {"I", "D"}:
            self.interdomain.check(self.hidden_size, self.head_dim)
        if set(self.pattern) & set("NG"):
            self.nats.validate()
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
        first = dataclasses.fields(cls)[0].name
        raise ConfigError(f"model.{name} must be a mapping of fields, e.g. model.{name}.{first}=...")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown model.{name} field(s) {unknown}; known: {sorted(known)}")
    return dataclasses.replace(current, **value)


NATSL_HYBRID = "".join("N" if i in (3, 7, 11, 15, 19, 20) else "G" for i in range(21))

# Llama proportions; parameter counts (vocab 32000, untied) are in docs and checked by tests/test_model.py.
PRESETS: dict[str, ModelConfig] = {
    # `N` / `G` on the tiny model: 2 GDN heads x 32 (V = 64), 4 attention heads of q/k 16, v 32.
    "tiny": ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=512, seq_length=128,
                        nats=NatsOptions(gdn_heads=2, gdn_head_dim=32, attention_heads=4)),
    "125m": ModelConfig(num_layers=12, hidden_size=768, num_heads=12, vocab_size=32000, seq_length=4096),
    "350m": ModelConfig(num_layers=24, hidden_size=1024, num_heads=16, vocab_size=32000, seq_length=4096),
    "760m": ModelConfig(num_layers=24, hidden_size=1536, num_heads=12, vocab_size=32000, seq_length=4096),
    "1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=32000, seq_length=4096),
    # The NAtS-L reference's shipped configs (automl/NeuralAttentionSearchLinear experiments/configs): the
    # Hybrid layout, `G` layers with `N` at layers 3, 7, 11, 15, 19, 20. num_heads is for an `S` of the same size.
    "natsl-340m": ModelConfig(num_layers=21, hidden_size=1024, num_heads=16, ffn_hidden_size=2816, vocab_size=32000,
                              seq_length=4096, pattern=NATSL_HYBRID, norm_eps=1e-6,
                              nats=NatsOptions(gdn_heads=6, gdn_head_dim=128, attention_heads=12)),
    "natsl-760m": ModelConfig(num_layers=21, hidden_size=1536, num_heads=12, ffn_hidden_size=4096, vocab_size=32000,
                              seq_length=4096, pattern=NATSL_HYBRID, norm_eps=1e-6,
                              nats=NatsOptions(gdn_heads=6, gdn_head_dim=192, attention_heads=18)),
}


def _paper_presets() -> dict[str, ModelConfig]:
    """The Interdomain paper's models (arXiv 2605.24330, Table 3): head dim 64 everywhere, SwiGLU width 2/3 * 4d
    rounded up to a multiple of 128; `-paper` is its softmax baseline, `-interdomain` all `I`, `-s4d` all `D`."""
    out = {}
    for size, layers, d in (("125m", 12, 768), ("350m", 24, 1024), ("760m", 24, 1536), ("1.3b", 24, 2048)):
        base = ModelConfig(num_layers=layers, hidden_size=d, num_heads=d // 64, vocab_size=32000,
                           seq_length=4096, ffn_hidden_size=-(-(8 * d // 3) // 128) * 128)
        for suffix, pattern in (("paper", "S"), ("interdomain", "I"), ("s4d", "D")):
            out[f"{size}-{suffix}"] = dataclasses.replace(base, pattern=pattern)
    return out


PRESETS.update(_paper_presets())


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else dataclasses.replace(PRESETS[name])


def count_parameters(cfg: ModelConfig) -> int:
    """Analytic parameter count (norm weights included), independent of parallelism: each layer's mixer from its
    record (megahybrid.model.mixers), plus the SwiGLU MLP, two norms per layer, embeddings and the final norm."""
    d = cfg.hidden_size
    per_layer_rest = 3 * d * cfg.ffn_size + 2 * d
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return mixer_params(cfg) + cfg.num_layers * per_layer_rest + embeddings + d
