"""Evaluation and generation (megahybrid.eval) on a tiny model trained two steps on the built-in corpus: perplexity
by position bucket equals the cross entropy of the full forward, generation at temperature 0 equals full-forward
greedy decoding (also for a fresh model of every available mixer), the lm-eval adapter's log-likelihoods equal log-softmax of the logits, recall runs zero-shot and
a tiny model trained on MQAR beats its untrained self; bad inputs exit 2 with one line."""
import contextlib
import io
import json
import math
import os

import pytest

from tests.dist import run_on_ranks
from tests.utils import requires_gpu

PPL_TOL = 1e-5  # fp32, relative; the same forward, losses summed in another order
LOGPROB_TOL = 1e-5
LENGTHS = [64, 128, 256]  # the model trains at 128: the last bucket is past the training context
MQAR_STEPS = 200
TASK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lm_eval")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from megahybrid.data.builtin import prepare_builtin

    path = tmp_path_factory.mktemp("builtin")
    prepare_builtin(str(path), vocab_size=512, num_docs=600)
    return str(path)


def _cli(argv):
    """megahybrid's main() in this process: (exit code, stdout, stderr)."""
    from megahybrid.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _train(root, data_dir):
    from megahybrid.train.trainer import Trainer, make_plan
    from tests.test_train_zero import train_config

    cfg = train_config(os.path.join(root, "run"), data_dir, **{
        "train.steps": 2, "checkpoint.interval": 2, "data.builtin_num_docs": 600})
    Trainer(make_plan(cfg, 1), resume=False).run()
    return os.path.join(root, "run", "checkpoints")


