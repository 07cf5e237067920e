"""What a new user meets: activation recomputation settings train like no recomputation, printed commands work
as printed, an extended run keeps its LR schedule, config errors under torchrun are one line and exit 2, and the
small command-line conveniences (--version, the torch extensions cache, prepare_wikipedia's defaults)."""
import pytest

from megahybrid.errors import ConfigError
from megahybrid.model.config import preset
from tests.dist import run_on_ranks
from tests.test_train_resume import data_dir  # noqa: F401  (fixture)
from tests.utils import rel_rms_error, requires_gpu

RECOMPUTE_SETTINGS = {
    "selective": {"recompute": "selective"},
    "selective_mlp": {"recompute": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full": {"recompute": "full"},
    "full_block": {"recompute": "full", "recompute_num_layers": 2},
}
RECOMPUTE_LOSS_TOL = 1e-6  # fp32, the same kernels run again: only summation order could differ


def _losses_per_setting(rank, world):
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout
    from tests.minimal_train import train_steps

    groups = init_distributed(ParallelLayout())
    calls = [0]

    def counted(original):
        def call(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)
        return call

    # selective: megatron's reentrant checkpoint; full: torch's non-reentrant one (megahybrid.model.gpt)
    mp_random.CheckpointFunction.apply = counted(mp_random.CheckpointFunction.apply)
    torch.utils.checkpoint.checkpoint = counted(torch.utils.checkpoint.checkpoint)
    out = {}
    for name, fields in {"none": {}, **RECOMPUTE_SETTINGS}.items():
        calls[0] = 0
        cfg = preset("tiny", num_layers=4, **fields)
        torch.manual_seed(0)  # the same initial weights for every setting
        out[name] = (train_steps(build_model(cfg, groups.layout), cfg, groups, 3, 4), calls[0])
    shutdown()
    return out


def test_recompute_settings_train_like_no_recompute():
    import torch

    results = run_on_ranks(_losses_per_setting, 1)[0]
    reference, calls = results["none"]
    assert calls == 0
    # 3 steps (one forward each) of the 4-layer model: every layer, or the first 2, checkpointed once per forward
    assert results["full"][1] == 3 * 4 and results["full_block"][1] == 3 * 2, results
    for name in RECOMPUTE_SETTINGS:
        losses, calls = results[name]
        assert calls > 0, f"{name}: nothing was recomputed"
        err = rel_rms_error(torch.tensor(losses), torch.tensor(reference))
        assert err <= RECOMPUTE_LOSS_TOL, f"{name}: losses {losses} vs {reference} (rel RMS {err:.2e})"


def _compiled_graphs(rank, world):
    """torch._dynamo.explain of the tiny model's loss (graphs, graph breaks) without and with full recomputation."""
    import torch

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout

    groups = init_distributed(ParallelLayout())
    out = {}
    for name in ("none", "full", "full_block"):
        cfg = preset("tiny", num_layers=4, **RECOMPUTE_SETTINGS.get(name, {}))
        model = build_model(cfg, groups.layout)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda t: model(input_ids=t, position_ids=None, attention_mask=None,
                                                          labels=t).sum())(tokens)
        out[name] = (explained.graph_count, explained.graph_break_count)
    shutdown()
    return out


def test_full_recompute_stays_in_the_compiled_graph():
    """model.recompute=full adds no graph break under torch.compile (megatron's own full recomputation broke the
    graph at every layer: 10 breaks against 3 here, and the 1.3B preset trained at 0.57x on the H200)."""
    graphs = run_on_ranks(_compiled_graphs, 1)[0]
    assert graphs["full"] == graphs["full_block"] == graphs["none"], graphs


@pytest.mark.parametrize("fields,message", [
    ({"recompute": "some"}, "model.recompute='some': choose one of none, selective, full"),
    ({"recompute": "selective", "recompute_modules": ["layernorm"]}, "others need TransformerEngine"),
    ({"recompute_num_layers": 2}, "applies to model.recompute=full only"),
    ({"recompute": "full", "recompute_num_layers": 9}, "must lie in [1, model.num_layers=2]"),
])
def test_bad_recompute_messages(fields, message):
    with pytest.raises(ConfigError, ) as err:
        preset("tiny", **fields)
    assert message in str(err.value)


def _records(run_dir, key) -> dict[int, float]:
    import json
    import os

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


