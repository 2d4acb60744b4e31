#!/usr/bin/env bash
# Your model at speed, on one GPU (recipes/your_model.py; docs/your_model.md). One device command per part,
# each under 10 minutes, from the repository root of a fresh GPU machine; results under $OUT as one tar:
#
#   bash scripts/gpu/your_model_speed.sh check    # the fused-loss implementations compared
#                                                 # (devtools/your_model/fused_loss_bench.py), then fast == eager per
#                                                 # model family and fused == plain loss
#                                                 # (devtools/your_model/equivalence.py)
#   bash scripts/gpu/your_model_speed.sh lm       # the causal LMs on emulated cards, 8 x 1024 tokens,
#                                                 # bf16-mixed AdamW: the 0.4 B GPT-NeoX shape at 10 GB
#                                                 # (eager sets without the new levers, then with them)
#                                                 # and the 0.36 B Llama shape at 8 GB; REPEAT=N: N rounds
#                                                 # of the fastest eager set without the levers, the fast
#                                                 # set with them, and the Llama set (a claim's spread)
#   bash scripts/gpu/your_model_speed.sh graphs   # the causal LMs' fast set (fused loss, checkpointing, 8 x 1024)
#                                                 # with its steps eager and captured (--cuda-graphs), the
#                                                 # Llama and the Qwen2 0.2 B at 8 GB, the GPT-NeoX at 10 GB;
#                                                 # REPEAT=N rounds; ONLY=llama|neox|qwen one model; EAGER=1 adds the NeoX's
#                                                 # fastest eager set without the levers (lm's baseline)
#
# Carried (ignored path): .whl (liger-kernel, cut-cross-entropy wheels). Runs stop with SIGINT before the
# call's limit (LIMIT, default 560 s), so what finished comes back.
set -u
part=${1:?check, lm or graphs}
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); LIMIT=${LIMIT:-560}; RUNS=/tmp/ym-$part; mkdir -p "$RUNS"
log() { echo "[your_model_speed $part $(( $(date +%s) - T0 )) s] $*" | tee -a "$RUNS/log.txt"; }
# the watchdog (below) ends with the script, and writes to its log only: its sleep, left over, would otherwise
# hold the call's output open until LIMIT
finish() { [ -n "${WATCH:-}" ] && { kill "$WATCH"; wait "$WATCH"; } 2>/dev/null
           record_machine "$RUNS"; tar czf "$OUT/$part.tgz" -C /tmp "ym-$part"; }
trap finish EXIT
install_wheels
install_checkout || log "pip install -e . failed"
( sleep $(( LIMIT - 20 )); log "limit near: SIGINT"; pkill -INT -f "recipes/your_model.py|devtools\." ) > /dev/null 2>&1 &
WATCH=$!

# run NAME ARGS...: one recipes/your_model.py process, its results JSON and log in $RUNS
run() { local name=$1; shift; log "start $name: $*"
        python3 recipes/your_model.py "$@" --results-dir "$RUNS/runs" --tag "$name" > "$RUNS/$name.log" 2>&1
        log "end $name: exit $?"; }
LM=(--seq-len 1024 --batch-size 8 --precision bf16-mixed --data synthetic --max-steps 14 --eval-batches 1)
case $part in
  check)
    [ -n "${SKIP_BENCH:-}" ] || { python3 -m devtools.your_model.fused_loss_bench --out "$RUNS" > "$RUNS/fused_loss_bench.log" 2>&1; log "bench: exit $?"; }
    python3 -m devtools.your_model.equivalence --out "$RUNS" > "$RUNS/equivalence.log" 2>&1; log "equivalence: exit $?"
    ;;
  lm)
    NEOX=(--model hf:examples/configs/gpt-neox-0.4b "${LM[@]}" --memory-budget-gb 10)
    LLAMA=(--model hf:examples/configs/llama-0.36b "${LM[@]}" --memory-budget-gb 8)
    for r in $(seq 1 "${REPEAT:-1}"); do
      run "neox-eager-ckpt-mb2x4-r$r" "${NEOX[@]}" --mode eager --checkpoint-blocks --accumulation-steps 4
      [ "${REPEAT:-1}" = 1 ] && run "neox-eager-ckpt-mb4x2-r$r" "${NEOX[@]}" --mode eager --checkpoint-blocks --accumulation-steps 2
      run "neox-fast-fused-ckpt-mb8-r$r" "${NEOX[@]}" --mode fast --fused-loss --checkpoint-blocks
      run "llama-fast-fused-ckpt-mb8-r$r" "${LLAMA[@]}" --mode fast --fused-loss --checkpoint-blocks
      [ "${REPEAT:-1}" = 1 ] && run "neox-fast-fused-sel-mb4x2-r$r" "${NEOX[@]}" --mode fast --fused-loss \
          --checkpoint-blocks --checkpoint-mode selective --accumulation-steps 2
      [ "${REPEAT:-1}" = 1 ] && run "neox-eager-fused-ckpt-mb8-r$r" "${NEOX[@]}" --mode eager --fused-loss --checkpoint-blocks
    done
    ;;
  graphs)
    NEOX=(--model hf:examples/configs/gpt-neox-0.4b "${LM[@]}" --memory-budget-gb 10)
    LLAMA=(--model hf:examples/configs/llama-0.36b "${LM[@]}" --memory-budget-gb 8)
    QWEN=(--model hf:examples/configs/qwen2-0.2b "${LM[@]}" --memory-budget-gb 8)
    FAST=(--mode fast --fused-loss --checkpoint-blocks)
    for r in $(seq 1 "${REPEAT:-1}"); do
      if [ "${ONLY:-llama}" = llama ]; then
        run "llama-fast-fused-ckpt-mb8-r$r" "${LLAMA[@]}" "${FAST[@]}"
        run "llama-graphs-fused-ckpt-mb8-r$r" "${LLAMA[@]}" "${FAST[@]}" --cuda-graphs
      fi
      if [ "${ONLY:-neox}" = neox ]; then
        [ -n "${EAGER:-}" ] && run "neox-eager-ckpt-mb2x4-r$r" "${NEOX[@]}" --mode eager --checkpoint-blocks --accumulation-steps 4
        run "neox-fast-fused-ckpt-mb8-r$r" "${NEOX[@]}" "${FAST[@]}"
        run "neox-graphs-fused-ckpt-mb8-r$r" "${NEOX[@]}" "${FAST[@]}" --cuda-graphs
      fi
      if [ "${ONLY:-qwen}" = qwen ]; then
        run "qwen-fast-fused-ckpt-mb8-r$r" "${QWEN[@]}" "${FAST[@]}"
        run "qwen-graphs-fused-ckpt-mb8-r$r" "${QWEN[@]}" "${FAST[@]}" --cuda-graphs
      fi
    done
    ;;
esac
