"""model.nats.gdn_segments: the selected GDN op over a sequence cut into segments that run side by side
(megahybrid/model/mixers/gdn_segments.py) against the op over the whole sequence, output, final state and every
gradient (the keep masks' straight-through gradient included), then the `N` / `G` layers with it on."""
import pytest
import torch

from megahybrid.model.mixers.gdn_segments import segmented_gdn
from megahybrid_kernels.nats import chunk_selected_gdn
from tests.kernels.test_nats_gdn import make_inputs
from tests.utils import assert_close, requires_gpu

TOL = 2e-6  # fp32 relative RMS: the segments' start states come from products of the op's summaries (measured <= 5e-7)
MODEL_TOL = 2e-5  # the same through a 2-layer model's gradients (measured <= 3.4e-6, A_log of the `G` layer)


def _run(fn, inputs, with_state):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    o, ht = fn(*xs[:6], initial_state=xs[6] if with_state else None, output_final_state=True, use_qk_l2norm=True)
    gen = torch.Generator().manual_seed(5)
    noise = lambda t: torch.randn(t.shape, generator=gen).to(t.device)  # noqa: E731
    loss = (o.float() * noise(o)).sum() + (ht * noise(ht)).sum()
    loss.backward()
    return o, ht, [x.grad for x in xs[:7 if with_state else 6]]


@pytest.mark.parametrize("T, segments, with_state", [(300, 3, True), (320, 2, False), (640, 4, True),
                                                     (100, 8, True), (63, 4, False)])
def test_segments_match_the_whole_sequence(T, segments, with_state, monkeypatch):
    """The op's torch path (what CPU training runs); T = 300 leaves a partial chunk and a padded last segment,
    T = 100 with 8 asked gives 2 segments of one chunk, T = 63 one segment (the op as is)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = make_inputs(2, T, 2, 16, 24)
    inputs[0], inputs[1] = inputs[0] * 3, inputs[1] * 3  # not unit norm: use_qk_l2norm has work to do
    o, ht, grads = _run(lambda *a, **kw: segmented_gdn(*a, segments=segments, **kw), inputs, with_state)
    ro, rht, rgrads = _run(chunk_selected_gdn, inputs, with_state)
    assert_close(o, ro, TOL, "o")
    assert_close(ht, rht, TOL, "final state")
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dkeep", "dh0"), grads, rgrads):
        assert_close(a, r, TOL, name)


def _layer_runs(rank, world):
    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model import decode
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model, lm_loss
    from megahybrid.parallel import ParallelLayout

    tokens = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(3))
    out = {}
    for segments in (1, 3):
        cfg = preset("tiny", pattern="NG", seq_length=192, nats={"gdn_segments": segments})
        init_distributed(ParallelLayout(), seed=7)
        model = build_model(cfg, ParallelLayout())
        loss = lm_loss(model, tokens, tokens, torch.ones_like(tokens))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.eval()
        with torch.no_grad():
            prefill = decode.prefill_then_decode(model, tokens, prefill=140)
        out[segments] = (loss.item(), grads, prefill, model.decoder.layers[0].self_attention.gdn_segments)
    shutdown()
    return out


@pytest.mark.dist
def test_layers_with_segments_train_and_prefill_as_without(monkeypatch):
    """A tiny `NG` model with model.nats.gdn_segments=3 (150 tokens: 3 chunks in segments of one, the rest open):
    the same loss and every gradient as with 1, and a 140-token prefill (segmented) then decoding gives the same
    logits."""
    from tests.dist import run_on_ranks

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    r = run_on_ranks(_layer_runs, 1)[0]
    (loss1, grads1, prefill1, seg1), (loss3, grads3, prefill3, seg3) = r[1], r[3]
    assert (seg1, seg3) == (1, 3)
    assert abs(loss3 - loss1) <= 1e-6 * abs(loss1)
    for name in grads1:
        assert_close(grads3[name], grads1[name], MODEL_TOL, name)
    assert_close(prefill3, prefill1, TOL, "prefill then decode logits")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_segments_on_gpu_at_the_prefill_heads(dtype, tol, monkeypatch):
    """natsl-340m's GDN heads (K = 128, V = 256: the op then runs V = 384) over 8K + 37 tokens in 8 segments
    against the whole sequence in fp32, output, final state and every gradient (bf16: the segments' start states
    are read out on TF32). fp32 runs the kernels' products in IEEE fp32: with their default TF32 the two runs round
    differently (final state 3.2e-4 apart on the H200 at 1440cd6, each within the op's 1e-2 of its reference), which
    would hide the segments' own error."""
    if dtype == torch.float32:
        monkeypatch.setenv("MEGAHYBRID_FP32_DOT", "ieee")
    inputs = make_inputs(1, 8192 + 37, 6, 128, 256, device="cuda", g_scale=16.0)
    cast = [x.to(dtype) if i in (0, 1, 2, 4) else x for i, x in enumerate(inputs)]
    o, ht, grads = _run(lambda *a, **kw: segmented_gdn(*a, segments=8, **kw), cast, True)
    ro, rht, rgrads = _run(chunk_selected_gdn, inputs, True)
    assert_close(o, ro, tol, "o")
    assert_close(ht, rht, tol, "final state")
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dkeep", "dh0"), grads, rgrads):
        assert_close(a, r, 2 * tol, name)
