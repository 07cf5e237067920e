# Shared by the megahybrid sbatch templates (sourced by the batch script, never run alone): environment,
# signal forwarding, the launch itself and the requeue decision. Exit codes of a job, as the trainer's:
#   0 done | 3 stopped by a signal after saving (requeued until MH_MAX_REQUEUES) | 2 config or data error
#   4 stopped after non-finite losses | 1 (or anything else) crash. None but 3 is requeued.

mh_environment() {
    # Rendezvous on the allocation's first node. The port depends on the job id, so jobs sharing a node differ,
    # and on the restart, so a requeued run does not meet its predecessor's port still in TIME_WAIT.
    local first
    MH_RESTART=${SLURM_RESTART_COUNT:-0}
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    MASTER_ADDR=$(scontrol show node "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    export MASTER_ADDR=${MASTER_ADDR:-$first}
    export MASTER_PORT=$((20000 + (SLURM_JOB_ID + 7919 * MH_RESTART) % 20000))
    export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    MH_JOB=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
    MH_JOB=${MH_JOB:-$SLURM_JOB_ID}
    MH_LOG_DIR=$RUN_DIR/slurm/logs
    # Every rank writes its exit code here: torchrun reports 1 for any failed worker, and srun the largest code.
    export MEGAHYBRID_EXIT_DIR=$RUN_DIR/slurm/exit/$MH_JOB.$MH_RESTART
    rm -rf "$MEGAHYBRID_EXIT_DIR"
    mkdir -p "$MH_LOG_DIR" "$MEGAHYBRID_EXIT_DIR"
    echo "megahybrid: job $MH_JOB (restart $MH_RESTART) on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"
    echo "megahybrid: rank logs $MH_LOG_DIR/$MH_JOB.$MH_RESTART-*.log, TensorBoard $RUN_DIR/tensorboard"
}

mh_forward() {
    # Slurm signals only this batch shell (--signal=B:...); scancel without --batch reaches every job step.
    echo "megahybrid: got SIG$1, forwarding it to the ranks (they save a checkpoint and exit 3)"
    MH_SIGNALLED=$1
    scancel --signal="$1" "$SLURM_JOB_ID"
}

mh_launch() {
    # Run the launcher in the background: bash runs a trap only between commands, and `wait` returns early.
    trap 'mh_forward USR1' USR1
    trap 'mh_forward TERM' TERM
    "$@" &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        wait "$pid"
    done
    wait "$pid"
    MH_CODE=$?
    trap - USR1 TERM
}

mh_ranks_code() {
    # The ranks' common exit code when all $1 wrote the same one, else the launcher's ($2), but never 0 or 3
    # then: ranks that did not all finish, or not all save, are a crash and must not be requeued.
    local files codes
    shopt -s nullglob
    files=("$MEGAHYBRID_EXIT_DIR"/rank*)
    shopt -u nullglob
    codes=$(cat "${files[@]}" /dev/null | sort -u)
    if [ "${#files[@]}" -eq "$1" ] && [ "$(echo "$codes" | wc -w)" -eq 1 ]; then
        echo "$codes"
    elif [ "$2" -eq 0 ] || [ "$2" -eq 3 ]; then
        echo 1
    else
        echo "$2"
    fi
}

mh_finish() {
    # $1: the number of ranks. Requeue on 3 (below the limit), else exit with the trainer's code.
    local code
    code=$(mh_ranks_code "$1" "$MH_CODE")
    case $code in
        0) echo "megahybrid: training finished" ;;
        2) echo "megahybrid: config or data error (exit 2); see $MH_LOG_DIR" ;;
        4) echo "megahybrid: stopped after non-finite losses (exit 4); see $MH_LOG_DIR" ;;
        3) mh_requeue ;;
        *) echo "megahybrid: crashed (launcher exit $MH_CODE); see $MH_LOG_DIR" ;;
    esac
    exit "$code"
}

mh_requeue() {
    if [ "$MH_RESTART" -ge "$MH_MAX_REQUEUES" ]; then
        echo "megahybrid: saved and stopped (exit 3), not requeued: $MH_RESTART requeues reached MH_MAX_REQUEUES"
        return
    fi
    echo "megahybrid: saved and stopped (exit 3), requeueing job $SLURM_JOB_ID (requeue $((MH_RESTART + 1)) of $MH_MAX_REQUEUES)"
    scontrol requeue "$SLURM_JOB_ID" || echo "megahybrid: scontrol requeue failed; resubmit to resume"
}
