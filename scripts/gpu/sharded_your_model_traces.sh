#!/usr/bin/env bash
# Where your model's sharded runs' peak reserved goes: the caching allocator's own record (--snapshot, rank 0,
# every step) of the runs of scripts/gpu/sharded_spread.sh's `models` part, on 2 GPUs, with its flags
# (bf16-mixed, 8 x 1024 tokens, --checkpoint-blocks, 5 steps), one run at a time:
#   offload-snap   GPT-NeoX 1.4 B, FSDP (eager) with --cpu-offload, recorded      (its reserved: -35 % predicted)
#   offload-alone  the same, not recorded, alone on the GPUs (the committed run shared them with another)
#   eager-snap     GPT-NeoX 1.4 B, FSDP (eager), recorded                          (FSDP1 without offload)
#   fast-snap      TinyLlama 1.1 B, fast mode (FSDP2, compiled blocks), batch 4, recorded
#   x4-snap        GPT-NeoX 1.4 B, FSDP (eager) over 4 GPUs, recorded: only where 4 GPUs are present
# Each snapshot is stripped of its stack frames, keeping where each request came from (FSDP, the optimizer,
# the model: devtools/your_model/reserved_trace.py), and read there: each stream's reserved and allocated
# bytes at the peak, the recorded requests replayed in the estimate's allocator model; each run is predicted
# again (devtools/your_model/repredict.py). Recording changes a run's reserved memory (results/published/h100/
# reserved-snapshots/NOTES.md): offload-alone is the unrecorded peak. About 6 minutes on 2 x H100/H200
# (runs of ~50-90 s; no run starts after DEADLINE, default 420 s). From the repository root:
#
#   OUT=/some/folder bash scripts/gpu/sharded_your_model_traces.sh      # ONLY=name,name: some of the runs
#
# $OUT gets progress.log and traces.tgz (every run's folder, log, stripped snapshot and readings), written as
# each run ends. DRY_RUN=1 prints the commands instead (no GPU needed). NVLink multicast stays off (KINDS.md).
set -u
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env  # no NVLink multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's package, installed or not
OUT=${OUT:?set OUT to the folder whose files come back}
DEADLINE=${DEADLINE:-420}
DRY_RUN=${DRY_RUN:-}
PY=${PYTHON:-python3}
start_clock traces  # SCRATCH, WORK=$SCRATCH/traces, T0; elapsed, left, say
pack() { tar -czf "$SCRATCH/t.tgz" -C "$SCRATCH" traces 2>/dev/null && mv -f "$SCRATCH/t.tgz" "$OUT/traces.tgz"; }
trap pack EXIT
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; git rev-parse HEAD; } > "$WORK/machine.txt" 2>&1
say "start: $GPUS GPUs, deadline $DEADLINE s, runs '${ONLY:-all}'"

LM=(--fsdp --precision bf16-mixed --batch-size 8 --seq-len 1024 --checkpoint-blocks --data synthetic
    --mode eager --max-steps 5 --eval-batches 1)
PORT=29640
run() {  # run NAME GPUS CONFIG [flags]: one run of recipes/your_model.py, then its snapshot read and stripped
  local name=$1 gpus=$2 config=$3 n
  shift 3
  case ",${ONLY:-$name}," in *",$name,"*) ;; *) return ;; esac
  n=$(( $(tr -cd , <<< "$gpus" | wc -c) + 1 ))
  if [ "$n" -gt "$GPUS" ] && [ -z "$DRY_RUN" ]; then say "$name: not run ($n GPUs asked, $GPUS here)"; return; fi
  [ "$(left)" -gt 60 ] || { say "$name: not started (deadline)"; return; }
  PORT=$(( PORT + 1 ))
  local cmd=(env CUDA_VISIBLE_DEVICES="$gpus" MASTER_ADDR=127.0.0.1 MASTER_PORT="$PORT" timeout "$(left)"
             "$PY" recipes/your_model.py --model "hf:examples/configs/$config" --devices "$n" "${LM[@]}"
             --results-dir "$WORK/$name" "$@")
  if [ -n "$DRY_RUN" ]; then say "dry run: ${cmd[*]}"; return; fi
  say "$name: start"
  "${cmd[@]}" > "$WORK/$name.log" 2>&1
  say "$name: exit $? | $(grep -m1 -E 'peak memory \(train\)' "$WORK/$name.log" | tr -s ' ')"
  for p in "$WORK/$name"/*snapshot.pickle; do
    [ -f "$p" ] || continue
    "$PY" -m devtools.your_model.reserved_trace --strip "$p" > /dev/null && rm -f "$p"
    "$PY" -m devtools.your_model.reserved_trace "$p.gz" --steps 5 > "$WORK/$name.trace.txt" 2>&1
    say "$name: $(grep -m1 'GPU reserved' "$WORK/$name.trace.txt")"
    grep 'at the peak, stream' "$WORK/$name.trace.txt" | while read -r line; do say "  $line"; done
  done
  "$PY" -m devtools.your_model.repredict "$WORK/$name" > "$WORK/$name.repredict.txt" 2>&1
  say "$name: $(grep -m1 'allocated' "$WORK/$name.repredict.txt" | sed 's|.*json: ||')"
  pack
}
run offload-snap 0,1 gpt-neox-1.4b --cpu-offload --snapshot --profile-steps 5
run offload-alone 0,1 gpt-neox-1.4b --cpu-offload
run eager-snap 0,1 gpt-neox-1.4b --snapshot --profile-steps 5
run fast-snap 0,1 tinyllama-1.1b --mode fast --batch-size 4 --snapshot --profile-steps 5
run x4-snap 0,1,2,3 gpt-neox-1.4b --snapshot --profile-steps 5
say "end"
