#!/usr/bin/env bash
# One device call that checks what a GPU session must check, then times: every gpu-marked test (each kernel's
# backward against the fp32 reference ON the GPU: Triton 3.6 on Hopper miscompiles some layouts silently), then
# the Interdomain v1/v2 comparison. Run from the repo root on the device machine with `.whl` carried:
#   MEGAHYBRID_COMMIT=<hash> bash tools/gpu_check.sh [pytest-only|bench-only]
. tools/gpu_env.sh || exit 1
mode=${1:-all}
set -o pipefail
if [ "$mode" != bench-only ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "${OUT:-/tmp}/gpu-tests.log" | tail -25
fi
if [ "$mode" != pytest-only ]; then
  python3 tools/bench_interdomain.py --impl v1 v2 --only-ours --budget-s 150 2>&1 | tail -25
fi
