"""Regenerate tools/results/README.md: one table of the current measured numbers (what, value, anchor, date, GPU,
commit) from the JSON results in tools/results/.

    python tools/summarize_results.py [--results DIR] [--check]

One current result per benchmark: FAMILY.json (with FAMILY.md beside it), which the tool that measures it
overwrites; git keeps the earlier ones. A result file is {"meta": {date, gpu, commit, ...}, "rows": [...]} (the
benchmarks), {"meta", "results"} (`megahybrid eval ppl`) or {"meta", "models"} (tools/repro_small.py); the date,
GPU and commit come from its meta. A headline rule is chosen by the columns a file's rows have; a file no rule
fits, or one that is not valid JSON, gets one line saying so instead of stopping the script. The other files
(notes, raw logs) are listed under the table. --check exits 1 when README.md is out of date or a JSON result is
named with a date (FAMILY-YYYY-MM-DD...: a snapshot, not the current file).
"""
import argparse
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATED = re.compile(r"-\d{4}-\d{2}-\d{2}(-|$)")
HEADLINE_T = (4096, 16384)
# named like a variant of their base family but headlined on their own: the mixers suite (issue #20, every mixer
# at 4K and 16K through the training step) is the project's main speed table
SUITES = ("bench_train-mixers",)


def load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        return {"error": f"unreadable ({type(err).__name__})"}


def current_files(results_dir: str) -> dict[str, tuple[str, dict]]:
    """family -> (file name, content): FAMILY.json, one file per family."""
    return {name[:-5]: (name, load(os.path.join(results_dir, name)))
            for name in sorted(os.listdir(results_dir)) if name.endswith(".json")}


def dated(results_dir: str) -> list[str]:
    """The JSON results named with a date: snapshots against the one-current-file rule."""
    return [name for name in sorted(os.listdir(results_dir)) if name.endswith(".json") and DATED.search(name[:-5])]


def other_files(results_dir: str, families) -> list[str]:
    """Files that are neither a JSON result, a file named after one (its .md, .png) nor the index."""
    return [name for name in sorted(os.listdir(results_dir))
            if name != "README.md" and os.path.splitext(name)[0] not in families]


def _num(value, spec: str = ".3g") -> str:
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return format(value, spec)
    return "-"


def _train_rows(rows, meta):
    for r in rows:
        if r.get("status", "ok") != "ok":  # not measured (timed out, skipped for the call's budget): no headline
            continue
        compiled = " compiled" if r.get("compile") else ""
        batch = r.get("batch") or (r["micro"] * r.get("gas", 1) if "micro" in r else None)  # newer rows: micro x gas
        what = f"train {r['preset']} seq {r.get('seq')} batch {batch}{compiled}"
        peak = meta.get("matmul_peak_tflops")  # the row's own where it has one: rows of several calls keep theirs
        if r.get("MFU_meas") and r.get("TFLOP/s"):
            peak = r["TFLOP/s"] / r["MFU_meas"]
        yield (what, f"{_num(r['tok/s'], ',.0f')} tok/s, MFU {_num(r.get('MFU_meas'), '.1%')}",
               f"{_num(r.get('TFLOP/s'), '.0f')} of {_num(peak, '.0f')} TFLOP/s matmul peak", r.get("commit"),
               r.get("gpu"), r.get("date"))


def _kernel_rows(rows, meta):
    sdpa = {}
    for r in rows:
        if str(r["op"]).startswith("sdpa"):
            sdpa[r["T"]] = max(sdpa.get(r["T"], 0.0), r.get("fwdbwd_Mtok/s") or 0.0)
    for r in rows:
        if r.get("T") in HEADLINE_T and not str(r["op"]).startswith(("sdpa", "fla", "model")):
            anchor = f"best SDPA {_num(sdpa[r['T']], '.2f')}" if r["T"] in sdpa else "-"
            yield (f"{r['op']} T={r['T']} M={r.get('M')}",
                   f"{_num(r.get('fwd_Mtok/s'), '.1f')} fwd / {_num(r.get('fwdbwd_Mtok/s'), '.2f')} fwd+bwd Mtok/s",
                   anchor + " fwd+bwd Mtok/s" if anchor != "-" else anchor)


