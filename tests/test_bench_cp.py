"""tools/bench_cp.py on CPU: its stand-in CP group drives the real state-passing code of I, G and N layers
(shapes and collectives of the last of cp ranks), and torch.distributed is itself again afterwards."""
import json

import pytest

from tests.dist import run_on_ranks


def _bench(rank, world, results):
    import os
    import sys

    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools import bench_cp

    before = dist.all_gather
    calls = []
    real_gather = bench_cp.nats.gather_sequence

    def counting(x, dim, group):
        calls.append((tuple(x.shape), bench_cp.dist.get_world_size(group)))
        return real_gather(x, dim, group)

    bench_cp.nats.gather_sequence = counting
    code = bench_cp.main(["--models", "tiny@I", "tiny@GN", "--context", "256", "--cps", "2", "4", "--warmup", "0",
                          "--reps", "1", "--results-dir", results])
    return code, dist.all_gather is before, bench_cp.nats.layer_cp_group.__name__, sorted({c[1] for c in calls})


def test_bench_cp_stand_in_runs_the_cp_code_on_cpu(tmp_path):
    code, restored, cp_group_fn, sizes = run_on_ranks(_bench, 1, str(tmp_path), env={"TRITON_INTERPRET": "0"})[0]
    assert code == 0 and restored and cp_group_fn == "layer_cp_group"
    assert sizes == [2, 4], sizes  # N's attention gathered over stand-in groups of 2 and 4 ranks
    rows = json.loads(next(tmp_path.glob("bench_cp-*.json")).read_text())["rows"]
    assert [(r["model"], r["cp"]) for r in rows] == [("tiny@I", 2), ("tiny@I", 4), ("tiny@GN", 2), ("tiny@GN", 4)]
    assert all(r["loss"] == "finite" and r["MiB_sent"] > 0 and r["rank_ms"] > 0 for r in rows), rows
