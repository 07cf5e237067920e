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
                          "--reps", "1", "--profile", "--results-dir", results])
    return code, dist.all_gather is before, bench_cp.nats.layer_cp_group.__name__, sorted({c[1] for c in calls})


def test_bench_cp_stand_in_runs_the_cp_code_on_cpu(tmp_path):
    code, restored, cp_group_fn, sizes = run_on_ranks(_bench, 1, str(tmp_path), env={"TRITON_INTERPRET": "0"})[0]
    assert code == 0 and restored and cp_group_fn == "layer_cp_group"
    assert sizes == [2, 4], sizes  # N's attention gathered over stand-in groups of 2 and 4 ranks
    result = json.loads((tmp_path / "bench_cp.json").read_text())
    rows = result["rows"]
    for what in ("tiny@I cp=2 rank", "tiny@I shard 128 without CP"):  # --profile: cp=2 only
        assert result["meta"][f"{what}, kernel ms"]["all kernels"] > 0, result["meta"].keys()
        waits = result["meta"][f"{what}, waits"]  # no GPU: no sync or allocator count, the idle time still
        assert waits["host_syncs"] is None and waits["alloc_retries"] is None and "idle_ms" in waits, waits
    assert "tiny@I cp=4 rank, kernel ms" not in result["meta"]
    assert [(r["model"], r["cp"]) for r in rows] == [("tiny@I", 2), ("tiny@I", 4), ("tiny@GN", 2), ("tiny@GN", 4)]
    assert all(r["loss"] == "finite" and r["MiB_sent"] > 0 and r["rank_ms"] > 0 for r in rows), rows
    assert all(0 < r["rank_host_ms"] <= r["rank_ms"] and 0 < r["no_cp_host_ms"] <= r["no_cp_ms"] for r in rows), rows


@pytest.mark.slow
def test_bench_cp_scaling_runs_the_train_command_at_cp1_cp2_tp2_on_cpu(tmp_path, monkeypatch):
    """The 2-GPU weak-scaling tool (issue #19) end to end on CPU with gloo: every run finishes and cp=2 follows
    one rank's losses at the same length."""
    import sys
    from pathlib import Path

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the G/N layers' CPU path is torch; the interpreter is slow
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools import bench_cp_scaling

    code = bench_cp_scaling.main(["--models", "tiny@GN", "--seq", "128", "--steps", "1", "--warmup", "1",
                                  "--check-steps", "2", "--results-dir", str(tmp_path)])
    (row,) = json.loads((tmp_path / "bench_cp_scaling.json").read_text())["rows"]
    assert code == 0 and row["status"] == "ok" and row["check"] == "ok", row
    assert row["max_loss_gap"] <= 1e-4 and all(row[k] > 0 for k in ("cp1_ms", "cp2_ms@2S", "tp2_ms@2S")), row