def _reference_ppl(model, prefix, length, windows):
    """Per-bucket perplexity from full-forward logits and torch's cross entropy, the data read afresh."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megahybrid.model.decode import full_logits

    data = IndexedDataset(prefix)
    tokens = torch.from_numpy(np.concatenate([data[i] for i in range(len(data))]).astype(np.int64))
    nll = torch.zeros(length, dtype=torch.float64)
    for w in range(windows):
        chunk = tokens[w * length:w * length + length + 1]
        logits = full_logits(model, chunk[None, :-1])[0]
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="none").double()
    nll /= windows
    starts = [0] + LENGTHS[:-1]
    return [math.exp(nll[s:e].mean().item()) for s, e in zip(starts, LENGTHS)]


def _ppl_checks(ckpt, prefix, out):
    from megahybrid.eval.loading import load

    code, stdout, stderr = _cli(["eval", "ppl", "--checkpoint", os.path.join(ckpt, "step_00000002"), ckpt,
                                 "--data", prefix, "--lengths", ",".join(map(str, LENGTHS)), "--tokens", "1024",
                                 "--out", out])
    with open(os.path.join(out, "ppl.json")) as f:
        record = json.load(f)
    first = record["results"][0]
    reference = _reference_ppl(load(ckpt).model, prefix, LENGTHS[-1], first["windows"])
    events = [n for _, _, files in os.walk(os.path.join(out, "tensorboard")) for n in files if "tfevents" in n]
    return {"code": code, "stdout": stdout, "stderr": stderr, "record": record, "reference": reference,
            "png": os.path.getsize(os.path.join(out, "ppl.png")), "events": len(events)}


def _generation_checks(ckpt):
    import torch

    from megahybrid.eval.generate import Sampling, sample
    from megahybrid.eval.loading import load
    from megahybrid.model.decode import full_logits

    loaded = load(ckpt)
    prompt = torch.tensor([[2] + loaded.tokenizer().encode("The river")])
    reference = prompt
    for _ in range(12):
        reference = torch.cat([reference, full_logits(loaded.model, reference)[:, -1:].argmax(-1)], 1)
    greedy, stats = sample(loaded.model, prompt, Sampling(12, temperature=0.0, stop_at_eos=False))
    nucleus, _ = sample(loaded.model, prompt, Sampling(12, temperature=1.0, top_p=1e-6, stop_at_eos=False))
    seeded = [sample(loaded.model, prompt, Sampling(12, 1.0, 0.9, seed=5, stop_at_eos=False))[0] for _ in range(2)]
    code, stdout, stderr = _cli(["generate", "--checkpoint", ckpt, "--prompt", "The river", "--max-new-tokens", "8",
                                 "--temperature", "0"])
    return {"greedy": greedy, "nucleus": nucleus, "reference": reference, "stats": stats, "seeded": seeded,
            "cli": (code, stdout, stderr)}


def _harness_checks(ckpt):
    import torch

    from megahybrid.eval.generate import Sampling, sample
    from megahybrid.eval.harness import MegahybridLM
    from megahybrid.eval.loading import load
    from megahybrid.model.decode import full_logits

    lm = MegahybridLM(loaded=load(ckpt))
    tok = lm.tok
    pairs = [("The river runs", " to the sea"), ("A", " b c d")]
    got = lm.loglikelihood(pairs)
    want = []
    for context, continuation in pairs:
        ids, cont = [tok.eod] + tok.encode(context), tok.encode(continuation)
        logp = torch.log_softmax(full_logits(lm.loaded.model, torch.tensor([ids + cont[:-1]]))[0], -1)
        want.append(sum(logp[len(ids) - 1 + i, t].item() for i, t in enumerate(cont)))
    rolling = lm.loglikelihood_rolling([("The river runs to the sea.",)])[0]
    text_ids = tok.encode("The river runs to the sea.")
    rolling_want = lm.loglikelihood([("", "The river runs to the sea.")])[0][0]
    context = "The river"
    ids = torch.tensor([[tok.eod] + tok.encode(context)])
    greedy = sample(lm.loaded.model, ids, Sampling(10, 0.0), tok.eod)[0][0, ids.shape[1]:].tolist()
    greedy_text = tok.decode([t for t in greedy if t != tok.eod])
    until = greedy_text[len(greedy_text) // 2:] or "\n"
    generated = lm.generate_until([(context, {"until": [until], "max_gen_toks": 10})])[0]
    return {"got": got, "want": want, "rolling": (rolling, rolling_want, len(text_ids)),
            "generated": generated, "greedy_text": greedy_text, "until": until, "harness_cli": _harness_cli(ckpt)}


def _harness_cli(ckpt):
    """The shipped 10-item task through lm-eval when it is installed (the optional extra), else the refusal."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("lm_eval") is None:
        code, _, stderr = _cli(["eval", "harness", "--checkpoint", ckpt, "--tasks", "piqa"])
        return code, stderr, None
    tasks = tempfile.mkdtemp()
    with open(os.path.join(TASK_DIR, "tiny_mc.yaml")) as f:
        text = f.read().replace("tests/data/lm_eval/tiny_mc.jsonl", os.path.join(TASK_DIR, "tiny_mc.jsonl"))
    with open(os.path.join(tasks, "tiny_mc.yaml"), "w") as f:
        f.write(text)
    out = os.path.join(tasks, "out")
    code, _, stderr = _cli(["eval", "harness", "--checkpoint", ckpt, "--tasks", "megahybrid_tiny_mc",
                            "--include-path", tasks, "--out", out])
    written = [os.path.join(out, n) for n in os.listdir(out)] if os.path.isdir(out) else []
    with open(written[0]) as f:
        return code, stderr, json.load(f)["results"]


def _recall_checks(ckpt, out):
    from megahybrid.eval import recall
    from megahybrid.eval.loading import fresh
    from megahybrid.model.config import preset

    code, stdout, stderr = _cli(["eval", "recall", "--checkpoint", ckpt, "--lengths", "64,128", "--keys", "2,8",
                                 "--depths", "0.5", "--samples", "8", "--out", out])
    with open(os.path.join(out, "recall.json")) as f:
        rows = json.load(f)["rows"]
    tiny = fresh(preset("tiny", vocab_size=64, seq_length=64), seed=0)
    settings = recall.RecallSettings(lengths=[64], keys=[2, 4], depths=[0.5], samples=64)
    before = recall.evaluate(tiny.model, settings, 64, tiny.device)
    losses = recall.train_mqar(tiny, settings, MQAR_STEPS, 32, 3e-3)
    after = recall.evaluate(tiny.model, settings, 64, tiny.device)
    return {"cli": (code, stdout, stderr), "rows": rows, "before": before, "after": after, "losses": losses}


