"""The layers skip the ops' value checks, which hold by construction there (`I`'s decay real part -exp(.) exp(.) < 0,
`N`/`G`'s log decay -exp(A_log) softplus(.) <= 0, keep an exact one-hot): on a GPU each check reads a tensor that
is new every step, one host sync per op call. A direct op call still checks. CPU torch paths, one rank."""
import pytest

from tests.dist import run_on_ranks

CHECKS = [("megahybrid_kernels.interdomain.chunk", "check_decay"),
          ("megahybrid_kernels.nats.attention.chunk", "check_keep_values"),
          ("megahybrid_kernels.nats.gdn.chunk", "check_keep_values"),
          ("megahybrid_kernels.nats.gdn.chunk", "check_log_decay")]


def _count_checks(calls):
    import importlib

    for module, name in CHECKS:
        mod = importlib.import_module(module)
        original = getattr(mod, name)

        def counted(*args, _name=f"{module}.{name}", _original=original):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args)

        setattr(mod, name, counted)


def _checks_called(rank, world):
    import torch

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model, lm_loss
    from megahybrid.parallel import ParallelLayout
    from megahybrid_kernels.interdomain import interdomain_attention
    from megahybrid_kernels.nats.gdn import chunk_selected_gdn

    layout = init_distributed(ParallelLayout()).layout
    calls = {}
    _count_checks(calls)
    cfg = preset("tiny", pattern="ING", num_layers=3, interdomain={"modes": 8})
    model = build_model(cfg, layout)
    tokens = torch.randint(0, cfg.vocab_size, (2, 130))
    lm_loss(model, tokens, tokens, torch.ones_like(tokens)).backward()
    layers = dict(calls)
    q = torch.randn(1, 8, 2, 16)
    interdomain_attention(q, q, q, -torch.rand(2, 4, 2), torch.randn(2, 4, 2))
    g = -torch.rand(1, 8, 2)
    chunk_selected_gdn(q, q, q, g, g.neg(), torch.ones(1, 2, 1))
    shutdown()
    return layers, {k: v - layers.get(k, 0) for k, v in calls.items()}


@pytest.mark.dist
def test_layers_skip_the_ops_value_checks(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layers, direct = run_on_ranks(_checks_called, 1)[0]
    assert layers == {}, layers
    assert direct == {"megahybrid_kernels.interdomain.chunk.check_decay": 1,
                      "megahybrid_kernels.nats.gdn.chunk.check_keep_values": 1,
                      "megahybrid_kernels.nats.gdn.chunk.check_log_decay": 1}, direct
