"""`N` (NAtS-L) and `G` (Gated DeltaNet) layers: records, cache sizes, training signal through the selection,
telemetry, and `megahybrid train` under ZeRO-1/2/3 x TP (decoding: tests/layers/test_decode.py)."""
import pytest

from megahybrid.errors import ConfigError
from megahybrid.model.config import PRESETS, count_parameters, preset
from megahybrid.model.mixers import MIXERS, state_floats
from megahybrid.model.mixers.nats import cache_bytes
from tests.dist import run_on_ranks



@pytest.fixture
def cpu_ops(monkeypatch):
    """The ops' torch CPU paths (spawned ranks inherit it; the Triton interpreter is for the op tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_natsl_presets_and_records():
    cfg = PRESETS["natsl-340m"]
    assert cfg.pattern == "GGGNGGGNGGGNGGGNGGGNN" and cfg.num_layers == 21
    assert (cfg.nats.attn_qk_dim, cfg.nats.attn_v_dim) == (64, 128)
    big = PRESETS["natsl-760m"].nats
    assert (big.gdn_head_dim, big.gdn_value_dim, big.attn_qk_dim, big.attn_v_dim) == (192, 384, 64, 128)
    for name in ("natsl-340m", "natsl-760m"):
        counts = {p: count_parameters(PRESETS[name].replace(pattern=p)) for p in ("N", "G", PRESETS[name].pattern)}
        assert counts["G"] < counts[PRESETS[name].pattern] < counts["N"]
    for char in "NG":
        mixer = MIXERS[char]
        assert mixer.chunk_size == 64 and mixer.cp and mixer.cache and mixer.gpu_compile
        assert mixer.cp_bytes(cfg, 2, 2) > 0
    # G's state does not grow with the context; N's grows with the kept chunks only.
    g8, g128 = (state_floats(cfg, n)["G"] for n in (8192, 131072))
    assert g8 == g128 > 0
    none_kept = cfg.replace(nats={"kept_fraction": 0.0})
    assert state_floats(none_kept, 8192)["N"] == state_floats(none_kept, 131072)["N"]


def test_cache_bytes_against_a_full_kv_cache():
    cfg = PRESETS["natsl-340m"]
    for context in (8192, 131072):
        full = cache_bytes(cfg, context)
        assert full["S"] == 2 * 2 * cfg.num_heads * cfg.head_dim * context
        # every chunk kept: the attention view's K/V (12 heads x (64 + 128)) plus the states
        assert full["N"] > 2 * 12 * (64 + 128) * context
        tenth = cache_bytes(cfg.replace(nats={"kept_fraction": 0.1}), context)
        assert tenth["G"] < tenth["N"] < full["S"] / 5


@pytest.mark.parametrize("nats, message", [
    ({"attention_heads": 5}, "multiple of model.nats.gdn_heads"),
    ({"selection": "soft"}, "choose 'argmax' or 'gumbel'"),
    ({"kept_fraction": 2.0}, "must be in \\[0, 1\\]"),
    ({"gdn_segments": 0}, "model.nats.gdn_segments=0 must be >= 1"),
])
def test_bad_nats_options(nats, message):
    with pytest.raises(ConfigError, match=message):
        preset("tiny", pattern="NG", nats=nats)


def _layer_checks(rank, world):
    import torch

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.gpt import build_model, lm_loss
    from megahybrid.parallel import ParallelLayout
    from megahybrid.train.metrics import model_metrics

    layout = init_distributed(ParallelLayout()).layout
    out = {"counts": {}}
    for pattern in ("NG", "GNS"):
        cfg = preset("tiny", pattern=pattern, num_layers=len(pattern))
        model = build_model(cfg, layout)
        out["counts"][pattern] = (sum(p.numel() for p in model.parameters()), count_parameters(cfg))
    cfg = preset("tiny", pattern="NG", seq_length=192)
    init_distributed(ParallelLayout(), seed=7)  # the model and tokens of tests/layers/test_decode.py
    model = build_model(cfg, layout)
    tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(3))
    lm_loss(model, tokens, tokens, torch.ones_like(tokens)).backward()
    out["metrics"] = model_metrics(model)
    layer = model.decoder.layers[0].self_attention
    score_rows = layer.proj.weight.grad.view(layer.H, sum(layer.widths), -1)[:, -2:]
    out["score_grad"] = score_rows.norm().item()
    out["finite"] = all(torch.isfinite(p.grad).all() for p in model.parameters())
    shutdown()
    return out


@pytest.mark.dist
def test_tiny_layers_build_learn_and_select(cpu_ops):
    """Decoding is checked with every mixer in tests/layers/test_decode.py, on this model and sequence length,
    where this test makes sure the selections are mixed (some chunks attention, some GDN)."""
    result = run_on_ranks(_layer_checks, 1)[0]
    for pattern, (built, counted) in result["counts"].items():
        assert built == counted, pattern
    assert result["finite"] and result["score_grad"] > 0, "no straight-through gradient reaches the score layer"
    metrics = result["metrics"]
    kept = metrics["decoder.layers.0.self_attention/kept_attention"]
    assert 0 < kept < 1, f"the test needs mixed selections, got kept fraction {kept}"
    merge = [metrics[f"decoder.layers.0.self_attention/merge_weight_{b}"] for b in ("attention", "gdn")]
    assert sum(merge) == pytest.approx(1.0, rel=1e-5) and "decoder.layers.1.self_attention/kept_attention" not in metrics


ZERO_VARIANTS = {"zero1": {}, "zero2": {"train.deepspeed_config": "zero2"}, "zero3": {"train.deepspeed_config": "zero3"}}
ZERO_TP_VARIANTS = {"zero1_tp2": {"parallel.tp": 2},
                    "zero3_tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True,
                                     "train.deepspeed_config": "zero3"}}
NG_RUN = {"model.pattern": "NG", "model.seq_length": 64, "batch.global_batch_size": 4}


@pytest.mark.dist
def test_megahybrid_train_ng_under_zero_and_tp(tmp_path, cpu_ops):
    from tests.test_train_zero import LOSS_TOL, _train_variants

    from megahybrid.data.builtin import prepare_builtin

    data_dir = str(tmp_path / "builtin")
    prepare_builtin(data_dir, vocab_size=512, num_docs=2000)
    with_ng = lambda variants: {k: {**NG_RUN, **v} for k, v in variants.items()}  # noqa: E731
    single = run_on_ranks(_train_variants, 1, str(tmp_path / "one"), data_dir, with_ng(ZERO_VARIANTS))[0]
    reference = single["zero1"]
    assert all(x == x for x in reference) and reference[-1] < reference[0], reference
    two = run_on_ranks(_train_variants, 2, str(tmp_path / "two"), data_dir, with_ng(ZERO_TP_VARIANTS))
    for name, losses in [*single.items(), *(item for rank in two for item in rank.items())]:
        assert losses == pytest.approx(reference, rel=LOSS_TOL), f"{name}: {losses} vs {reference}"
