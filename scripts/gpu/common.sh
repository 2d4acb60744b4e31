# The lines the GPU scripts share. Sourced from the repository root (`. scripts/gpu/common.sh`), it only
# defines functions; a script calls those it needs:
#   export_run_env          NVLink multicast off (KINDS.md), Python's output unbuffered, no downloads
#   install_wheels [WHEEL]  the carried wheels (default: all of .whl/*.whl) into /tmp/site, then /tmp/site
#                           first on PYTHONPATH; pip's status (PYTHONPATH is left alone if pip fails)
#   install_checkout        this checkout installed editable (pip install -e .), quietly; pip's status
#   record_machine DIR      DIR/gpu.csv (each GPU's name, memory, driver) and DIR/commit.txt (this commit)
#   mps_on, mps_off         CUDA MPS started (several runs share each GPU; a user daemon, no GPU setting
#                           changes) and stopped; mps_on says which through the script's own `log`
#   start_clock NAME        a run folder WORK=$SCRATCH/NAME in a new temporary SCRATCH, $OUT made, the clock
#                           started (T0); then `elapsed`, `left` (seconds before DEADLINE) and `say` (a line,
#                           timed, on the console and in WORK/progress.log and $OUT/progress.log)
#   limit_clock NAME DIR    for a script that stops at LIMIT seconds: DIR made afresh, $OUT made, the clock
#                           started (T0, DEADLINE=LIMIT, so `left` counts to it); then `log` (a line, timed,
#                           on the console and in DIR/log.txt)
#   install_for_runs        liger-kernel from .whl (the fused loss) and this checkout, each failure logged

export_run_env() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 FMR_OFFLINE=1
}

install_wheels() {
  [ $# -gt 0 ] || set -- .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" \
    || return
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

install_checkout() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
}

record_machine() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$1/gpu.csv" 2>&1
  git log -1 --format='%H %s' > "$1/commit.txt" 2>/dev/null
}

mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && log "MPS started" || log "MPS not started: runs share the GPU without it"
}
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null || true; }

start_clock() {
  SCRATCH=$(mktemp -d)
  WORK=$SCRATCH/$1
  mkdir -p "$WORK" "$OUT"
  T0=$(date +%s)
}
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
say() { echo "[$(elapsed) s $(date -u +%T)] $*" | tee -a "$WORK/progress.log" "$OUT/progress.log"; }

limit_clock() {
  CLOCK_NAME=$1; CLOCK_DIR=$2; T0=$(date +%s); DEADLINE=$LIMIT
  rm -rf "$CLOCK_DIR"; mkdir -p "$CLOCK_DIR" "$OUT"
  log() { echo "[$CLOCK_NAME $(elapsed) s] $*" | tee -a "$CLOCK_DIR/log.txt"; }
}
install_for_runs() {
  install_wheels .whl/liger*.whl || log "liger-kernel not installed: the fused loss runs its torch path"
  install_checkout || log "pip install -e . failed"
}
