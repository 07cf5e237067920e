#!/usr/bin/env bash
# One device call that checks what a GPU session must check, then times: every gpu-marked test (each kernel's
# backward against the fp32 reference ON the GPU: Triton 3.6 on Hopper miscompiles some layouts silently), then
# the Interdomain benchmark. Run from the repo root on the device machine with `.whl` carried:
#   MEGAHYBRID_COMMIT=<hash> bash tools/gpu_check.sh [pytest-only|bench-only]
# The tests run in 14 processes (pytest-xdist, in the device image): compiling every kernel variant one after the
# other took over 8 minutes, more than one call's limit. Logs go to $OUT.
. tools/gpu_env.sh || exit 1
mode=${1:-all}
set -o pipefail
export PYTHONFAULTHANDLER=1
if [ "$mode" != bench-only ]; then
  timeout -k 5 300 python3 -m pytest -n 14 -v -m gpu -p no:cacheprovider --timeout 280 tests/ 2>&1 \
    | tee "${OUT:-/tmp}/gpu-tests.log" | grep -E "FAILED|ERROR|Timeout|passed|failed"
fi
if [ "$mode" != pytest-only ]; then
  timeout -k 5 280 python3 tools/bench_interdomain.py --budget-s 200 2>&1 | tee "${OUT:-/tmp}/bench.log" | tail -45
fi