def _printed(stdout, prefix) -> list[str]:
    """The command after `prefix` in the output, without the bracketed hint and the parenthesized note."""
    import shlex

    line = next(line for line in stdout.splitlines() if line.startswith(prefix))
    return shlex.split(line[len(prefix):].split(" [")[0].split(" (")[0])


def test_extended_run_keeps_its_lr_schedule_and_printed_commands_work(data_dir, tmp_path):  # noqa: F811
    import subprocess
    import sys

    from megahybrid.train.engine import LRSchedule
    from tests.test_train_resume import _args, _env, run

    run_dir = str(tmp_path / "run")
    run(_args(run_dir, data_dir, 4))
    (_, stdout, stderr), = run(_args(run_dir, data_dir, 6))
    assert "keeping the LR schedule saved with the run (cosine 0.003 -> 0.0003 at step 4" in stderr
    assert "set optimizer.reschedule=true" in stderr
    # nothing to act on: DeepSpeed's CPU and untested-optimizer notes, megatron's import warnings (megahybrid/__init__)
    noise = [line for line in (stdout + stderr).splitlines() if any(
        note in line for note in ("Setting accelerator to CPU", "untested optimizer", "UserWarning"))]
    assert not noise, noise
    lrs = _records(run_dir, "train/lr")
    assert lrs[5] == lrs[6] == pytest.approx(3e-4), lrs  # the original schedule ended at min_lr
    resume = _printed(stdout, "resume: ")
    assert resume[:3] == [sys.executable, "-m", "megahybrid"], resume
    # Recomputation does not change the weights: a run resumes across it.
    extend = ["train.steps=8", "optimizer.reschedule=true", "model.recompute=full", "logging.tensorboard=false"]
    rerun = subprocess.run(resume + extend, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    printed = [line.split(" ")[0] for line in rerun.stdout.splitlines()]
    assert "resume:" in printed and "tensorboard:" not in printed  # no command for logs that were not written
    lrs = _records(run_dir, "train/lr")
    assert lrs[7] == pytest.approx(LRSchedule(3e-3, 3e-4, 1, 8)(6)) and lrs[7] > 2 * lrs[6], lrs
    tensorboard = _printed(stdout, "tensorboard: ")
    assert tensorboard[:3] == [sys.executable, "-m", "tensorboard.main"], tensorboard
    version = subprocess.run(tensorboard[:3] + ["--version_tb"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip(), version.stderr[-2000:]


@pytest.mark.dist
def test_launchers_report_config_errors_in_one_line_and_pass_exit_codes(data_dir, tmp_path):  # noqa: F811
    import re
    import subprocess
    import sys

    from tests.test_train_resume import EXIT_NONFINITE, _args, _env, finish, launch

    ours = [sys.executable, "-m", "megahybrid", "train", "--config", "demo", "--nproc-per-node", "2"]
    bad = subprocess.run(ours + ["train.steps=-1"], env=_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.splitlines() == ["error: train.steps=-1 must be > 0"], bad.stderr
    (_, stdout, stderr), = finish(launch(["train", "--config", "demo", "train.steps=-1"], world=2, style="torchrun"))
    assert (stdout + stderr).count("error: train.steps=-1 must be > 0") == 1, stderr  # once, not once per rank
    args = _args(str(tmp_path / "nan"), data_dir, 4, "debug.nan_loss_steps=[1,2]", "train.max_consecutive_nonfinite=2")
    stopped = subprocess.run(ours + args[3:], env=_env(), capture_output=True, text=True, timeout=300)
    assert stopped.returncode == EXIT_NONFINITE, stopped.stderr[-3000:]
    assert "error: 2 steps in a row had a non-finite loss" in stopped.stderr
    assert re.search(f"error: rank [01] exited with code {EXIT_NONFINITE}; its output is above", stopped.stderr)


def _tool(name):
    import importlib
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    return importlib.import_module(name)


def test_prepare_wikipedia_defaults_next_to_the_repo_and_prints_data_overrides(tmp_path, capsys):
    import os

    prepare = _tool("prepare_wikipedia")
    assert prepare.DEFAULT_INPUT == os.path.join(os.path.dirname(prepare.REPO), "shared", "data", "wikipedia-en")
    assert prepare.main(["--input-dir", str(tmp_path / "absent"), "--out-dir", str(tmp_path / "out")]) == 2
    assert "point --input-dir at the wikipedia-en folder" in capsys.readouterr().err
    text = prepare.train_overrides("out/tokenizer.model", {"train": "out/train_text_document"})
    assert text == (f"data.tokenizer_model={os.path.abspath('out/tokenizer.model')} "
                    f"data.train_prefixes=[{os.path.abspath('out/train_text_document')}]")


def test_version_extensions_cache_and_compile_default(capsys, monkeypatch):
    import os

    from megahybrid import __version__
    from megahybrid.cli import default_torch_extensions_dir, main
    from megahybrid.train.config import load_config, load_deepspeed_config, resolved_compile

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"megahybrid {__version__}"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert default_torch_extensions_dir() == os.path.join(repo, ".cache", "torch_extensions")  # as the Makefile
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"})
    assert main(["train", "--config", "demo", "train.steps=0"]) == 2
    assert os.environ["TORCH_EXTENSIONS_DIR"] == default_torch_extensions_dir()

    def compiles(overrides: list, gpu: bool) -> bool:
        cfg = load_config("demo", overrides)
        return resolved_compile(cfg, gpu, load_deepspeed_config(cfg.train.deepspeed_config))

    assert [compiles([], gpu) for gpu in (False, True)] == [False, True]
    assert not compiles(["train.compile=off"], True)
    with pytest.raises(ConfigError, match="train.compile='fast': choose auto"):
        compiles(["train.compile=fast"], True)
    assert compiles(["train.compile_scope=layers"], True)
    with pytest.raises(ConfigError, match="train.compile_scope='blocks': choose model or layers"):
        compiles(["train.compile_scope=blocks"], True)
    zero3 = ["train.deepspeed_config=zero3"]
    assert not compiles(zero3, True)
    assert compiles([*zero3, "train.compile=true"], False)
    with pytest.raises(ConfigError, match="train.compile=true with ZeRO-3 on a GPU"):
        compiles([*zero3, "train.compile=true"], True)


@pytest.mark.slow
def test_bench_train_runs_the_trainer_step_and_the_baseline_on_cpu(tmp_path):
    import json

    bench = _tool("bench_train")
    rc = bench.main(["--rows", "tiny:full:2", "tiny:none:1:256", "--seq", "128", "--tokens", "512", "--steps", "2",
                     "--warmup", "1", "--results-dir", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_train.json", "bench_train.md"]  # the current file
    path = tmp_path / "bench_train.json"
    saved = json.loads(path.read_text())
    assert rc == 0, saved["rows"]
    assert [(r["system"], r["recompute"], r["seq"], r["gas"]) for r in saved["rows"]] == [
        ("megahybrid", "full", 128, 2), ("baseline", "none", 128, 2), ("megahybrid", "none", 256, 2),
        ("baseline", "none", 256, 2)]
    assert all(r["tok/s"] > 0 and r["TFLOP/s"] > 0 and r["status"] == "ok" for r in saved["rows"])
    assert {"date", "gpu", "commit", "timed", "flops_per_token"} <= set(saved["meta"])
    assert {(r["commit"], r["gpu"], r["date"]) for r in saved["rows"]} == {
        (saved["meta"]["commit"], "cpu", saved["meta"]["date"])}
    # A later call keeps the earlier call's finished rows and times only the new one; each row keeps the commit
    # card and date it was measured at (a row of a file from before those columns: the file's).
    older = dict(saved, meta={**saved["meta"], "commit": "abc1234", "gpu": "NVIDIA H200", "date": "2026-01-02"})
    older["rows"] = [{k: v for k, v in r.items() if k not in ("commit", "gpu", "date")} for r in saved["rows"]]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(older))
    rc = bench.main(["--rows", "tiny:full:2", "tiny:none:2:256", "--seq", "128", "--tokens", "512", "--steps", "2",
                     "--warmup", "1", "--no-baseline", "--continue-from", str(earlier), "--results-dir",
                     str(tmp_path)])
    rows = json.loads(path.read_text())["rows"]
    assert rc == 0 and rows[0] == {**saved["rows"][0], "commit": "abc1234", "gpu": "H200", "date": "2026-01-02"}, rows
    assert (rows[1]["micro"], rows[1]["seq"], rows[1]["status"]) == (2, 256, "ok"), rows
    assert (rows[1]["commit"], rows[1]["gpu"], rows[1]["date"]) == (
        saved["meta"]["commit"], "cpu", saved["meta"]["date"]), rows


def test_bench_train_meta_names_each_kept_calls_peak():
    """A call that keeps earlier rows names each kept call's matmul peak in the meta, as its rows imply it
    (TFLOP/s / MFU_meas); rows of this call and rows without a measured MFU name none."""
    bench = _tool("bench_train")
    rows = [dict(commit="aaa", gpu="H200", **{"TFLOP/s": 350.0, "MFU_meas": 0.5}),
            dict(commit="aaa", gpu="H200", **{"TFLOP/s": 140.0, "MFU_meas": 0.2}),
            dict(commit="bbb", gpu="H100", **{"TFLOP/s": "", "MFU_meas": ""}),
            dict(commit="ccc", gpu="H100", **{"TFLOP/s": 300.0, "MFU_meas": 0.4})]
    assert bench._kept_peaks(rows, rows[3:]) == "aaa H200 700.0"
    assert bench._kept_peaks(rows, []) == "aaa H200 700.0, ccc H100 750.0"
    assert bench._kept_peaks(rows[2:3], []) == "none recorded"


def test_save_results_writes_the_benchmarks_current_file(tmp_path, monkeypatch):
    """tools/benchutil.save_results: NAME.json and NAME.md, replaced by the next call (one current result per
    benchmark; git keeps the earlier ones), date, GPU and commit in the meta, both copied to $OUT when it is set."""
    import json
    import os

    benchutil = _tool("benchutil")
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    for value in (1, 2):
        md = benchutil.save_results("bench_x", [{"a": value}], {"note": "n"}, results)
    assert md == results / "bench_x.md" and sorted(os.listdir(results)) == ["bench_x.json", "bench_x.md"]
    saved = json.loads((results / "bench_x.json").read_text())
    assert saved["rows"] == [{"a": 2}] and {"date", "gpu", "commit", "torch", "note"} <= set(saved["meta"])
    assert md.read_text().startswith(f"# bench_x\n\n- date: {saved['meta']['date']}\n- gpu: ")
    assert {p.name: p.read_text() for p in out.iterdir()} == {p.name: p.read_text() for p in results.iterdir()}


def test_result_tables_show_columns_that_only_later_rows_have():
    """A benchmark whose later rows add columns (bench_nats_layer's graphed decode times) shows them in its table."""
    table = _tool("benchutil").format_table([{"what": "prefill", "ms": 2.0}, {"what": "decode", "graphed_ms": 4.5}])
    header, first, second = table.splitlines()
    assert header.split() == ["what", "ms", "graphed_ms"]
    assert first.split() == ["prefill", "2"] and second.split() == ["decode", "4.5"]


def test_kernel_times_add_kernels_whose_cut_names_agree():
    """benchutil.kernel_ms cuts kernel names to 70 characters; instances that agree there are one row, their times
    added (the 128K prefill's elementwise instances once replaced each other, losing half its kernel time)."""
    from types import SimpleNamespace as Event

    stem = "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_"
    events = [Event(key=stem + "a", device_time_total=3000.0), Event(key=stem + "b", device_time_total=1000.0),
              Event(key="_fwd_h_kernel", device_time_total=2000.0), Event(key="aten::mul", device_time_total=9e3)]
    ranked = _tool("benchutil")._ranked_ms(events, cuda=True, iters=2, top=5)
    assert ranked == {"all kernels": 3.0, stem[:70]: 2.0, "_fwd_h_kernel": 1.0}


def test_host_waits_report_nothing_without_a_gpu(monkeypatch):
    """benchutil.host_waits (bench_cp --profile): without a GPU there is no sync or allocator count to take, and it
    says so with None rather than a zero that would read as 'none found'."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    waits = _tool("benchutil").host_waits(lambda: calls.append(1))
    assert waits == {"host_syncs": None, "sync_sites": [], "alloc_retries": None} and calls == [], waits


@pytest.mark.gpu
@requires_gpu
def test_host_waits_find_a_host_read_and_its_line():
    """On the GPU: one .item() in the step is one host sync, reported at this file's line; a step that only
    queues work has none."""
    import torch

    benchutil = _tool("benchutil")
    x = torch.ones(1024, device="cuda")
    quiet = benchutil.host_waits(lambda: x.mul_(1.0))
    read = benchutil.host_waits(lambda: x.sum().item())
    assert quiet["host_syncs"] == 0 and quiet["alloc_retries"] == 0, quiet
    assert read["host_syncs"] >= 1 and any(s.startswith("tests/test_usability.py:") for s in read["sync_sites"]), read


def test_kernel_groups_split_a_step_profile_by_kind():
    """bench_train --profile's kernel groups: each kernel in the first group its name matches, per step, with the
    busy total; names are the GPU's (cuBLAS nvjet, cuDNN SDPA, inductor templates and fused kernels)."""
    times_us = {"nvjet_tst_192x192_64x4_1x2_h_bz_coopA_NTN": 4000.0, "triton_tem_fused_mm_3": 1000.0,
                "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": 3000.0, "multi_tensor_apply_kernel": 400.0,
                "triton_poi_fused_add_mul_0": 500.0, "triton_poi_fused__to_copy_add_cat_cos_mul_1": 100.0,
                "Memcpy DtoD (Device -> Device)": 200.0,
                "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 100.0, "_fwd_h_kernel": 700.0}
    groups = _tool("benchutil").kernel_groups(times_us, steps=2)
    assert groups == {"matmul_ms": 2.5, "attn_ms": 1.5, "optim_ms": 0.2, "comm_ms": 0.05, "copy_ms": 0.1,
                      "fused_ms": 0.3, "other_ms": 0.35, "busy_ms": 5.0}


def test_bench_mixers_summary_reads_the_current_results():
    """tools/bench_mixers.py --summary-only reads tools/results/<op>.json, the ops' current results."""
    mixers = _tool("bench_mixers")
    assert min(mixers.interdomain_summary()["Mtoks"]) > 0
    assert mixers.nats_summary()["ratio"] > 0 and mixers.nats_vs_sdpa()["speedup"] > 0


def test_bench_train_mixer_suite_covers_every_mixer_at_4k_and_16k():
    bench = _tool("bench_train")
    rows = bench.plan_rows(bench.MIXER_SUITE, 4096, baseline=False)
    tokens = 16 * 4096
    covered = {(r["preset"].partition("@")[2] or "hybrid", r["seq"]) for r in rows}
    assert covered == {(m, seq) for m in ("S", "I", "D", "G", "N", "hybrid") for seq in (4096, 16384)}
    assert all(tokens // r["seq"] % r["micro"] == 0 for r in rows), rows


def test_bench_train_rows_carry_model_overrides_and_share_one_baseline():
    """`125m@I+interdomain.fused_input=true` compares an option on and off in one table: the override reaches the
    model section and both rows share the 125m baseline."""
    bench = _tool("bench_train")
    rows = bench.plan_rows(["125m@I:none:8", "125m@I+interdomain.fused_input=true:none:8"], 4096)
    assert [r["system"] for r in rows] == ["megahybrid", "baseline", "megahybrid"]
    assert bench._preset_fields(rows[2]["preset"]) == {"preset": "125m", "pattern": "I",
                                                       "interdomain": {"fused_input": True}}
    assert bench._preset_fields("350m") == {"preset": "350m"}
    sections = bench._row_sections("125m+optimizer.clip_on_device=false+train.compile_scope=layers")
    assert sections == {"model": {"preset": "125m"}, "train": {"compile_scope": "layers"},
                        "optimizer": {"clip_on_device": False}}


def test_end_of_run_prints_each_mixer_layers_telemetry(capsys):
    """The run ends with the mixers' own scalars, one line per layer, named by index and pattern character."""
    import types

    import torch

    from megahybrid.model.config import ModelConfig
    from megahybrid.train.trainer import Trainer

    class Telemetry(torch.nn.Module):
        def tensorboard_scalars(self):
            return {"kept_attention": 0.25, "state_norm": 3.0}

    layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    layers[1].self_attention = Telemetry()
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = layers
    fake = types.SimpleNamespace(model=model, plan=types.SimpleNamespace(model=ModelConfig(pattern="SN")))
    fake._layer_name = lambda path: Trainer._layer_name(fake, path)
    Trainer._print_telemetry(fake)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["mixer telemetry (last step):", "  layer 1 (N)  kept_attention 0.25  state_norm 3"]
