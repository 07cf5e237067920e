"""NAtS-L attention under context parallelism: each rank attends over the compacted kept chunks of the earlier
shards, then its own shard (megahybrid/model/mixers/nats.py, `_shard_attention`). Checked against the op on the
whole sequence: outputs and the gradients of q, k, v and keep (the straight-through selection gradient), with
shards that keep about a quarter of their chunks, none, or all; and the bytes the gathers send."""
import pytest
import torch

# Imported while conftest's TRITON_INTERPRET=1 holds, so the kernels are built for the interpreter even when a
# torch-path test (TRITON_INTERPRET=0, read per call) runs first.
from megahybrid_kernels.nats import chunk_selected_attention
from tests.dist import run_on_ranks
from tests.utils import assert_close, requires_gpu

TOL = 1e-5  # fp32, the same keys summed in another order
B, H, DK, DV, S = 2, 3, 16, 8, 256  # S: one shard, 4 chunks of 64


def _keep(cp: int, kind: str, seed: int = 0) -> torch.Tensor:
    """Keep decisions [B, H, cp * S / 64] per shard: "quarter" keeps 1 random chunk of 4 per (batch, head, shard);
    "edges" keeps none on shard 0 and all on shard 1 (quarter elsewhere); "none" keeps nothing anywhere."""
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for r in range(cp):
        scores = torch.rand(B, H, S // 64, generator=gen)
        shard = (scores >= scores.topk(1, -1).values[..., -1:]).float()
        if kind == "none" or (kind == "edges" and r < 2):
            shard.fill_(float(r == 1 and kind == "edges"))
        shards.append(shard)
    return torch.cat(shards, -1)


def _inputs(cp: int, kind: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(1)
    T = cp * S
    q, k = (torch.randn(B, T, H, DK, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=gen)
    weight = torch.randn(B, T, H, DV, generator=gen)
    return [x.to(device) for x in (q, k, v, _keep(cp, kind), weight)]


def _reference(q, k, v, keep, weight):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, keep)]
    o = chunk_selected_attention(*leaves, scale=DK ** -0.5)
    (o * weight).sum().backward()
    return o.detach(), [x.grad for x in leaves]


def _emulated(q, k, v, keep, weight, cp):
    """Every rank's part on one process: the compaction and the prefix op of `_shard_attention`, with the
    all-gather replaced by a concatenation of the earlier shards' compacted pieces."""
    from megahybrid.model.mixers.nats import attend_after_prefix, compact_kept_chunks

    leaves = [x.clone().requires_grad_() for x in (q, k, v, keep)]
    shard = lambda x, r, dim: x.narrow(dim, r * x.shape[dim] // cp, x.shape[dim] // cp)  # noqa: E731
    slots = max(1, int(max((shard(keep, r, 2) == 1).sum(-1).max() for r in range(cp))))
    pieces = [compact_kept_chunks(torch.cat([shard(leaves[1], r, 1), shard(leaves[2], r, 1)], -1),
                                  shard(leaves[3], r, 2), slots) for r in range(cp)]
    outs = []
    for r in range(cp):
        kv = torch.cat([p[0] for p in pieces[:r]] + [pieces[0][0][:, :0]], 1)
        kept = torch.cat([p[1] for p in pieces[:r]] + [pieces[0][1][..., :0]], -1)
        outs.append(attend_after_prefix(*(shard(x, r, d) for x, d in zip(leaves, (1, 1, 1, 2))),
                                        *kv.split([DK, DV], -1), kept, DK ** -0.5))
    o = torch.cat(outs, 1)
    (o * weight).sum().backward()
    return o.detach(), [x.grad for x in leaves], slots


def _compare(got, want, where):
    assert_close(got[0], want[0], TOL, f"{where} output")
    for name, g, w in zip("q k v keep".split(), got[1], want[1]):
        assert_close(g, w, TOL, f"{where} d{name}")


@pytest.mark.parametrize("kind", ["quarter", "edges", "none"])
def test_compacted_prefix_matches_whole_sequence(kind, monkeypatch):
    """The torch path of the op (a CPU training run's), 3 emulated ranks."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = _inputs(3, kind)
    *got, slots = _emulated(*inputs, cp=3)
    _compare(got, _reference(*inputs), kind)
    assert slots == {"quarter": 1, "edges": 4, "none": 1}[kind]
    earlier = inputs[3][..., :-(S // 64)]  # the keep gradient reaches the kept chunks of earlier shards
    assert (got[1][3][..., :-(S // 64)] * earlier).abs().sum() > 0 or kind == "none"


@pytest.mark.parametrize("kind", ["quarter", "edges"])
def test_compacted_prefix_in_the_triton_kernels(kind, monkeypatch):
    """The Triton kernels (interpreted on the CPU; the GPU test below runs them compiled), 2 emulated ranks."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    inputs = _inputs(2, kind)
    _compare(_emulated(*inputs, cp=2)[:2], _reference(*inputs), kind)


@pytest.mark.gpu
@requires_gpu
def test_compacted_prefix_on_gpu():
    inputs = _inputs(4, "edges", "cuda")
    _compare(_emulated(*inputs, cp=4)[:2], _reference(*inputs), "gpu")


def _shard_checks(rank, world, kinds):
    """The real `_shard_attention` on gloo ranks for each keep kind: this rank's output and gradients, and the
    bytes each gather sent (recorded around nats.gather_sequence)."""
    import os

    import torch.distributed as dist

    from megahybrid.model.mixers import nats

    os.environ["TRITON_INTERPRET"] = "0"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sent = []
    gather = nats.gather_sequence
    nats.gather_sequence = lambda x, dim, group: sent.append(x.numel() * x.element_size()) or gather(x, dim, group)
    out = {}
    for kind in kinds:
        sent.clear()
        q, k, v, keep, weight = (x.narrow(d, rank * x.shape[d] // world, x.shape[d] // world)
                                 for x, d in zip(_inputs(world, kind), (1, 1, 1, 2, 1)))
        leaves = [x.clone().requires_grad_() for x in (q, k, v, keep)]
        o = nats._shard_attention(dist.group.WORLD)(*leaves, scale=DK ** -0.5)
        (o * weight).sum().backward()
        out[kind] = (o.detach(), [x.grad for x in leaves], list(sent))
    dist.destroy_process_group()
    return out


@pytest.mark.dist
def test_shard_attention_on_ranks_sends_only_kept_chunks():
    """2 gloo ranks: the whole-sequence results, split by shard; with a quarter of the chunks kept the K/V gather
    sends a quarter of the shard's K/V (1 slot of 4 chunks), with all kept on a rank all 4, with none 1 padding slot."""
    world, kinds = 2, ("quarter", "edges", "none")
    results = run_on_ranks(_shard_checks, world, kinds)
    dense_kv = B * S * H * (DK + DV) * 4
    for kind in kinds:
        o, grads = _reference(*_inputs(world, kind))
        parts = [(r[kind][0], r[kind][1]) for r in results]
        got_o = torch.cat([p[0] for p in parts], 1)
        got_grads = [torch.cat([p[1][i] for p in parts], 2 if i == 3 else 1) for i in range(4)]
        _compare((got_o, got_grads), (o, grads), kind)
        slots = {"quarter": 1, "edges": 4, "none": 1}[kind]
        for r in results:
            assert r[kind][2] == [slots * 64 * dense_kv // S, B * H * slots * 4], (kind, r[kind][2])
    assert results[0]["quarter"][2][0] * 4 == dense_kv


@pytest.mark.parametrize("kept", [0.0, 0.25, 1.0])
def test_cp_bytes_count_the_compacted_pieces(kept):
    """nats_cp_bytes of `N` over `G` (the attention branch's share) at model.nats.kept_fraction is 2 (cp - 1)
    times the pieces compact_kept_chunks builds for a bf16 shard with that share of each head's chunks kept."""
    import dataclasses

    from megahybrid.model.config import preset
    from megahybrid.model.mixers.nats import compact_kept_chunks, nats_cp_bytes

    cfg = preset("tiny", pattern="N", seq_length=1024)
    cfg = dataclasses.replace(cfg, nats=dataclasses.replace(cfg.nats, kept_fraction=kept))
    o, shard, cp = cfg.nats, 512, 2
    x = torch.zeros(1, shard, o.attention_heads, o.attn_qk_dim + o.attn_v_dim, dtype=torch.bfloat16)
    keep = torch.zeros(1, o.attention_heads, shard // 64)
    keep[..., :round(kept * shard // 64)] = 1
    slots = max(1, int((keep == 1).sum(-1).max()))
    piece = sum(t.numel() * t.element_size() for t in compact_kept_chunks(x, keep, slots))
    assert nats_cp_bytes(cfg, cp, 2) - nats_cp_bytes(cfg, cp, 2, select=False) == 2 * (cp - 1) * piece


def test_cp_extra_flops_of_the_state_passing():
    """`G`: the GDN core at value width K + V minus at V, plus the S_0^T o_Phi correction and the prefix products;
    `N` adds the zero queries, which shrink with the kept fraction; the start line prints both kinds."""
    import dataclasses

    from megahybrid.model.config import preset
    from megahybrid.model.mixers.nats import _gdn_core_flops, nats_cp_flops
    from megahybrid.train.trainer import _state_line

    cfg = preset("tiny", pattern="NG", seq_length=1024)
    o, cp = cfg.nats, 4
    H, K, V = o.gdn_heads, o.gdn_head_dim, o.gdn_value_dim
    wide = dataclasses.replace(cfg, nats=dataclasses.replace(o, expand_v=o.expand_v + 1))  # V + K
    prefix = (cp - 1) * 2 * H * K * K * V / (1024 // cp)
    expected = _gdn_core_flops(wide) - _gdn_core_flops(cfg) + 2 * H * K * V + prefix
    assert nats_cp_flops(cfg, cp, select=False) == pytest.approx(expected, rel=1e-12)
    quarter = dataclasses.replace(cfg, nats=dataclasses.replace(o, kept_fraction=0.25))
    zero_queries = [nats_cp_flops(c, cp) - nats_cp_flops(c, cp, select=False) for c in (cfg, quarter)]
    assert zero_queries[1] == pytest.approx(zero_queries[0] / 16)  # P = 3 shards' slots: 4 of 4, then 1 of 4
    line = _state_line(cfg, cp, "bf16")
    assert f"cp_extra_flops_per_token_per_layer=N:{nats_cp_flops(cfg, cp):.0f},G:" in line
