"""tools/repro_small.py end to end on CPU: two of its five ~20M recipes (`I` and the NAtS-L Hybrid, whose `G` and
`N` layers cover the rest; S/D/G differ only in the pattern) shrunk to tiny models, two steps each on the built-in
corpus, trained at once, then eval ppl and eval recall on each; the JSON / Markdown results hold every model's
numbers. Bad input: one line, exit 2."""
import importlib.util
import json
import math
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.hidden_size=32", "model.num_heads=2", "model.ffn_hidden_size=64", "model.seq_length=64",
        "model.interdomain.modes=8", "model.nats.gdn_heads=2", "model.nats.gdn_head_dim=16",
        "model.nats.attention_heads=4", "batch.global_batch_size=4", "batch.micro_batch_size=4", "eval.iters=2",
        "data.num_workers=0", "logging.interval=1"]
STEPS = 2
MODELS = ["I", "H"]


def _tool():
    spec = importlib.util.spec_from_file_location("repro_small", os.path.join(REPO, "tools", "repro_small.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The built-in corpus laid out as tools/prepare_wikipedia.py writes (its one prefix as train and valid)."""
    from megahybrid.data.builtin import prepare_builtin

    root = tmp_path_factory.mktemp("repro-data")
    built = prepare_builtin(str(root / "builtin"), vocab_size=512, num_docs=600)
    os.symlink(built.tokenizer_model, root / "tokenizer.model")
    for split in ("train", "valid"):
        for ext in (".bin", ".idx"):
            os.symlink(built.prefix + ext, root / f"{split}_text_document{ext}")
    return str(root)


@pytest.mark.slow
def test_repro_small_end_to_end_on_cpu(data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops' torch paths on CPU, in the training processes too
    tool = _tool()
    results = str(tmp_path / "results" / "repro")
    argv = ["--data-dir", data_dir, "--tokens", str(STEPS * 4 * 64), "--run-root", str(tmp_path / "runs"),
            "--results", results, "--models", ",".join(MODELS), "--parallel", "2", "--mqar-steps", "2",
            "--mqar-length", "32", *TINY]
    assert tool.main(argv) == 0, capsys.readouterr()
    record = json.load(open(results + ".json"))
    assert list(record["models"]) == MODELS and record["meta"]["gpu"] == "cpu"
    assert record["meta"]["commit"] and record["meta"]["epochs"] > 0
    assert record["meta"]["mqar_steps"] == 2  # recall of a fresh model per architecture, trained on MQAR
    assert record["meta"]["mqar_length"] == 32  # at the given length, below the run's 64
    trained = json.load(open(tmp_path / "runs" / "eval-recall-I" / "recall.json"))["meta"]["trained"]
    assert trained["length"] == 32 and trained["steps"] == 2, trained
    for label, model in record["models"].items():
        assert model["pattern"] == tool.MODELS[label] and model["train"]["steps"] == STEPS
        assert model["tokens"] == STEPS * 4 * 64 and model["train"]["tokens_per_s"] > 0
        assert math.isfinite(model["train"]["valid_ppl"]) and 10 < model["parameters"] / 1e3 < 200
        buckets = model["ppl_buckets"]
        assert [b["end"] for b in buckets] == [16, 32, 64, 128, 256] and buckets[-1]["beyond_training"]
        assert all(math.isfinite(b["ppl"]) for b in buckets)
        assert {r["task"] for r in model["recall"]} == {"mqar", "niah"}
        assert all(0 <= r["accuracy"] <= 1 for r in model["recall"])
    table = open(results + ".md").read().splitlines()
    assert [line.split(" | ")[0] for line in table[-len(MODELS):]] == [f"| {m}" for m in MODELS]
    assert os.path.getsize(results + ".png") > 0
    _recall_only_merges_into_the_results(tool, argv, results, tmp_path, capsys)


def _recall_only_merges_into_the_results(tool, argv, results, tmp_path, capsys):
    """--recall-only on a fresh run root (the training's run dirs gone, as on a new device machine): the config
    is written again, `I`'s recall is measured anew with another MQAR protocol (batch, task vocabulary, a model
    override), and `H`'s rows, measured with the first protocol, are dropped (the table names one protocol) while
    the rest of its record stays."""
    before = json.load(open(results + ".json"))
    fresh_root = str(tmp_path / "fresh-runs")
    again = [*argv[:argv.index("--run-root")], "--run-root", fresh_root, *argv[argv.index("--run-root") + 2:]]
    again[again.index("--models") + 1] = "I"
    assert tool.main([*again, "--recall-only", "--mqar-batch", "2", "--mqar-vocab", "256", "--mqar-overrides",
                      "optimizer.lr=1e-3"]) == 0, capsys.readouterr()
    after = json.load(open(results + ".json"))
    assert os.path.isfile(os.path.join(fresh_root, "I", "config.yaml"))
    assert after["meta"]["mqar_batch"] == 2 and after["meta"]["recall_commit"]
    assert after["meta"]["mqar_vocab"] == 256 and after["meta"]["mqar_overrides"] == ["optimizer.lr=1e-3"]
    recall = json.load(open(os.path.join(fresh_root, "eval-recall-I", "recall.json")))["meta"]
    assert recall["settings"]["vocab"] == 256 and "optimizer.lr=1e-3" in recall["trained"]["overrides"], recall
    assert after["models"]["H"]["recall"] == [] and before["models"]["H"]["recall"]
    assert {k: v for k, v in after["models"]["H"].items() if k != "recall"} == \
        {k: v for k, v in before["models"]["H"].items() if k != "recall"}
    assert {k: v for k, v in after["models"]["I"].items() if k != "recall"} == \
        {k: v for k, v in before["models"]["I"].items() if k != "recall"}
    assert {r["task"] for r in after["models"]["I"]["recall"]} == {"mqar", "niah"}
    assert "trained on MQAR for 2 steps of 2 sequences" in open(results + ".md").read()
    assert "task vocabulary 256, MQAR model optimizer.lr=1e-3" in open(results + ".md").read()


def test_gated_interdomain_model_is_I_with_its_output_gate(data_dir):
    """`Ig` trains the `I` pattern with model.interdomain.output_gate=true; the command line's overrides win."""
    tool = _tool()
    files = tool.data_files(data_dir)
    gated = tool.run_overrides("Ig", files, 10 ** 6, "/tmp/runs", [])
    assert "model.pattern=I" in gated and "model.interdomain.output_gate=true" in gated
    assert not any("output_gate" in o for o in tool.run_overrides("I", files, 10 ** 6, "/tmp/runs", []))
    last = tool.run_overrides("Ig", files, 10 ** 6, "/tmp/runs", ["model.interdomain.output_gate=false"])
    assert last[-1] == "model.interdomain.output_gate=false"


def _builtin_like(tmp_path) -> str:
    """A data dir whose files exist (their content is not read before the error)."""
    root = tmp_path / "data"
    root.mkdir()
    for name in ("tokenizer.model", *(f"{s}_text_document{e}" for s in ("train", "valid") for e in (".bin", ".idx"))):
        (root / name).write_bytes(b"")
    return str(root)


def test_missing_data_and_bad_models_one_line(tmp_path, capsys):
    tool = _tool()
    for argv, message in ((["--data-dir", str(tmp_path)], f"--data-dir {tmp_path}: missing"),
                          (["--models", "S,X"], "--models S,X --tokens"),
                          (["--data-dir", _builtin_like(tmp_path), "--recall-only", "--results", str(tmp_path / "r")],
                           f"--recall-only merges into {tmp_path / 'r'}.json")):
        assert tool.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
    for argv in (["--mqar-vocab", "100"], ["--mqar-overrides", "optimizer.lr"]):
        assert tool.main(argv) == 2
        err = capsys.readouterr().err
        assert "--mqar-vocab >= 197" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_repro_small_stops_at_its_deadline_and_the_same_command_continues(data_dir, tmp_path, capsys, monkeypatch):
    """--deadline-s ends training in time (SIGTERM: the trainer saves and exits 3) and the same command again
    finishes it and evaluates, as two device calls on a warm machine would. A call cut during the recall stage
    still leaves the training and perplexity results."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tool = _tool()
    steps, results = 16, str(tmp_path / "results" / "repro")
    argv = ["--data-dir", data_dir, "--tokens", str(steps * 4 * 64), "--run-root", str(tmp_path / "runs"),
            "--results", results, "--models", "S", "--mqar-steps", "0", *TINY, "debug.sleep_per_step=1.5"]
    assert tool.main([*argv, "--deadline-s", "15"]) == 3
    err = capsys.readouterr().err
    assert "stopped at --deadline-s 15: S not finished" in err and "run the same command again" in err, err
    assert not os.path.exists(results + ".json")

    def cut(*_args):  # the device call ends during the recall stage
        raise tool.UserError("recall cut short")

    monkeypatch.setattr(tool, "recall_all", cut)
    assert tool.main(argv) == 2
    assert "recall cut short" in capsys.readouterr().err
    kept = json.load(open(results + ".json"))  # training and perplexity are kept for --recall-only
    assert kept["models"]["S"]["recall"] == [] and kept["meta"]["mqar_steps"] is None
    assert "not measured yet" in open(results + ".md").read()
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tool.main(argv) == 0, capsys.readouterr()
    assert json.load(open(results + ".json"))["models"]["S"]["train"]["steps"] == steps
    assert "zero-shot on the language models" in open(results + ".md").read()


def test_recall_is_handed_over_model_by_model(monkeypatch):
    """Each model's recall reaches `done` when it finishes, so a stage cut later (here: the second model fails)
    keeps the first model's rows in the results file."""
    tool = _tool()

    def recall_one(label, *_args):
        if label == "I":
            raise tool.UserError("recall cut short")
        return [{"task": "mqar", "accuracy": 0.5}]

    monkeypatch.setattr(tool, "recall_one", recall_one)
    done = []
    with pytest.raises(tool.UserError, match="recall cut short"):
        tool.recall_all(["S", "I"], "runs", 64, tool.Mqar(2), 1, lambda label, rows: done.append((label, rows)))
    assert done == [("S", [{"task": "mqar", "accuracy": 0.5}])]


def test_recall_of_another_mqar_protocol_is_not_kept_beside_the_new_one():
    """--recall-only with other MQAR settings than the file's: the rows of every model go (the meta names one
    protocol); with the same settings the other models' rows stay."""
    tool = _tool()

    def result():
        rows = [{"task": "mqar", "length": 256, "keys": 4, "accuracy": 0.5}]
        return {"meta": {"train_length": 1024, "mqar_steps": 500, "mqar_batch": 16, "mqar_length": 256},
                "models": {"S": {"recall": list(rows)}, "I": {"recall": list(rows)}}}

    same, other = result(), result()
    tool.drop_other_protocol(same, tool.Mqar(500, 16, 256))
    tool.drop_other_protocol(other, tool.Mqar(1000, 64, 256))
    assert all(m["recall"] for m in same["models"].values())
    assert not any(m["recall"] for m in other["models"].values())
