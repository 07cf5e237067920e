#!/usr/bin/env bash
# The GPU checks a device session runs, each part fitting one call: every gpu-marked test (each kernel's backward
# against the fp32 reference ON the GPU: Triton 3.6 on Hopper miscompiles some layouts silently), then the
# Interdomain benchmark. Run from the repo root on the device machine with `.whl` carried:
#   MEGAHYBRID_COMMIT=<hash> bash tools/gpu_check.sh [pending|keep-states|mix|s4d|s4d-pieces|s4d-train|prefill-seg|segments-train|scope|clip|profile|mixers|gdn-probe|cp|kernels|stack|bench|paper|precision|recall|recall-diag|all]
# pending: the GPU tests of what changed since the last H200 run; kernels: tests/kernels (about 4 minutes); stack:
# the other gpu tests, which train, export and decode models in subprocesses (about 5 minutes); all: both then
# bench, more than one call's 10 minutes. The tests run in 14 processes (pytest-xdist, in the device image): one
# after the other they take far longer than a call. Logs go to $OUT.
# Before a call, on this machine (no GPU needed): python tools/check_hopper_compile.py, which compiles every kernel
# for sm_90 and names the compile errors the interpreter's tests cannot see.
. tools/gpu_env.sh || exit 1
mode=${1:-kernels}
set -o pipefail
export PYTHONFAULTHANDLER=1

run_tests() {  # NAME PATHS...: stops at 290 s with a summary (SIGINT), the log in $OUT/gpu-tests-NAME.log
  local name=$1
  shift
  timeout -s INT -k 20 290 python3 -m pytest -n 14 -v -m "${MARK-gpu}" -p no:cacheprovider --timeout 260 --tb=short -rfE \
    "$@" 2>&1 | tee "${OUT:-/tmp}/gpu-tests-$name.log" | grep -E "^(FAILED|ERROR)|Timeout|passed|failed"
}

paper_plans() {  # LIMIT_S BUDGET_S PLAN...: the paper shapes at 4K and 16K once per InterdomainPlan override
  # (FIELD=VALUE), each result in $OUT as interdomain-paper-FIELD-VALUE.{md,json}
  local limit=$1 budget=$2 p
  shift 2
  for p in "$@"; do
    timeout -k 5 "$limit" python3 tools/bench_interdomain.py --paper --quick --budget-s "$budget" --plan "$p" 2>&1 |
      grep -v -i warn | tail -7
    cp tools/results/interdomain-paper-plan.md "${OUT:-/tmp}/interdomain-paper-${p/=/-}.md"
    cp tools/results/interdomain-paper-plan.json "${OUT:-/tmp}/interdomain-paper-${p/=/-}.json"
  done
}

if [ "$mode" = pending ]; then  # every GPU test passed on the H200 (669598c; fla at 513bef4; the Interdomain kernels
  # at ea500e9; session 16's at c7dda94; session 17's at 6d2c00a: gpu-tests-2026-12-02.md row 22); tests/kernels at
  # 0056fcb on an H100 (row 30); the model tests with mix_in_input_dtype and the Interdomain kernel tests at a34a4dc
  # on the H200 (rows 31-32); the TF32 op's at f423cf7 on an H100 (row 37). Pending: the training steps with
  # optimizer.clip_on_device (dac7ee7: in bf16 only our device flag cancels a NaN step), every mixer eager and
  # compiled and the clip/skip against DeepSpeed's; the cross entropy that saves the logits; pinned batches;
  # benchutil.host_waits (the host syncs bench_train/bench_cp --profile count) (about 3 minutes)
  run_tests train tests/test_train_gpu.py tests/test_loss.py tests/test_data.py tests/test_usability.py
fi
if [ "$mode" = s4d ]; then  # #12: the chunked S4D contraction, D's default since it ran 1.9x the FFT compiled (1440cd6,
  # session 21, tests 11 passed): its GPU tests, then FFT against chunks of 32 and 64 tokens, eager and compiled,
  # next to the I op, and where the compiled chunked-32's time goes (about 5 minutes; D's op 9.5 ms, I's 7.3 ms)
  run_tests s4d tests/kernels/test_s4d_chunk.py tests/kernels/test_custom_ops.py
  timeout -k 5 420 python3 tools/bench_s4d.py --budget-s 300 --chunk-sizes 32,64 --profile 2>&1 | grep -v -i warn |
    tail -30
  cp tools/results/bench_s4d.* "${OUT:-/tmp}/"