def _mixer_checks():
    """Every available mixer (a new one joins by its MIXERS record): temperature-0 sampling through its decode cache
    equals full-forward greedy, and the per-position losses of `eval ppl` equal cross entropy of the logits."""
    import numpy as np
    import torch

    from megahybrid.eval.generate import Sampling, sample
    from megahybrid.eval.loading import fresh
    from megahybrid.eval.ppl import position_losses
    from megahybrid.model.config import preset
    from megahybrid.model.decode import full_logits
    from megahybrid.model.mixers import MIXERS

    out = {}
    for char in [c for c, m in MIXERS.items() if m.spec is not None]:
        loaded = fresh(preset("tiny", pattern=char, seq_length=128), seed=1)
        data = np.random.default_rng(2).integers(4, 512, size=129)
        reference = torch.from_numpy(data[None, :9])
        for _ in range(10):
            reference = torch.cat([reference, full_logits(loaded.model, reference)[:, -1:].argmax(-1)], 1)
        greedy = sample(loaded.model, torch.from_numpy(data[None, :9]), Sampling(10, 0.0, stop_at_eos=False))[0]
        x = torch.from_numpy(data)
        want = torch.nn.functional.cross_entropy(full_logits(loaded.model, x[None, :-1])[0], x[1:], reduction="none")
        out[char] = (greedy, reference, position_losses(loaded.model, data, 128, 1, loaded.device), want.double())
    return out


def _bad_inputs(ckpt, prefix, root):
    long_prompt = " ".join(["the river runs to the sea"] * 60)
    return {
        "missing checkpoint": _cli(["eval", "ppl", "--checkpoint", os.path.join(root, "nope"), "--data", prefix,
                                    "--lengths", "64"]),
        "too few tokens": _cli(["eval", "ppl", "--checkpoint", ckpt, "--data", prefix, "--lengths", "64,64M"]),
        "prompt too long": _cli(["generate", "--checkpoint", ckpt, "--prompt", long_prompt]),
        "missing generate checkpoint": _cli(["generate", "--checkpoint", os.path.join(root, "nope"), "--prompt", "a"]),
        "MQAR longer than the model": _cli(["eval", "recall", "--train-config", "demo", "--train-length", "1000",
                                            "--out", os.path.join(root, "bad-recall")]),
        "MQAR training options with a checkpoint": _cli(["eval", "recall", "--checkpoint", ckpt, "--train-length",
                                                         "64", "--out", os.path.join(root, "bad-recall")]),
    }


def _body(rank, world, root, data_dir):
    from megahybrid.distributed import shutdown

    ckpt = _train(root, data_dir)
    prefix = os.path.join(data_dir, "builtin_text_document")
    out = {"ppl": _ppl_checks(ckpt, prefix, os.path.join(root, "ppl")), "generate": _generation_checks(ckpt),
           "harness": _harness_checks(ckpt), "recall": _recall_checks(ckpt, os.path.join(root, "recall")),
           "bad": _bad_inputs(ckpt, prefix, root), "mixers": _mixer_checks()}
    shutdown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, data_dir):
    return run_on_ranks(_body, 1, str(tmp_path_factory.mktemp("eval")), data_dir, timeout=900)[0]


@pytest.mark.dist
def test_ppl_by_position(results):
    ppl = results["ppl"]
    assert ppl["code"] == 0, ppl["stderr"]
    runs = ppl["record"]["results"]
    assert len(runs) == 2 and runs[0]["windows"] == 1024 // LENGTHS[-1], runs
    got = [row["ppl"] for row in runs[0]["buckets"]]
    for g, w in zip(got, ppl["reference"]):
        assert abs(g - w) / w <= PPL_TOL, (got, ppl["reference"])
    assert [row["beyond_training"] for row in runs[0]["buckets"]] == [False, False, True]
    assert runs[0]["buckets"] == runs[1]["buckets"], "the checkpoint directory and its latest step differ"
    assert "beyond training context" in ppl["stdout"] and ppl["png"] > 1000 and ppl["events"] == 2