def _nats_attention_rows(rows, meta):
    for r in rows:
        if r.get("T") in HEADLINE_T and r.get("pass") == "fwd+bwd" and r.get("kept") in (0.1, 0.5):
            yield (f"NAtS attention T={r['T']} kept {_num(r['kept'], '.0%')} fwd+bwd",
                   f"{_num(r['ours_ms'], '.2f')} ms",
                   f"SDPA causal {_num(r.get('sdpa_causal_ms'), '.2f')} ms ({_num(r.get('speedup_vs_sdpa'), '.1f')}x)")


def _gdn_rows(rows, meta):
    for r in rows:
        if r.get("T") in HEADLINE_T and r.get("kept_%") in (10, 50):
            yield (f"NAtS GDN T={r['T']} kept {r['kept_%']}%",
                   f"fwd {_num(r['fwd_ms'], '.2f')} ms, fwd+bwd {_num(r.get('fwd_bwd_ms'), '.2f')} ms",
                   f"fla fwd {_num(r.get('fla_fwd_ms'), '.2f')} ms")


def _recall_rows(rows, meta):
    for r in rows:
        setting = f"{r['keys']} keys" if "keys" in r else f"depth {r.get('depth')}"
        yield (f"{r['task']} {meta.get('pattern', '')} L={r['length']} {setting}", _num(r["accuracy"], ".3f"),
               "accuracy")


def _eval_rows(rows, meta):
    for r in rows:
        yield (f"{r['preset']} {r['mixer']} T={r['T']}: eval ppl forward, decode after a T-token prompt",
               f"{_num(r['eval_tok/s'], ',.0f')} tok/s eval, {_num(r.get('decode_tok/s B=1'), ',.0f')} / "
               f"{_num(r.get('decode_tok/s B=16'), ',.0f')} tok/s decode at batch 1 / 16",
               f"prefill {_num(r.get('prefill_ms'), '.1f')} ms")


def _s4d_rows(rows, meta):
    """bench_s4d: each compiled contraction against the Interdomain op of the same heads and context."""
    op_ms = {}
    for r in rows:
        if str(r["op"]).startswith("I "):
            op_ms[r["heads"], r["T"]] = r["fwdbwd_ms"]
        elif r.get("T") in HEADLINE_T and "compiled" in str(r["op"]) and "fwdbwd_ms" in r:
            yield (f"{r['op']} {r['heads']} heads T={r['T']} fwd+bwd", f"{_num(r['fwdbwd_ms'], '.2f')} ms",
                   f"Interdomain op {_num(op_ms.get((r['heads'], r['T'])), '.2f')} ms")


# (columns a row must have, rule): the first rule whose columns the first row has.
RULES = [
    ({"preset", "tok/s"}, _train_rows),
    ({"op", "fwdbwd_Mtok/s"}, _kernel_rows),
    ({"speedup_vs_sdpa", "ours_ms"}, _nats_attention_rows),
    ({"fla_fwd_ms", "fwd_ms"}, _gdn_rows),
    ({"task", "accuracy"}, _recall_rows),
    ({"mixer", "eval_tok/s"}, _eval_rows),
    ({"op", "fwdbwd_ms", "peak_MiB"}, _s4d_rows),
]


def _ppl_lines(data):
    for result in data.get("results", []):
        buckets = result.get("buckets", [])
        curve = ", ".join(f"{b['bucket']}: {_num(b['ppl'], '.2f')}" for b in buckets)
        yield (f"ppl {result.get('label')}", curve or "-", f"trained at {result.get('train_length')}")


def _model_lines(data):
    meta = _meta(data)
    for label, model in data["models"].items():
        train, buckets = model.get("train", {}), model.get("ppl_buckets") or [{}]
        yield (f"{meta.get('config', 'model')} {label} (`{model.get('pattern')}`) valid ppl",
               f"{_num(train.get('valid_ppl'), '.2f')} (positions {buckets[-1].get('bucket', '-')}: "
               f"{_num(buckets[-1].get('ppl'), '.2f')})", f"trained at {meta.get('train_length', '-')}")