fi
if [ "$mode" = keep-states ]; then  # #12: InterdomainPlan.keep_states (the backward takes the forward's chunk states
  # instead of rescanning; the default since the H100 run at cb126b0: 7.44 against 7.91 ms at 12 x 64, 4K): the
  # paper shapes at 4K and 16K with it on and off, then the Interdomain kernel tests (test_segmented_scans_gpu_bf16
  # runs it both ways); on an H200 (10a28ad, rescanning): 7.19 / 7.30 ms at 12 x 64, 0.52x / 1.83x cuDNN
  paper_plans 150 100 keep_states=true keep_states=false
  run_tests interdomain tests/kernels/test_interdomain.py tests/kernels/test_interdomain_torch.py \
    tests/kernels/test_custom_ops.py
fi
if [ "$mode" = mix ]; then  # #12: InterdomainPlan.mix_in_input_dtype (the readout kernels' a P and d(a P) P^H
  # products in bf16 instead of fp32 at tf32; the default since 0056fcb's H100 run: 7.04 against 7.46 ms at 12 x 64,
  # 4K): the paper shapes at 4K and 16K with it on and off; its GPU tests: test_readout_gpu_* in the kernels mode
  paper_plans 130 90 mix_in_input_dtype=true mix_in_input_dtype=false
fi
if [ "$mode" = s4d-pieces ]; then  # #12/#13: where a 125M `D` layer call's time goes next to `I`'s (8 x 4096 tokens,
  # compiled): input path, conv, norms, the contraction chunked and by FFT, output projection; D trains at 180.2K
  # tok/s against I's 227.9K (1440cd6), its op alone 9.5 against 7.3 ms
  for p in D I; do
    timeout -k 5 270 python3 tools/bench_interdomain_pieces.py --pattern $p 2>&1 | grep -v -i warn | tail -12
  done
  cp tools/results/s4d-pieces.* tools/results/interdomain-pieces.* "${OUT:-/tmp}/"
fi
if [ "$mode" = s4d-train ]; then  # #12/#13: 125M `D` through `megahybrid train`'s step, FFT and chunked contraction in
  # one run (1440cd6: FFT 150.9K tok/s, chunked 180.2K; warm-ups 183 and 202 s)
  timeout -k 5 575 python3 tools/bench_train.py --no-baseline --name bench_train-s4d --budget-s 550 \
    --row-timeout-s 270 --rows 125m@D:none:8 125m@D+interdomain.contraction=chunked:none:8 2>&1 | grep -v -i warn |
    tail -6
  cp tools/results/bench_train-s4d.* "${OUT:-/tmp}/"
fi
if [ "$mode" = prefill-seg ]; then  # #14: model.nats.gdn_segments: its GPU tests, then the 128K prefill of natsl-340m's
  # Hybrid at 1 and 8 segments against `S`, eager, graphed and compiled (1440cd6: compiled 417.2 and 409.7 ms, S
  # 1788 ms; tests 2 passed once the fp32 case ran the kernels' products in IEEE): 8x the state walk's parallelism
  # gained 2%, so the next run profiles both (kernels and GPU time per module) to find what holds the prefill
  timeout -k 5 560 python3 tools/bench_nats_layer.py --prefill-only --compile --profile --gdn-segments 1,8 2>&1 |
    grep -v -i warn | tail -8
  cp tools/results/nats-layer-prefill.* "${OUT:-/tmp}/"
fi
if [ "$mode" = segments-train ]; then  # #14/#20: natsl-340m's `G` at 16K in micro-batches of 1 (6 GDN rows per call
  # of the state kernels, as the prefill) through `megahybrid train`'s step, with and without model.nats.gdn_segments
  timeout -k 5 575 python3 tools/bench_train.py --no-baseline --name bench_train-gdn-segments --budget-s 550 \
    --row-timeout-s 270 --rows natsl-340m@G:none:1:16384 natsl-340m@G+nats.gdn_segments=4:none:1:16384 2>&1 |
    grep -v -i warn | tail -6
  cp tools/results/bench_train-gdn-segments.* "${OUT:-/tmp}/"
fi
if [ "$mode" = scope ]; then  # #15/#20: train.compile_scope=layers against the default whole-model compile, warm-up
  # and tok/s (session 19: natsl-340m's whole-model warm-up took 247 s, N's over 260 s; bench_train-mixers.md has
  # the whole-model rows at ef94593)
  timeout -k 5 575 python3 tools/bench_train.py --no-baseline --name bench_train-compile-scope --budget-s 550 \
    --row-timeout-s 300 --rows natsl-340m+train.compile_scope=layers:none:4 125m@S+train.compile_scope=layers:none:8 \
    natsl-340m@N+train.compile_scope=layers:none:4 125m@I+train.compile_scope=layers:none:8 2>&1 |
    grep -v -i warn | tail -8
  cp tools/results/bench_train-compile-scope.* "${OUT:-/tmp}/"