@pytest.mark.dist
def test_generate_temperature_zero_is_full_forward_greedy(results):
    gen = results["generate"]
    assert gen["greedy"].equal(gen["reference"]), (gen["greedy"], gen["reference"])
    assert gen["nucleus"].equal(gen["reference"]), "top-p near 0 must keep only the most likely token"
    assert gen["seeded"][0].equal(gen["seeded"][1]), "the same seed must give the same sample"
    assert gen["stats"]["new_tokens"] == 12 and gen["stats"]["tokens_per_s"] > 0
    code, stdout, stderr = gen["cli"]
    assert code == 0 and stdout.startswith("The river") and "tok/s" in stderr, (code, stdout, stderr)


@pytest.mark.dist
def test_every_mixer_decodes_and_scores_like_the_full_forward(results):
    from tests.utils import assert_close

    assert "S" in results["mixers"]
    for char, (greedy, reference, losses, want) in results["mixers"].items():
        assert greedy.equal(reference), (char, greedy, reference)
        assert_close(losses, want, PPL_TOL, f"{char} position losses")


@pytest.mark.dist
def test_harness_adapter(results):
    h = results["harness"]
    for (got, greedy), want in zip(h["got"], h["want"]):
        assert abs(got - want) <= LOGPROB_TOL * abs(want), (got, want)
        assert isinstance(greedy, bool)
    rolling, rolling_want, n = h["rolling"]
    assert abs(rolling - rolling_want) <= LOGPROB_TOL * abs(rolling_want) and n > 1
    assert h["generated"] == h["greedy_text"].split(h["until"])[0], h
    code, stderr, harness_results = h["harness_cli"]
    if harness_results is None:  # lm-eval absent (CI): one-line refusal naming the extra
        assert code == 2 and stderr.strip().splitlines()[-1].startswith("error: ") and "pip install" in stderr
    else:
        assert code == 0 and 0 <= harness_results["megahybrid_tiny_mc"]["acc,none"] <= 1, (code, stderr)


@pytest.mark.dist
def test_recall(results):
    r = results["recall"]
    code, stdout, stderr = r["cli"]
    assert code == 0, stderr
    settings = {(row["task"], row["length"], row.get("keys", row.get("depth"))) for row in r["rows"]}
    assert settings == {("mqar", 64, 2), ("mqar", 64, 8), ("mqar", 128, 2), ("mqar", 128, 8), ("niah", 64, 0.5),
                        ("niah", 128, 0.5)}, settings
    assert all(0 <= row["accuracy"] <= 1 for row in r["rows"])
    before = {row["keys"]: row["accuracy"] for row in r["before"] if row["task"] == "mqar"}
    after = {row["keys"]: row["accuracy"] for row in r["after"] if row["task"] == "mqar"}
    # Chance is 1/19 (the value range); after 200 CPU steps the model answers with a value from its context
    # (about 1/keys), the first step toward recall; untrained it is at chance.
    assert r["losses"][-1] < r["losses"][0] - 1.0, r["losses"][::20]
    assert after[2] > 0.3 and after[2] > before[2] + 0.2, (before, after)


@pytest.mark.dist
def test_bad_inputs_one_line_exit_2(results):
    for name, (code, stdout, stderr) in results["bad"].items():
        lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, (name, code, stderr)
        assert stderr.strip().splitlines()[-1] == lines[0], (name, stderr)
    assert "fewer than" in results["bad"]["too few tokens"][2]
    assert "--max-new-tokens" in results["bad"]["prompt too long"][2]
    assert "--train-length 1000" in results["bad"]["MQAR longer than the model"][2]
    assert "--train-config" in results["bad"]["MQAR training options with a checkpoint"][2]


