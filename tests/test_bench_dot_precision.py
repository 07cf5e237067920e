"""tools/bench_dot_precision.py on CPU: the Triton kernels in the interpreter (exact fp32 dots there), each row in
its own process, errors against the ops' fp32 references; bad choices get one line and exit 2. The timing and the
tf32 / tf32x3 / ieee comparison itself need a GPU."""
import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("bench_dot_precision",
                                                  os.path.join(REPO, "tools", "bench_dot_precision.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_in_the_interpreter(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--ops", "attention,gdn", "--choices", "tf32x3", "--B", "1", "--T", "100", "--H", "2", "--D", "16",
            "--results-dir", str(tmp_path)]
    assert _tool().main(argv) == 0, capsys.readouterr()
    rows = json.load(open(tmp_path / "dot-precision.json"))["rows"]
    assert [(r["op"], r["status"]) for r in rows] == [("attention", "ok"), ("gdn", "ok")]
    for row in rows:
        assert row["choice"] == "ieee"  # the interpreter computes exact fp32 products whatever the choice
        assert 0 < row["err_max"] < 1e-5 and row["build_s"] > 0, row
        assert len(row["errors"].split()) == {"attention": 4, "gdn": 6}[row["op"]]  # the output and every grad


def test_bad_choice_is_one_line(capsys):
    assert _tool().main(["--choices", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ops") and "choices from tf32,tf32x3,ieee" in err
    assert len(err.strip().splitlines()) == 1
