#!/usr/bin/env bash
# Nsight Compute on the eleven kernel launches of one Interdomain fwd+bwd (T = 2K, M = 32, bf16; 2 scans + forward,
# 2 scans + bwd_a + 2 reverse scans + dq, dk, dv; no segmented scan at this length): throughput against the peaks,
# occupancy, warp stall reasons, spill traffic.
# Run on the device machine from the repo root with `.whl` carried: bash tools/profile_interdomain.sh
# Writes $OUT/ncu-interdomain.txt (ncu is in the device image; about a minute).
. tools/gpu_env.sh || exit 1
ncu --clock-control none --kernel-name regex:'_(scan|fwd|bwd_a|bwd_part)_kernel' --launch-count 11 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 tools/bench_interdomain.py --once > "${OUT:-/tmp}/ncu-interdomain.txt" 2>&1
grep -E "^  _|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Spilling Req" \
  "${OUT:-/tmp}/ncu-interdomain.txt" | head -80
