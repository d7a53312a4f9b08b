# What both Slurm templates share, sourced by single_node.sbatch and multi_node.sbatch (not run on
# its own): the environment, ranks per node, the interpreter, a run dir that survives a requeue,
# and running torchrun in the background so that a preemption signal reaches it, followed by the
# requeue. The template runs one of `run_and_wait COMMAND...` and then `requeue_or_exit`.
#
# Knobs (export before sbatch; the job inherits your environment):
#   NCCL_DEBUG=INFO                  NCCL prints its transport choice and errors (WARN is quieter)
#   NCCL_SOCKET_IFNAME=ib0|eth0      network interface for NCCL's bootstrap and socket transport;
#   GLOO_SOCKET_IFNAME=eth0          the same for gloo (CPU runs); set both on multi-homed nodes
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a rank that hits a NCCL error or timeout tears the job
#                                    down instead of hanging (set below unless you set it)
#   PYTHONFAULTHANDLER=1             Python tracebacks on segfaults and fatal signals (set below)
#   DDPTRAIN_PYTHON=/path/python     interpreter with ddptrain installed (else torchrun on PATH)
#   DDPTRAIN_NPROC_PER_NODE=N        ranks per node (default: the node's GPUs, else 1 on CPU)
#   DDPTRAIN_RUN_DIR=DIR             run.dir when no run.dir= override is given
#                                    (default runs/<job name>-<job id>, stable across requeues)
#   DDPTRAIN_PREEMPT_SIGNAL=USR1     signal forwarded to the trainer on preemption; must be one of
#                                    the trainer's checkpoint.preempt_signals (SIGTERM, SIGUSR1)
#   DDPTRAIN_PREEMPT_GRACE=240       seconds torchrun lets ranks checkpoint before SIGKILL
#   DDPTRAIN_PREEMPT_EXIT_CODE=75    the job's exit code after requeueing; keep it equal to the
#                                    trainer's checkpoint.preempt_exit_code (75, EX_TEMPFAIL)
#   DDPTRAIN_LAUNCH_DIR=DIR          where this file is, when the templates cannot find it

cd "${SLURM_SUBMIT_DIR:-.}"

export PYTHONFAULTHANDLER="${PYTHONFAULTHANDLER:-1}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
preempt_signal="${DDPTRAIN_PREEMPT_SIGNAL:-USR1}"
preempt_signal="${preempt_signal#SIG}"
preempt_exit_code="${DDPTRAIN_PREEMPT_EXIT_CODE:-75}"
# torchrun forwards only SIGTERM/INT/HUP/QUIT to its workers by default (any other signal kills
# torchrun itself); add ours. Recent torchrun reads it from --signals-to-handle, whose env form is
# PET_SIGNALS_TO_HANDLE, and overwrites TORCHELASTIC_SIGNALS_TO_HANDLE, which older ones read.
# Then give the ranks time to write the checkpoint before torchrun escalates to SIGKILL
# (--shutdown-timeout; torch releases without it wait 30 s).
handled_signals="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIG$preempt_signal"
export PET_SIGNALS_TO_HANDLE="$handled_signals" TORCHELASTIC_SIGNALS_TO_HANDLE="$handled_signals"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${DDPTRAIN_PREEMPT_GRACE:-240}"

# Ranks per node: explicit setting, else the GPUs Slurm gave this node, else 1 (CPU, gloo).
gpus_on_node() {
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "$CUDA_VISIBLE_DEVICES" != NoDevFiles ]]; then
        tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}
nproc_per_node="${DDPTRAIN_NPROC_PER_NODE:-$(gpus_on_node)}"
((nproc_per_node > 0)) || nproc_per_node=1

# The interpreter: DDPTRAIN_PYTHON if set (torchrun is `python -m torch.distributed.run`).
if [[ -n "${DDPTRAIN_PYTHON:-}" ]]; then
    torchrun=("$DDPTRAIN_PYTHON" -m torch.distributed.run)
else
    torchrun=(torchrun)
fi

# The Hydra overrides (the template's arguments). A requeued job must find its checkpoint: give
# it a run dir that survives the requeue.
overrides=("$@")
has_run_dir=0
for arg in "$@"; do
    if [[ "$arg" =~ ^\+{0,2}run\.dir= ]]; then has_run_dir=1; fi
done
((has_run_dir)) ||
    overrides+=("run.dir=${DDPTRAIN_RUN_DIR:-runs/${SLURM_JOB_NAME:-ddptrain}-${SLURM_JOB_ID:-local}}")

# run_and_wait COMMAND...: run it in the background and `wait` for it (bash runs a trap only
# between commands, and `wait` is one that a signal interrupts); the preemption signal is passed
# on to it. Sets `status` (its exit status) and `preempted` (1 if the signal came).
preempted=0
status=0
train_pid=""
run_and_wait() {
    trap on_preempt "$preempt_signal"
    "$@" &
    train_pid=$!
    while true; do
        status=0
        wait "$train_pid" || status=$?
        ((status > 128)) || break
        # >128: a trapped signal interrupted `wait` (or the command died of a signal). Still
        # running? wait again; gone? `wait` once more returns its real, remembered exit status.
        if ! kill -0 "$train_pid" 2>/dev/null; then
            status=0
            wait "$train_pid" || status=$?
            break
        fi
    done
    trap - "$preempt_signal"
}

on_preempt() {
    preempted=1
    echo "ddptrain: SIG$preempt_signal received, asking the trainer to checkpoint and stop"
    kill -s "$preempt_signal" "$train_pid" 2>/dev/null || true
}

# requeue_or_exit: after a preemption, requeue the job (it resumes from the checkpoint the ranks
# wrote) and exit with DDPTRAIN_PREEMPT_EXIT_CODE; otherwise exit with the command's status.
requeue_or_exit() {
    if ((preempted)); then
        if ((status == 0)); then
            echo "ddptrain: training finished before it could be preempted"
            exit 0
        fi
        # torchrun (and srun) report any rank's non-zero exit as a failure of their own, so the
        # trainer's checkpoint.preempt_exit_code shows in the logs above, not in $status.
        echo "ddptrain: training stopped (status $status); requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit "$preempt_exit_code"
    fi
    exit "$status"
}
