"""Checkpoint conversion end to end on gloo: a TP=2 ZeRO-1 and a DP=2 ZeRO-3 run are consolidated (bitwise equal
to their gathered weights), exported to Hugging Face (logits and greedy generate() equal the training model's),
and brought back with checkpoint.init_from at other layouts and ZeRO stages (TP=2 -> TP=1 -> HF -> TP=2 bitwise;
the first loss equals the source model's loss on the same batch), and the TP=2 checkpoint resumes at TP=1 x DP=2
with its weights bitwise; bad inputs fail in one line, writing nothing."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.dist import run_on_ranks
from tests.utils import requires_gpu, subprocess_pythonpath
from tests.test_train_zero import train_config

LOSS_TOL = 2e-5  # fp32; layouts differ only in the order of reductions
LOGITS_TOL, KL_TOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from megahybrid.data.builtin import prepare_builtin

    path = tmp_path_factory.mktemp("builtin")
    prepare_builtin(str(path), vocab_size=512, num_docs=2000)
    return str(path)


def _trainer(root, name, data_dir, world, **overrides):
    import os

    from megahybrid.train.trainer import Trainer, make_plan

    cfg = train_config(os.path.join(root, name), data_dir, **{"train.steps": 2, **overrides})
    return Trainer(make_plan(cfg, world), resume=True)


def _full_weights(trainer):
    import deepspeed

    from megahybrid.model.sharding import full_named_tensors

    with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
        return full_named_tensors(trainer.model, trainer.groups.tp_group)


def _batch0_loss(trainer):
    """The model's mean loss on the run's first global batch (what step 1 of a new run sees), no update."""
    import torch
    import torch.distributed as dist

    from megahybrid.train.data import build_splits, train_loader

    train_ds, _ = build_splits(trainer.cfg, trainer.plan.data, trainer.plan.model.seq_length)
    batches = iter(train_loader(trainer.cfg, train_ds, trainer.groups, 0, 0))
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for _ in range(trainer.gas):
            total += trainer._loss(next(batches)).double()
    dist.all_reduce(total)
    return total.item() / (trainer.gas * dist.get_world_size())


def _sources(rank, world, root, data_dir):
    """Train and save the two sources; their gathered weights and batch-0 losses."""
    from megahybrid.distributed import shutdown

    out = {}
    for name, overrides in {"tp2": {"parallel.tp": 2}, "z3": {"train.deepspeed_config": "zero3"}}.items():
        trainer = _trainer(root, name, data_dir, world, **overrides)
        trainer.run()
        out[name] = {"full": _full_weights(trainer), "loss": _batch0_loss(trainer)}
    shutdown()
    return out


def _targets(rank, world, root, data_dir, hf_dir):
    """init_from at other layouts; then the plain resume of the TP=2 checkpoint at TP=1 x DP=2 (resharded)."""
    from megahybrid.distributed import shutdown

    tp2 = _trainer(root, "from_hf_tp2", data_dir, world, **{"parallel.tp": 2, "train.deepspeed_config": "zero2",
                                                              "checkpoint.init_from": hf_dir})
    round_trip = _full_weights(tp2)
    dp2 = _trainer(root, "from_tp2_dp2", data_dir, world, **{
        "train.deepspeed_config": "zero3", "checkpoint.init_from": os.path.join(root, "tp2", "checkpoints")})
    first_loss = dp2.train_step(iter(dp2.loader))["loss"]
    resumed = _trainer(root, "tp2", data_dir, world)
    resumed_full = _full_weights(resumed)
    shutdown()
    return {"round_trip": round_trip, "first_loss": first_loss, "resumed": (resumed.step, resumed_full)}


def _expect_error(fn, needle, output):
    from megahybrid.errors import UserError

    with pytest.raises(UserError) as info:
        fn()
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    parent = os.path.dirname(os.path.abspath(output))
    assert not os.path.exists(output) and not [n for n in os.listdir(parent) if ".tmp-" in n], os.listdir(parent)


def _conversions(rank, world, root):
    """Consolidate, export, compare the HF model with the training model, and the bad inputs."""
    import torch
    from transformers import AutoModelForCausalLM

    from megahybrid.convert import sources
    from megahybrid.convert.api import convert
    from megahybrid.convert.local import bare_model
    from megahybrid.model.decode import greedy_decode_logits

    out = {name: sources.read(convert(os.path.join(root, name, "checkpoints"), "consolidated",
                                      os.path.join(root, f"{name}_full"))).tensors for name in ("tp2", "z3")}
    hf = convert(os.path.join(root, "tp2_full"), "hf", os.path.join(root, "hf"))
    weights = sources.read(os.path.join(root, "tp2_full"))
    reference = bare_model(weights.model).eval()
    reference.load_state_dict(weights.tensors, strict=False)
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
    tokens = torch.randint(0, weights.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = reference(input_ids=tokens, position_ids=None, attention_mask=None, runtime_gather_output=True)
        theirs = model(tokens).logits
    kl = torch.nn.functional.kl_div(theirs.double().log_softmax(-1), ours.double().log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    generated = model.generate(tokens[:, :6], max_new_tokens=8, do_sample=False)
    stepwise = greedy_decode_logits(reference, generated).argmax(-1)[:, 5:-1]
    out.update(logits=(ours, theirs), kl=kl, generated=generated[:, 6:], stepwise=stepwise,
               files=sorted(os.listdir(hf)), tokenizer=_tokenizer_ids(hf))
    half = sources.read(convert(os.path.join(root, "tp2_full"), "consolidated", os.path.join(root, "bf16"), "bf16"))
    assert all(half.tensors[k].equal(v.bfloat16()) for k, v in weights.tensors.items())
    _bad_inputs(root, convert)
    return out


def _tokenizer_ids(hf):
    import sentencepiece
    from transformers import AutoTokenizer

    text = "The quick brown fox jumps over the lazy dog."
    ours = sentencepiece.SentencePieceProcessor(model_file=os.path.join(hf, "tokenizer.model")).encode(text)
    return ours, AutoTokenizer.from_pretrained(hf, trust_remote_code=True)(text)["input_ids"]


def _bad_inputs(root, convert):
    from megahybrid.convert.files import INDEX

    full, hf = os.path.join(root, "tp2_full"), os.path.join(root, "hf")
    sharded = convert(os.path.join(root, "tp2", "checkpoints"), "consolidated", os.path.join(root, "sharded"),
                      max_shard_bytes=64 * 1024)
    with open(os.path.join(sharded, INDEX)) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) > 2, shards
    os.remove(os.path.join(sharded, shards[1]))
    _expect_error(lambda: convert(sharded, "hf", os.path.join(root, "out1")), "is missing", os.path.join(root, "out1"))
    truncated = shutil.copytree(full, os.path.join(root, "truncated"))
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    _expect_error(lambda: convert(truncated, "hf", os.path.join(root, "out2")), "truncated", os.path.join(root, "out2"))
    bad = shutil.copytree(hf, os.path.join(root, "bad_heads"))
    with open(os.path.join(bad, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({**config, "num_attention_heads": 8}, f)
    _expect_error(lambda: convert(bad, "consolidated", os.path.join(root, "out3")), "num_heads=8",
                  os.path.join(root, "out3"))
    before = os.path.getmtime(os.path.join(hf, "config.json"))
    from megahybrid.errors import UserError

    with pytest.raises(UserError, match="already exists; pass --force"):
        convert(full, "hf", hf)
    assert os.path.getmtime(os.path.join(hf, "config.json")) == before
    convert(full, "hf", hf, force=True)


@pytest.mark.dist
def test_convert_round_trip_and_init_from(data_dir, tmp_path):
    from tests.utils import assert_close, rel_rms_error

    root = str(tmp_path)
    src = run_on_ranks(_sources, 2, root, data_dir)[0]
    conv = run_on_ranks(_conversions, 1, root)[0]
    for name in ("tp2", "z3"):
        assert conv[name].keys() == src[name]["full"].keys()
        for key, tensor in src[name]["full"].items():
            assert conv[name][key].equal(tensor), f"consolidated {name}: {key} differs"
    assert "modeling_megahybrid.py" in conv["files"] and "tokenizer.model" in conv["files"], conv["files"]
    assert_close(conv["logits"][1], conv["logits"][0], LOGITS_TOL, "HF logits")
    assert conv["kl"] < KL_TOL, conv["kl"]
    assert conv["generated"].equal(conv["stepwise"]), (conv["generated"], conv["stepwise"])
    assert conv["tokenizer"][0] == conv["tokenizer"][1] and len(conv["tokenizer"][0]) > 5, conv["tokenizer"]
    targets = run_on_ranks(_targets, 2, root, data_dir, os.path.join(root, "hf"))
    for rank_result in targets:
        for key, tensor in src["tp2"]["full"].items():
            assert rank_result["round_trip"][key].equal(tensor), f"TP=2 -> TP=1 -> HF -> TP=2: {key} differs"
        assert rank_result["first_loss"] == pytest.approx(src["tp2"]["loss"], rel=LOSS_TOL)
        step, resumed = rank_result["resumed"]
        assert step == 2 and all(resumed[k].equal(t) for k, t in src["tp2"]["full"].items()), "resumed at TP=1"
    print(f"HF logits rel RMS {rel_rms_error(*conv['logits']):.2e} KL {conv['kl']:.2e}; first loss "
          f"{targets[0]['first_loss']:.8f} vs source {src['tp2']['loss']:.8f}")


def test_convert_cli_refuses_existing_output_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath()}
    out = subprocess.run([sys.executable, "-m", "megahybrid", "convert", "--checkpoint", str(tmp_path), "--to", "hf",
                          "--output", str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("error: --output") and "--force" in out.stderr, out.stderr


@pytest.mark.parametrize("stride", [1, 2])
def test_shard_of_inverts_merge_shards(stride):
    import torch

    from megahybrid.model.sharding import merge_shards, shard_of

    full = torch.arange(8 * 12 * 3, dtype=torch.float32).reshape(24, 12)
    for dim in (0, 1):
        shards = [shard_of(full, dim, stride, 3 if dim == 0 else 2, r) for r in range(3 if dim == 0 else 2)]
        assert merge_shards(shards, dim, stride).equal(full)


def test_unmapped_mixer_is_a_one_line_error(monkeypatch):
    from megahybrid.convert import adapter
    from megahybrid.errors import UserError
    from megahybrid.model.config import preset

    monkeypatch.setattr(adapter, "MIXER_MODULES", {})
    with pytest.raises(UserError, match="mixer 'S' has no Hugging Face name mapping yet: add it to MIXER_MODULES"):
        adapter.module_map(preset("tiny"))


def _gpu_export(rank, world, root, pattern):
    """A fresh tiny model exported, loaded by transformers on the GPU (our Triton kernels there): logits and
    greedy generate() vs ours."""
    import torch
    from transformers import AutoModelForCausalLM

    from megahybrid.convert.api import convert, run_yaml_for
    from megahybrid.convert.files import write_weights
    from megahybrid.convert.local import ensure_local_groups
    from megahybrid.model.config import preset
    from megahybrid.model.decode import full_logits, greedy_decode_logits
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout

    ensure_local_groups()
    cfg = preset("tiny", pattern=pattern, num_layers=max(2, len(pattern)))
    model = build_model(cfg, ParallelLayout()).eval()
    src = os.path.join(root, "src")
    os.makedirs(src)
    write_weights({k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, src)
    with open(os.path.join(src, "config.yaml"), "w") as f:
        f.write(run_yaml_for(cfg))
    hf = AutoModelForCausalLM.from_pretrained(convert(src, "hf", os.path.join(root, "hf")), trust_remote_code=True)
    hf = hf.cuda().eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        logits = (hf(tokens).logits.float().cpu(), full_logits(model, tokens).cpu())
    generated = hf.generate(tokens[:, :8], max_new_tokens=8, do_sample=False)
    return logits, generated[:, 8:].cpu(), greedy_decode_logits(model, generated).argmax(-1)[:, 7:-1].cpu()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("pattern", ["S", "I", "D", "N", "G", "INSG"])
def test_exported_model_on_gpu_matches_training_model(pattern, tmp_path):
    from tests.utils import assert_close

    (theirs, ours), generated, stepwise = run_on_ranks(_gpu_export, 1, str(tmp_path), pattern,
                                                       env={"TRITON_INTERPRET": "0"})[0]
    assert_close(theirs, ours, LOGITS_TOL, "HF logits on the GPU")
    assert generated.equal(stepwise), (generated, stepwise)


def _mixer_exports(rank, world, root, patterns):
    """Each recurrent mixer's tiny model exported to Hugging Face format and loaded by transformers on the CPU:
    logits and greedy generate() against the training model's full forward and token-by-token decoding."""
    import torch
    from transformers import AutoModelForCausalLM

    from megahybrid.convert.api import convert, run_yaml_for
    from megahybrid.convert.files import write_weights
    from megahybrid.convert.local import ensure_local_groups
    from megahybrid.model.config import preset
    from megahybrid.model.decode import full_logits, greedy_decode_logits
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout

    ensure_local_groups()
    out = {}
    for pattern in patterns:
        cfg = preset("tiny", pattern=pattern, num_layers=len(pattern))
        model = build_model(cfg, ParallelLayout()).eval()
        src = os.path.join(root, f"src_{pattern}")
        os.makedirs(src)
        write_weights({k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, src)
        with open(os.path.join(src, "config.yaml"), "w") as f:
            f.write(run_yaml_for(cfg))
        hf_dir = convert(src, "hf", os.path.join(root, f"hf_{pattern}"))
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
        tokens = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = (hf(tokens).logits.float(), full_logits(model, tokens))
        generated = hf.generate(tokens[:, :8], max_new_tokens=6, do_sample=False)
        out[pattern] = logits, generated[:, 8:], greedy_decode_logits(model, generated).argmax(-1)[:, 7:-1]
    return out


def test_every_mixer_exports_to_hugging_face(tmp_path):
    from tests.utils import assert_close

    for pattern, ((theirs, ours), generated, stepwise) in run_on_ranks(_mixer_exports, 1, str(tmp_path),
                                                                         ["ID", "NG"])[0].items():
        assert_close(theirs, ours, LOGITS_TOL, f"{pattern} HF logits")
        assert generated.equal(stepwise), (pattern, generated, stepwise)