def test_results_summary_keeps_going_on_any_json(tmp_path):
    """tools/summarize_results.py over the shipped results plus odd files: every base family (the file's stem)
    gets rows with the date from its meta, a file it cannot read gets one line, an eval record gets its curve,
    other files are listed; --check refuses a result named with a date (one current file per benchmark)."""
    import importlib.util
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tools", "summarize_results.py")
    spec = importlib.util.spec_from_file_location("summarize_results", script)
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    for name in os.listdir(os.path.join(root, "tools", "results")):
        if name.endswith(".json"):
            shutil.copy(os.path.join(root, "tools", "results", name), tmp_path / name)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "alist.json").write_text("[1, 2]")
    ppl = {"meta": {"date": "2026-12-01", "commit": "abc1234", "device": "cpu"}, "results": [{"label": "run (S)",
           "train_length": 128, "buckets": [{"bucket": "<=64", "ppl": 12.5}, {"bucket": "64-128", "ppl": 11.0}]}]}
    (tmp_path / "ppl.json").write_text(json.dumps(ppl))
    (tmp_path / "ppl.md").write_text("# ppl\n")
    (tmp_path / "notes.log").write_text("# a raw log\n")
    assert summary.main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "| ppl run (S) | <=64: 12.50, 64-128: 11.00 | trained at 128 | 2026-12-01 | cpu | abc1234 |" in text
    assert "broken | - | unreadable (JSONDecodeError)" in text and "alist | - | not a {meta, rows} record" in text
    assert "tok/s, MFU" in text and "NAtS attention T=4096" in text and "interdomain C=64 T=16384 M=32" in text
    assert "| D chunked-64 compiled 12 heads T=4096 fwd+bwd | 9.46 ms | Interdomain op 7.29 ms |" in text
    assert "Notes and raw logs (no JSON beside them): [notes.log](notes.log)." in text  # not ppl.md
    rerun = {"meta": {"date": "2026-12-03", "commit": "old1234"}, "rows": [
        {"preset": "125m@I", "seq": 4096, "micro": 8, "tok/s": 1000.0, "commit": "old1234"},
        {"preset": "125m@S", "seq": 4096, "micro": 8, "tok/s": 3000.0, "commit": "old1234"},
        {"preset": "125m@I", "seq": 4096, "micro": 8, "tok/s": 2000.0, "commit": "new5678", "gpu": "H100",
         "date": "2026-12-05"}]}
    (tmp_path / "rerun.json").write_text(json.dumps(rerun))
    assert summary.main(["--results", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "README.md").read_text().splitlines() if "[rerun.json]" in line]
    assert len(rows) == 2 and "2,000 tok/s" in rows[0] and "| 2026-12-05 | H100 | new5678 |" in rows[0], rows
    assert "125m@S" in rows[1] and "| 2026-12-03 | - | old1234 |" in rows[1], rows  # no date, card: the file's
    (tmp_path / "rerun.json").unlink()
    assert summary.main(["--results", str(tmp_path)]) == 0
    assert summary.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "ppl-2026-12-02.json").write_text(json.dumps(ppl))
    assert summary.main(["--results", str(tmp_path)]) == 0
    assert "[ppl-2026-12-02.json](ppl-2026-12-02.json)" in (tmp_path / "README.md").read_text()
    assert summary.main(["--results", str(tmp_path), "--check"]) == 1


def _gpu_body(rank, world):
    import numpy as np
    import torch

    from megahybrid.eval.generate import Sampling, sample
    from megahybrid.eval.loading import fresh
    from megahybrid.eval.ppl import position_losses
    from megahybrid.model.config import preset
    from megahybrid.model.decode import full_logits

    loaded = fresh(preset("tiny", seq_length=256), seed=3)
    tokens = torch.randint(4, 512, (1, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    reference = tokens[:, :8]
    for _ in range(24):
        reference = torch.cat([reference, full_logits(loaded.model, reference)[:, -1:].argmax(-1)], 1)
    greedy, _ = sample(loaded.model, tokens[:, :8], Sampling(24, temperature=0.0, stop_at_eos=False))
    data = np.random.default_rng(0).integers(4, 512, size=2 * 256 + 1)
    losses = position_losses(loaded.model, data, 256, 2, loaded.device)
    x = torch.from_numpy(data).cuda()
    want = sum(torch.nn.functional.cross_entropy(full_logits(loaded.model, x[None, w * 256:w * 256 + 256])[0],
                                                  x[w * 256 + 1:w * 256 + 257], reduction="none").double().cpu()
               for w in range(2)) / 2
    return greedy.cpu(), reference.cpu(), losses, want


@pytest.mark.gpu
@requires_gpu
def test_generation_and_ppl_on_gpu():
    from tests.utils import assert_close

    greedy, reference, losses, want = run_on_ranks(_gpu_body, 1, env={"TRITON_INTERPRET": "0"})[0]
    assert greedy.equal(reference), (greedy, reference)
    assert_close(losses, want, PPL_TOL, "position losses on the GPU")
