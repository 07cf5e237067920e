"""Model config, presets, layer pattern and parallel layout validation (single process)."""
import pytest

from megahybrid.errors import ConfigError, LayoutError
from megahybrid.model.config import PRESETS, ModelConfig, count_parameters, preset
from megahybrid.model.mixers import MIXERS, check_context_parallel, mixer_for, state_floats
from megahybrid.model.specs import block_spec
from megahybrid.parallel import ParallelLayout

# Parameter counts (vocab 32000, untied embeddings) stated in README.md.
EXPECTED_PARAMS_M = {"125m": 134, "350m": 374, "760m": 778, "1.3b": 1364}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS_M))
def test_preset_parameter_counts(name):
    assert round(count_parameters(PRESETS[name]) / 1e6) == EXPECTED_PARAMS_M[name]


def test_tiny_model_builds_with_counted_parameters():
    from tests.dist import run_on_ranks

    built, counted = run_on_ranks(_build_tiny, 1)[0]
    assert built == counted


def _build_tiny(rank, world):
    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.gpt import build_model

    cfg = preset("tiny")
    model = build_model(cfg, init_distributed(ParallelLayout()).layout)
    shutdown()
    return sum(p.numel() for p in model.parameters()), count_parameters(cfg)


def test_transformer_config_builds_without_warnings():
    """Every model build (training, decoding, conversion) makes this config: megatron's own default
    cuda_graph_scope="full" warned that it is deprecated each time (what `megahybrid generate` printed)."""
    import warnings

    from megahybrid.model.gpt import transformer_config

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert transformer_config(preset("tiny"), ParallelLayout.for_world(1)).cuda_graph_scope == []


def test_pattern_tiles_layers():
    cfg = ModelConfig(num_layers=8, pattern="SSSS")
    assert cfg.layer_pattern == "S" * 8
    assert len(block_spec(cfg).layer_specs) == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pattern="SX"), "unknown mixer 'X'"),
        (dict(pattern="SSS", num_layers=4), "does not tile"),
        (dict(hidden_size=65), "not divisible by model.num_heads"),
        (dict(num_kv_heads=3), "must divide model.num_heads"),
        (dict(pattern=""), "pattern is empty"),
        (dict(vocab_size=0), "model.vocab_size=0 must be >= 1"),
        (dict(bogus=1), "unknown model field"),
    ],
)
def test_bad_model_config_messages(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preset("tiny", **overrides)


def test_unavailable_mixer_message():
    planned = [c for c, m in MIXERS.items() if m.spec is None]
    for char in planned:
        with pytest.raises(ConfigError, match="not available yet"):
            mixer_for(char)


def test_mixer_records_are_complete():
    """Every available mixer answers what the stack asks of its record, for the presets it can run."""
    cfg = preset("125m")
    for char, mixer in MIXERS.items():
        if mixer.spec is None:
            continue
        assert mixer.char == char and mixer.chunk_size >= 1
        assert mixer.params(cfg) > 0 and mixer.flops(cfg) > 2 * mixer.params(cfg) * 0.99
        assert mixer.state_floats(cfg, 4096) > 0
        assert mixer.spec(cfg).module is not None
        assert (mixer.cp_bytes is not None) == mixer.cp == (mixer.cp_flops is not None)
        if mixer.cp:
            assert mixer.cp_bytes(cfg, 1, 2) == 0 and mixer.cp_bytes(cfg, 2, 2) > 0
            assert mixer.cp_flops(cfg, 1) == 0 and mixer.cp_flops(cfg, 2) >= 0


def test_softmax_state_is_the_kv_cache_and_cp_gate_names_the_mixer(monkeypatch):
    import dataclasses

    cfg = preset("125m")
    assert state_floats(cfg, 1000) == {"S": 2 * cfg.kv_heads * cfg.head_dim * 1000}
    check_context_parallel("S", 2)
    monkeypatch.setitem(MIXERS, "S", dataclasses.replace(MIXERS["S"], cp=False))
    check_context_parallel("S", 1)
    with pytest.raises(ConfigError, match="parallel.cp=2: context parallelism is not available yet for S"):
        check_context_parallel("S", 2)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("7b")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ParallelLayout(tp=0), "must be a positive integer"),
        (lambda: ParallelLayout(pp=2), "pipeline parallelism is not supported"),
        (lambda: ParallelLayout(sequence_parallel=True), "needs tp > 1"),
        (lambda: ParallelLayout.for_world(6, tp=4), "not divisible by tp\\*cp\\*pp"),
        (lambda: ParallelLayout(tp=2, dp=2).check_world(3), "but 3 ranks were launched"),
        (lambda: ParallelLayout(tp=3).check_model(4, 4, 128), "num_heads=4 is not divisible by tp=3"),
        (lambda: ParallelLayout(tp=4).check_model(8, 2, 128), "num_kv_heads=2 is not divisible by tp=4"),
        (lambda: ParallelLayout(cp=2).check_model(4, 4, 160, chunk_size=64), "multiple of 128"),
    ],
)
def test_bad_layout_messages(build, message):
    with pytest.raises(LayoutError, match=message):
        build()


def test_layout_derives_dp():
    layout = ParallelLayout.for_world(8, tp=2, cp=2)
    assert (layout.tp, layout.cp, layout.dp, layout.world_size) == (2, 2, 2, 8)