fi
if [ "$mode" = clip ]; then  # #15: optimizer.clip_on_device (the ZeRO-1/2 step reads the device once, where
  # DeepSpeed's clipping read the norm once per param group and our skip decision once more), on and off at 125m and
  # 350m, profiled as `profile` does (at f423cf7, before it, on an H100: 125m idle 33.6 ms of a 189 ms profiled step,
  # the baseline 4.2 ms; 350m 52.5 against 6.0 ms); since then each step is also read one step late (the training
  # loop's order, which bench_train follows) and the cross entropy keeps the logits, not the fp32 softmax
  PROFILE_ROWS=${PROFILE_ROWS:-"125m:none:8 125m+optimizer.clip_on_device=false:none:8 350m:none:8
    350m+optimizer.clip_on_device=false:none:8"} PROFILE_NAME=bench_train-clip mode=profile
fi
if [ "$mode" = profile ]; then  # #15: where the step's time goes, megahybrid against the plain-PyTorch baseline
  # (PROFILE_ROWS, default 350m at 4K), the top kernels of two compiled steps of each system in $OUT/NAME.log; at
  # f423cf7 on an H100 (bench_train-profile.md) megahybrid ran fewer kernel-ms than the baseline at 125m, 350m and
  # 1.3b, and lost 0.93x / 0.98x / 1.01x to time no kernel ran
  budget=${PROFILE_BUDGET_S:-550} name=${PROFILE_NAME:-bench_train-profile}  # budget: a call given less time
  timeout -k 5 $((budget + 25)) python3 tools/bench_train.py --name "$name" --budget-s "$budget" \
    --row-timeout-s $((budget < 300 ? budget : 300)) --profile 30 --rows ${PROFILE_ROWS:-350m:none:8} \
    > "${OUT:-/tmp}/$name.log" 2>&1
  grep -v -i warn "${OUT:-/tmp}/$name.log" |
    grep -E "^ *(megahybrid|baseline|system|kernel groups)" | tail -12
  cp tools/results/"$name".* "${OUT:-/tmp}/"
fi
if [ "$mode" = gdn-probe ]; then  # #14: one change at a time to the GDN forward state kernel, each variant in its own
  # process, checked against the stock kernel and timed at the 128K prefill and training shapes (about 6 minutes)
  timeout -k 5 560 python3 tools/probe_gdn_state.py --row-timeout-s 90 2>&1 | tail -30
  cp tools/results/gdn-state-probe.* "${OUT:-/tmp}/" 2>/dev/null
fi
if [ "$mode" = cp ]; then  # #18: one CP rank's compute at cp = 2 for the I and G models (64K context), compiled
  # layer by layer as training compiles, with the kernel times of the rank and of the shard without CP (0056fcb on an
  # H100, no profile: I 1.59, G 1.20 against the 1.1 target; c7dda94's eager table: I 1.29, G 1.16). At f423cf7
  # (H100) I 1.63, G 1.23, with 127 / 39 ms of the rank's wall time idle (kernels 1.18x / 1.15x the shard's): the
  # profile's `waits` entries (idle ms, host syncs and their lines, allocator retries) and the *_host_ms columns say
  # whether the host or a sync holds the GPU
  timeout -k 5 560 python3 tools/bench_cp.py --models 350m-interdomain natsl-340m@G --cps 2 --compile --profile 2>&1 |
    grep -v -i warn | tail -4
  cp tools/results/bench_cp.md "${OUT:-/tmp}/bench_cp-compiled.md"
  cp tools/results/bench_cp.json "${OUT:-/tmp}/bench_cp-compiled.json"
fi
if [ "$mode" = mixers ]; then  # #20: every mixer at 4K and 16K through `megahybrid train`'s step (--suite mixers,
  # about 20 minutes: more than one call). Each call keeps the ok rows of the last one: copy $OUT's
  # bench_train-mixers.json to tools/results before the next call (an untracked file travels with the tree).
  # MIXERS_BUDGET_S (default 550) fits a call given less than 600 s of device time
  prev=tools/results/bench_train-mixers.json cont=() budget=${MIXERS_BUDGET_S:-550}
  [ -f "$prev" ] && cont=(--continue-from "$prev")
  timeout -k 5 $((budget + 25)) python3 tools/bench_train.py --suite mixers --no-baseline --name bench_train-mixers \
    --budget-s "$budget" --row-timeout-s $((budget < 420 ? budget : 420)) "${cont[@]}" 2>&1 |
    grep -v -i warn | tail -18
  cp tools/results/bench_train-mixers.* "${OUT:-/tmp}/"
fi
if [ "$mode" = recall ]; then  # #20: MQAR recall of repro-small architectures, each as a narrow MQAR model (d 128,
  # lr 1e-3, an 83-value task vocabulary: what learned recall on the CPU, session 13), 3000 steps of 64 at 256 tokens,
  # merged into a copy of the current result in $OUT; carry .carry (the 8K-vocab Wikipedia split). Three models a
  # call (RECALL_MODELS); the 20M models at full vocabulary learned no recall in 1000 steps (session 13). Run at
  # 513bef4 (session 14): S, G, Hybrid learned recall, D, I, Ig none; at 128 tokens (abe769c) S learned, I, Ig not,
  # while the demo config's narrow I learns on the GPU (recall-diag; tools/results/repro-small.md's note).
  mkdir -p data && ln -sfn "$PWD/.carry/wiki8k" data/wikipedia-en-8k
  cp tools/results/repro-small.json "${OUT:-/tmp}/"
  timeout -s INT -k 10 560 python3 tools/repro_small.py --data-dir data/wikipedia-en-8k --tokens 100000000 \
    --models "${RECALL_MODELS:-S,I,H}" --parallel 3 --recall-only --mqar-steps 3000 --mqar-batch 64 \
    --mqar-length "${MQAR_LENGTH:-256}" --mqar-vocab 256 \
    --mqar-overrides model.hidden_size=128,model.num_heads=2,model.ffn_hidden_size=512,optimizer.lr=1e-3 \
    --run-root /tmp/rr --results "${OUT:-/tmp}/repro-small" 2>&1 | tail -12
  for log in /tmp/rr/eval-recall-*/recall.log; do
    tail -c 4000 "$log" > "${OUT:-/tmp}/$(basename "$(dirname "$log")").log"
  done
fi
if [ "$mode" = recall-diag ]; then  # #20: what stops I's MQAR recall on the GPU (session 15). The narrow I of the CPU
  # runs that learned (demo config: 2 layers, d 128, 2 heads, ffn 512, lr 1e-3, 3000 steps) in variants side by
  # side, RECALL_DIAG="NAME:LENGTH:BATCH:VOCAB[:KEY=VALUE,...] ...". The default: A the CPU protocol (64 tokens,
  # batches of 16, 19 values), B 128 tokens in batches of 64, C 64 tokens with 83 values (--vocab 256): at ea500e9
  # A 1.00 / 1.00 / 1.00, B 0.56 / 0.39 / 0.30, C 1.00 / 0.99 / 0.98 at 4 / 8 / 16 keys. At 10a28ad, B with
  # :model.num_layers=8 1.00 / 1.00 / 1.00, :model.vocab_size=8192,model.seq_length=1024 1.00 / 1.00 / 1.00,
  # :model.num_layers=8,optimizer.lr=3e-4 0.56 / 0.42 / 0.31
  narrow="model.pattern=I model.hidden_size=128 model.num_heads=2 model.ffn_hidden_size=512 optimizer.lr=1e-3"
  diag() {  # NAME LENGTH BATCH VOCAB [OVERRIDES (comma-separated)]
    timeout -s INT -k 10 560 python3 -m megahybrid eval recall --train-config demo --train-steps 3000 \
      --train-length "$2" --lengths "$2" --keys 4,8,16 --vocab "$4" --out "/tmp/rd/$1" $narrow model.seq_length=128 \
      "batch.global_batch_size=$3" "batch.micro_batch_size=$3" ${5//,/ } > "${OUT:-/tmp}/recall-diag-$1.log" 2>&1
  }
  for variant in ${RECALL_DIAG:-A:64:16:64 B:128:64:64 C:64:16:256}; do
    IFS=: read -r name length batch vocab extra <<< "$variant"
    diag "$name" "$length" "$batch" "$vocab" "$extra" &
  done
  wait
  tail -n 9 "${OUT:-/tmp}"/recall-diag-*.log
fi
if [ "$mode" = paper ]; then  # #12: the op at the paper's shapes (12 and 32 heads x 64, M = 64, full readout)
  # against SDPA, 2K to 64K; the results files copied to $OUT
  timeout -k 5 280 python3 tools/bench_interdomain.py --paper --budget-s 200 2>&1 | tee "${OUT:-/tmp}/paper.log" |
    tail -14
  cp tools/results/interdomain-paper.* "${OUT:-/tmp}/"
fi
if [ "$mode" = precision ]; then  # the fp32 dot precision choices compared per op (issue #11), about 5 minutes
  timeout -k 5 560 python3 tools/bench_dot_precision.py 2>&1 | tee "${OUT:-/tmp}/dot-precision.log" | tail -12
fi
if [ "$mode" = kernels ] || [ "$mode" = all ]; then
  run_tests kernels tests/kernels
fi
if [ "$mode" = stack ] || [ "$mode" = all ]; then
  run_tests stack tests --ignore=tests/kernels
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  timeout -k 5 280 python3 tools/bench_interdomain.py --budget-s 200 2>&1 | tee "${OUT:-/tmp}/bench.log" | tail -45
fi
