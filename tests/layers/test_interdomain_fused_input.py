"""The `I` layer with model.interdomain.fused_input on (kernels/interdomain_input) against the same layer with it off:
the model's loss and every parameter gradient, and the input path alone continuing from a conv tail at an offset
(decoding's prefill continuation and a context-parallel shard pass both), with the tail's gradient. CPU: the kernels
run in Triton's interpreter (fp32), tiny preset, one gloo launch."""
import torch

from tests.dist import run_on_ranks

TOL = 1e-5  # fp32 relative RMS: the same math, the fused kernels sum in another order


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run(model, mixer, fused, tokens, alone=True):
    """Loss and parameter gradients of the model, then (alone) the first layer's input path from a tail at offset
    50."""
    from megahybrid.model.mixers.interdomain import InterdomainMixer

    for m in model.modules():
        if isinstance(m, InterdomainMixer):
            m.inputs.fused = fused
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, position_ids=None, attention_mask=None, labels=tokens).mean()
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    if not alone:
        return out
    gen = torch.Generator().manual_seed(2)
    inputs = mixer.inputs
    hidden = torch.randn(13, 2, 64, generator=gen).requires_grad_()
    tail = torch.randn(2, 3, inputs.dims.n_local * inputs.conv_width, generator=gen).requires_grad_()
    model.zero_grad(set_to_none=True)
    parts, new_tail = inputs(hidden, tail, 50)
    outs = [*parts.values(), new_tail]
    sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs).backward()
    out.update({f"input {k}": v.detach() for k, v in zip([*parts, "new tail"], outs)})
    out.update({"input d_hidden": hidden.grad, "input d_tail": tail.grad})
    out.update({f"input d{n}": p.grad.clone() for n, p in inputs.named_parameters() if p.grad is not None})
    return out


def _fused_against_unfused(rank, world):
    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model
    from megahybrid.model.mixers.interdomain import InterdomainMixer
    from megahybrid.parallel import ParallelLayout

    layout = init_distributed(ParallelLayout()).layout
    built = {}
    for variant in ("full", "generic-query"):
        cfg = preset("tiny", pattern="I", num_layers=2, interdomain={"modes": 8, "variant": variant,
                                                                     "fused_input": True})
        torch.manual_seed(0)
        model = build_model(cfg, layout)
        mixers = [m for m in model.modules() if isinstance(m, InterdomainMixer)]
        built[variant] = [m.inputs.fused for m in mixers]
    tokens = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    cfg = preset("tiny", pattern="I", num_layers=2, interdomain={"modes": 8, "fused_input": True})
    torch.manual_seed(0)
    model = build_model(cfg, layout)
    mixer = next(m for m in model.modules() if isinstance(m, InterdomainMixer))
    fused, plain = _run(model, mixer, True, tokens), _run(model, mixer, False, tokens)
    shutdown()
    assert fused.keys() == plain.keys()
    return built, {k: _rel(fused[k], plain[k]) for k in plain}


def test_fused_input_matches_the_unfused_layer():
    built, errors = run_on_ranks(_fused_against_unfused, 1)[0]
    assert built == {"full": [True, True], "generic-query": [False, False]}  # only the dual input with query fuses
    print(" ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert any(k.startswith("input d") and "conv" in k for k in errors) and "input d_tail" in errors
    assert all(v <= TOL for v in errors.values()), {k: v for k, v in errors.items() if v > TOL}


def _fused_against_unfused_tp(rank, world):
    """The same comparison of the model's loss and gradients with heads split over two TP ranks and sequence
    parallelism (each rank's kernels see its heads and its norm weights' shards)."""
    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model
    from megahybrid.model.mixers.interdomain import InterdomainMixer
    from megahybrid.parallel import ParallelLayout

    layout = init_distributed(ParallelLayout(tp=2, sequence_parallel=True)).layout
    cfg = preset("tiny", pattern="I", num_layers=2, interdomain={"modes": 8, "fused_input": True})
    torch.manual_seed(0)
    model = build_model(cfg, layout)
    mixer = next(m for m in model.modules() if isinstance(m, InterdomainMixer))
    tokens = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    fused, plain = (_run(model, mixer, f, tokens, alone=False) for f in (True, False))
    shutdown()
    return {k: _rel(fused[k], plain[k]) for k in plain}


def test_fused_input_matches_the_unfused_layer_under_tp2_sp():
    for errors in run_on_ranks(_fused_against_unfused_tp, 2):
        assert any("norm" in k for k in errors), sorted(errors)
        assert all(v <= TOL for v in errors.values()), {k: v for k, v in errors.items() if v > TOL}