def headlines(name: str, data) -> list[tuple]:
    if not isinstance(data, dict):
        return [(name, "-", "not a {meta, rows} record")]
    if "error" in data:
        return [(name, "-", data["error"])]
    meta = _meta(data)
    if isinstance(data.get("results"), list):
        return list(_ppl_lines(data))
    if isinstance(data.get("models"), dict):
        try:
            return list(_model_lines(data)) or [(name, "-", "no models")]
        except (AttributeError, TypeError, ValueError) as err:
            return [(name, "-", f"models record not read ({type(err).__name__}: {err})")]
    rows = [r for r in data.get("rows", []) if isinstance(r, dict)] if isinstance(data.get("rows"), list) else []
    for columns, rule in RULES:
        if rows and columns <= set(rows[0]):
            try:
                return list(rule(rows, meta)) or [(name, "-", "no row at the headline lengths")]
            except (KeyError, TypeError, ValueError) as err:
                return [(name, "-", f"rule {rule.__name__} failed on a row ({type(err).__name__}: {err})")]
    return [(name, f"{len(rows)} rows", "tuning data, no headline rule: see the .md beside it")]


def latest(lines: list[tuple]) -> list[tuple]:
    """One headline per setting: a tool that appends a later run's rows to its file (bench_train's
    --continue-from, rows re-measured at a newer commit) supersedes the earlier row of the same setting, which
    keeps its place in the table."""
    by_what = {}
    for line in lines:
        by_what[line[0]] = line
    return list(by_what.values())


def render(results_dir: str) -> str:
    lines = ["# Measured results", "",
             "The current result of each benchmark (one file per family, overwritten by the tool that measures it; "
             "git keeps the earlier ones), one headline row per setting (4K and 16K tokens where the file has "
             "lengths). Regenerate with `python tools/summarize_results.py` after a tool writes a result; every "
             "number links to its file, which has the full table and the settings. Earlier results are in git: "
             "`git log --follow tools/results/FAMILY.json`; a reference `REV:tools/results/NAME` in a README or a "
             "docstring is such a file (`git show REV:tools/results/NAME`).", "",
             "| what | value | anchor | date | GPU | commit | file |", "| --- | --- | --- | --- | --- | --- | --- |"]
    current = current_files(results_dir)
    variants = [f for f in current
                if f not in SUITES and any(f.startswith(base + "-") for base in current if base != f)]
    for family, (name, data) in current.items():
        if family in variants:
            continue
        meta = _meta(data)
        for what, value, anchor, *own in latest(headlines(family, data)):  # a row may name its commit, card, date
            commit, card, date = (list(own) + [None] * 3)[:3]
            cells = [what, value, anchor, str(date or meta.get("date", "-")),
                     str(card or meta.get("gpu") or meta.get("device") or "-"), str(commit or meta.get("commit", "-")),
                     f"[{name}]({name})"]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    if variants:
        listed = ", ".join(f"[{current[f][0]}]({current[f][0]}) ({_meta(current[f][1]).get('date', '-')}, "
                           f"{_meta(current[f][1]).get('commit', '-')})" for f in variants)
        lines += ["", f"Variants, tuning sweeps and probes of the families above: {listed}."]
    others = other_files(results_dir, current)
    if others:
        lines += ["", "Notes and raw logs (no JSON beside them): "
                  + ", ".join(f"[{name}]({name})" for name in others) + "."]
    return "\n".join(lines) + "\n"


def _meta(data) -> dict:
    return data["meta"] if isinstance(data, dict) and isinstance(data.get("meta"), dict) else {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when README.md differs from a regeneration or a JSON result is named with a date")
    args = parser.parse_args(argv)
    text, path = render(args.results), os.path.join(args.results, "README.md")
    if args.check:
        current = open(path).read() if os.path.isfile(path) else ""
        snapshots = dated(args.results)
        if snapshots:
            print(f"named with a date (one current FAMILY.json per benchmark; git keeps the history): "
                  f"{', '.join(snapshots)}")
        print("up to date" if current == text else f"{path} is out of date: run python tools/summarize_results.py")
        return 0 if current == text and not snapshots else 1
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
