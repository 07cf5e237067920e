"""All mixer-op benchmarks in one GPU call, then the targets of issues 3 and 4 from their results.

Runs tools/bench_interdomain.py, bench_nats_gdn.py and bench_nats_attention.py in turn (each writes
tools/results/<op>.{json,md}), then reads the results and reports the Interdomain targets and, at T = 4K
with 25 % attention chunks, (selected GDN + selected attention) fwd+bwd over GDN alone (our selected GDN with 0 %
kept chunks, since fla's gated backward is refused on Hopper with Triton 3.6).

    python tools/bench_mixers.py [--ops interdomain nats-gdn nats-attention] [--summary-only]
"""
import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
SCRIPTS = {
    "interdomain": "bench_interdomain.py",
    "nats-gdn": "bench_nats_gdn.py",
    "nats-attention": "bench_nats_attention.py",
}
NATS_TARGET = 1.4  # issue 4: both ops fwd+bwd <= 1.4x GDN alone at T = 4K, 25 % attention chunks
SDPA_SPEEDUP_TARGET = 2.0  # issue 4: at T = 16K, >= 2x faster than causal SDPA (a d = 2048 layer: 16 heads x 128)
# issue 3: Interdomain M = 32 fwd+bwd >= 10M tokens/s, flat within 15 % from 2K to 64K, >= 2x faster than SDPA at 8K
ID_MTOKS_TARGET, ID_FLAT_TARGET, ID_SDPA_T, ID_SDPA_SPEEDUP = 10.0, 0.15, 8192, 2.0


def latest_rows(name: str) -> list[dict]:
    path = TOOLS / "results" / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"no results for {name} in tools/results; run without --summary-only on a GPU")
    return json.loads(path.read_text())["rows"]


def nats_summary(T: int = 4096, kept: float = 0.25) -> dict:
    gdn = {(r["T"], r["kept_%"]): r["fwd_bwd_ms"] for r in latest_rows("nats-gdn")}
    attn = {(r["T"], r["kept"]): r["ours_ms"] for r in latest_rows("nats-attention") if r["pass"] == "fwd+bwd"}
    both = gdn[(T, round(kept * 100))] + attn[(T, kept)]
    alone = gdn[(T, 0)]
    return {"T": T, "kept": kept, "gdn_ms": gdn[(T, round(kept * 100))], "attention_ms": attn[(T, kept)],
            "gdn_alone_ms": alone, "ratio": both / alone, "target": NATS_TARGET, "met": both / alone <= NATS_TARGET}


def nats_vs_sdpa(T: int = 16384, kept: float = 0.25) -> dict:
    """Both NAtS-L ops against the fastest causal SDPA backend of a softmax layer of the same width."""
    gdn = {(r["T"], r["kept_%"]): r["fwd_bwd_ms"] for r in latest_rows("nats-gdn")}
    attn = {(r["T"], r["kept"]): r["ours_ms"] for r in latest_rows("nats-attention") if r["pass"] == "fwd+bwd"}
    sdpa = min(r["fwdbwd_ms"] for r in latest_rows("interdomain") if r["op"].startswith("sdpa")
               and r["T"] == T)
    both = gdn[(T, round(kept * 100))] + attn[(T, kept)]
    return {"both_ms": both, "sdpa_ms": sdpa, "speedup": sdpa / both, "met": sdpa / both >= SDPA_SPEEDUP_TARGET}


def interdomain_summary(M: int = 32) -> dict:
    rows = latest_rows("interdomain")
    ours = {r["T"]: r for r in rows if r["op"] == "interdomain C=64" and r["M"] == M}
    rates = [r["fwdbwd_Mtok/s"] for r in ours.values()]
    sdpa = min(r["fwdbwd_ms"] for r in rows if r["op"].startswith("sdpa") and r["T"] == ID_SDPA_T)
    spread = max(rates) / min(rates) - 1
    speedup = sdpa / ours[ID_SDPA_T]["fwdbwd_ms"]
    return {"Mtoks": (min(rates), max(rates)), "spread": spread, "sdpa_ms": sdpa, "speedup": speedup,
            "met": (min(rates) >= ID_MTOKS_TARGET, spread <= ID_FLAT_TARGET, speedup >= ID_SDPA_SPEEDUP)}


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=sorted(SCRIPTS), default=list(SCRIPTS))
    parser.add_argument("--summary-only", action="store_true", help="only read tools/results and report")
    args = parser.parse_args()
    if not args.summary_only:
        for op in args.ops:
            print(f"== {op} ({datetime.datetime.now():%H:%M:%S})", flush=True)
            subprocess.run([sys.executable, str(TOOLS / SCRIPTS[op])], check=True)
    ids = interdomain_summary()
    print(f"Interdomain M=32 fwd+bwd, 2K-64K: {ids['Mtoks'][0]:.2f}-{ids['Mtoks'][1]:.2f} M tok/s (target >= "
          f"{ID_MTOKS_TARGET}: {_met(ids['met'][0])}); spread {ids['spread']:.0%} (target <= {ID_FLAT_TARGET:.0%}: "
          f"{_met(ids['met'][1])}); at 8K {ids['speedup']:.2f}x causal SDPA's {ids['sdpa_ms']:.2f} ms (target >= "
          f"{ID_SDPA_SPEEDUP}: {_met(ids['met'][2])})")
    summary = nats_summary()
    print("NAtS-L ops at T=4K, 25% attention chunks, fwd+bwd: "
          f"GDN {summary['gdn_ms']:.2f} ms + attention {summary['attention_ms']:.2f} ms = "
          f"{summary['ratio']:.2f}x GDN alone ({summary['gdn_alone_ms']:.2f} ms); target <= {NATS_TARGET}: "
          f"{_met(summary['met'])}")
    vs = nats_vs_sdpa()
    print(f"NAtS-L ops at T=16K, 25%: {vs['both_ms']:.2f} ms vs causal SDPA 16x128 (fastest backend) "
          f"{vs['sdpa_ms']:.2f} ms = {vs['speedup']:.2f}x; target >= {SDPA_SPEEDUP_TARGET}: "
          f"{_met(vs['met'])}")


if __name__ == "__main__":
    main()
