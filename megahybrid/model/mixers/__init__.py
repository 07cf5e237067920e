"""Token mixers: one record per pattern character, read by the whole stack.

Each mixer family has its own module here (as flash-linear-attention's `fla/layers/`): `softmax.py` (`S`), and the
Interdomain (`I`, `D`) and NAtS-L (`N`, `G`) families with their layer issues. A mixer's `Mixer` record is the one
place that says what the stack needs to know about it: the megatron-core spec of its module, the chunk its
kernels need, its parameter and FLOP counts and recurrent-state size as functions of the model config, whether
context parallelism covers it and what it caches for decoding. Adding a mixer = its module, its record in
`MIXERS`, and its pattern in the parallel-equivalence test.
"""
from dataclasses import dataclass
from typing import Callable

from megahybrid.errors import ConfigError


@dataclass(frozen=True)
class Mixer:
    """What the stack knows about one mixer kind. `cfg` is a megahybrid.model.config.ModelConfig.

    spec(cfg): the megatron-core ModuleSpec of the mixer (the decoder layer's `self_attention` submodule), or
        None while the mixer is planned (then `issue` names where it lands).
    params(cfg): parameters of one layer's mixer (its input norm excluded; it belongs to the decoder layer).
    flops(cfg): forward FLOPs per token of one layer's mixer at cfg.seq_length (matmuls and the token-mixing core).
    state_floats(cfg, context): floats one sequence keeps per layer for decoding after `context` tokens (the KV
        cache for softmax, the fixed recurrent state for the recurrent mixers).
    cp: context parallelism (parallel.cp > 1) is implemented for it.
    cp_bytes(cfg, cp, element_bytes): bytes one CP rank sends per layer, per sequence and training step
        (forward + backward, ring collectives), or None where cp is False.
    cp_flops(cfg, cp): forward FLOPs per token of one layer's mixer that context parallelism adds on its last
        rank to those tokens' own work: the state-passing pass (shard summaries, prefix combine, output
        corrections) and padded work; not the attention imbalance of contiguous shards. None where cp is False.
    cache: the name of its decode cache type ("" if none).
    gpu_compile: torch.compile of this mixer's own module pays on a GPU (measured per mixer); where False, a
        compiled model keeps the mixer's module eager (megahybrid.train.trainer.compile_model).
    """

    char: str
    name: str
    spec: Callable | None
    params: Callable
    flops: Callable
    state_floats: Callable
    chunk_size: int = 1
    cp: bool = False
    cp_bytes: Callable | None = None
    cp_flops: Callable | None = None
    cache: str = ""
    issue: str = ""
    gpu_compile: bool = True


def _planned(char: str, name: str, issue: str) -> Mixer:
    def unavailable(*_):
        raise ConfigError(f"mixer {char!r} ({name}) is not available yet; it lands with {issue}")

    return Mixer(char, name, None, unavailable, unavailable, unavailable, chunk_size=64, issue=issue)


def _registry() -> dict[str, Mixer]:
    # The mixer modules import torch and megatron (config checks need neither) and import `Mixer` from here.
    from megahybrid.model.mixers.interdomain import INTERDOMAIN, S4D
    from megahybrid.model.mixers.nats import GATED_DELTANET, NATSL
    from megahybrid.model.mixers.softmax import SOFTMAX

    mixers = [
        SOFTMAX,
        INTERDOMAIN,
        S4D,
        NATSL,
        GATED_DELTANET,
    ]
    return {m.char: m for m in mixers}


MIXERS: dict[str, Mixer] = _registry()


def mixer_for(char: str) -> Mixer:
    """The record of an available mixer; a one-line ConfigError for unknown or planned ones."""
    if char not in MIXERS:
        raise ConfigError(f"model.pattern has unknown mixer {char!r}; known: {', '.join(MIXERS)}")
    mixer = MIXERS[char]
    if mixer.spec is None:
        raise ConfigError(
            f"model.pattern mixer {char!r} ({mixer.name}) is not available yet (it lands with {mixer.issue}); "
            f"available: {', '.join(c for c, m in MIXERS.items() if m.spec is not None)}"
        )
    return mixer


def max_chunk_size(pattern: str) -> int:
    return max(mixer_for(c).chunk_size for c in set(pattern))


def check_context_parallel(pattern: str, cp: int) -> None:
    """parallel.cp > 1 needs every mixer of the pattern to implement context parallelism."""
    if cp == 1:
        return
    missing = [f"{c} ({mixer_for(c).name})" for c in dict.fromkeys(pattern) if not mixer_for(c).cp]
    if missing:
        raise ConfigError(
            f"parallel.cp={cp}: context parallelism is not available yet for {', '.join(missing)}; set parallel.cp=1"
        )


def eager_mixers(pattern: str) -> str:
    """The pattern's mixer characters that a compiled model keeps eager, each once: those measured slower compiled
    than eager on the H200 (torch 2.11, tools/bench_train.py --compile all against eager, issue #15). Every mixer
    compiles and matches eager there (tools/compile_bisect.py) since parameters stay 16-byte aligned under ZeRO
    (megahybrid.train.engine.param_groups)."""
    return "".join(c for c in dict.fromkeys(pattern) if not mixer_for(c).gpu_compile)


def cp_bytes_per_layer(cfg, cp: int, element_bytes: int) -> dict[str, int]:
    """What each mixer kind of the pattern sends per CP rank, layer, sequence and training step."""
    return {c: mixer_for(c).cp_bytes(cfg, cp, element_bytes) for c in dict.fromkeys(cfg.pattern)}


def cp_flops_per_layer(cfg, cp: int) -> dict[str, float]:
    """What context parallelism adds to each mixer kind's forward FLOPs per token on the last CP rank."""
    return {c: mixer_for(c).cp_flops(cfg, cp) for c in dict.fromkeys(cfg.pattern)}


def mixer_params(cfg) -> int:
    """Mixer parameters summed over the layer stack."""
    return sum(mixer_for(c).params(cfg) for c in cfg.layer_pattern)


def mixer_flops(cfg) -> float:
    """Forward mixer FLOPs per token summed over the layer stack."""
    return sum(mixer_for(c).flops(cfg) for c in cfg.layer_pattern)


def state_floats(cfg, context: int) -> dict[str, int]:
    """Decode-state floats per sequence of one layer of each mixer kind in the pattern, after `context` tokens."""
    return {c: mixer_for(c).state_floats(cfg, context) for c in dict.fromkeys(cfg.pattern)}
