#!/usr/bin/env bash
# The sharded rungs' speed over repeated runs against the article's script in the same call, and what else one
# call on a machine with 4 GPUs can hold (nvidia-h100-x4; an H200 machine if that comes: the summary names the
# GPUs). From the repository root (this checkout's package on PYTHONPATH), the article's checkout at $REF:
#
#   OUT=/some/folder bash scripts/gpu/sharded_spread.sh                      # PARTS="rounds" by default
#   OUT=... PARTS="rounds models nodes" ROUNDS=2 bash scripts/gpu/sharded_spread.sh
#   OUT=... PARTS="x2 models nodes profile" bash scripts/gpu/sharded_spread.sh   # a call for the rest
#
# Parts, in this order (each starts fresh and can be called alone; a part or run not started before DEADLINE
# is said so in progress.log). Expected seconds are from the 4 x H200 call of results/published/h200x4/
# sharded-spread/call1 (a run there: ~25-35 s of start-up, imports and NCCL set-up, besides its steps):
#   rounds   ROUNDS (3) rounds of RUNGS at 4 GPUs, STEPS (12) optimizer steps a run (STEPS_09, 20, for rung 09,
#            whose p90/p10 needs more than 8 intervals: the loss logged every 10 steps makes one slow interval),
#            each round in another (rotated) order; the article's 11_delay-allocation.py at REF_STEPS (10) steps,
#            without its cpu_offload (rung 08's reference) after round 1, as written (rung 09's) after round 2.
#            ~149 s a round of the three rungs (08_fsdp ~43, 08_fsdp2 ~52, 09 ~54), ~40 + ~46 s the references:
#            ~535 s for 3 rounds.
#            A rung may carry a variant: 08_fsdp+compile (--compile: compiled blocks under FSDP1, ~50 s),
#            08_fsdp2+sampler50 (the whole-device sampler polling every 50 ms instead of 5 ms).
#   x2       the same on GPUs 0,1 with --devices 2: ROUNDS_X2 (1) rounds, both references (~230 s)
#   models   your model sharded, memory only (runs share GPUs, each measured alone), all at once (~90 s):
#            GPT-NeoX 1.4 B with --cpu-offload (FSDP, eager) on GPUs 0,1, GPT-NeoX 1.4 B in fast mode (FSDP2,
#            compiled blocks, batch 4) on GPUs 2,3, TinyLlama 1.1 B in fast mode (batch 4) on GPUs 0,1
#   nodes    08_fsdp2 eager, NODES_STEPS (8) steps, the loss of every step: one torchrun node of 4 and two torchrun
#            "nodes" of 2 on this host, at once, then their losses compared (nodes/equivalence.json; ~60 s)
#   profile  not by default: torch.profiler on rank 0 over 3 steps after 6 (scripts/gpu/profile_sharded_step.py)
#            for each of PROFILE_RUNS (recipe:GPUs, default "08_fsdp2:4 08_fsdp2:1"), then one table of compute,
#            all-gather / reduce-scatter (exposed), copies, GPU idle and phases (profile_summary.md; ~55 s a run)
#   fit      not by default (~300 s): fmr-estimate --fit 16GB --devices 2 --measure for GPT-NeoX 1.4 B
# Everything is written into $OUT/spread.tgz as each run ends (and every 20 s); $OUT also gets progress.log,
# summary.md (scripts/gpu/sharded_spread_summary.py) and profile_summary.md. GPU clocks, power, temperature and
# throttle reasons are logged every second (telemetry.csv). NVLink multicast stays off (KINDS.md).
# DRY_RUN=1 prints the commands instead of running them (no GPU needed).
set -u
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env  # no NVLink multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's package, installed or not
ls .whl/*.whl > /dev/null 2>&1 && install_wheels  # liger-kernel for a --fused-loss set (part fit), if carried
OUT=${OUT:?set OUT to the folder whose files come back}
REF=${REF:-.ref/pytorch-memory-optim}
[ -d "$REF" ] || { [ -d shared/reference/pytorch-memory-optim ] && REF=shared/reference/pytorch-memory-optim; }
PARTS=${PARTS-rounds}
RUNGS=${RUNGS:-08_fsdp 08_fsdp2 09_cpu_offload}
ROUNDS=${ROUNDS:-3}
ROUND_FIRST=${ROUND_FIRST:-1}   # a later call continuing the rounds numbers its runs on from here
ROUNDS_X2=${ROUNDS_X2:-1}
STEPS=${STEPS:-12}              # 3 warm-up steps, then 8 timed intervals
STEPS_09=${STEPS_09:-20}        # rung 09: 16 timed intervals, so that its p90 is not the logging step's
REF_STEPS=${REF_STEPS:-10}      # the article's script: 6 timed intervals (its steps vary by < 0.1 % in call1)
YM_STEPS=${YM_STEPS:-5}
NODES_STEPS=${NODES_STEPS:-8}
PROFILE_RUNS=${PROFILE_RUNS:-08_fsdp2:4 08_fsdp2:1}
DEADLINE=${DEADLINE:-560}       # seconds: no run starts after it; a run is given at most the time left
DRY_RUN=${DRY_RUN:-}
PY=${PYTHON:-python3}
start_clock spread  # SCRATCH, WORK=$SCRATCH/spread, T0; elapsed, left, say
pack() {  # each caller its own temporary tar (the 20 s packer and a part may pack at once)
  local t=$SCRATCH/pack.$BASHPID.tgz
  tar -czf "$t" -C "$SCRATCH" spread 2>/dev/null && mv -f "$t" "$OUT/.spread.$BASHPID.tgz" && mv -f "$OUT/.spread.$BASHPID.tgz" "$OUT/spread.tgz"
}
wants() { case " $PARTS " in *" $1 "*) [ "$(left)" -gt "${2:-40}" ] || { say "$1: not started (deadline)"; return 1; } ;; *) return 1 ;; esac; }
summary() { $PY scripts/gpu/sharded_spread_summary.py "$WORK" > "$WORK/summary.log" 2>&1; cp -f "$WORK/summary.md" "$OUT/" 2>/dev/null; }
limit() { local l; l=$(left); echo $(( l < $1 ? (l > 20 ? l : 20) : $1 )); }   # a run's timeout: at most $1 s
run() {  # run LOG CMD...: one command (its output to LOG), or its line in progress.log with DRY_RUN
  local log=$1
  shift
  if [ -n "$DRY_RUN" ]; then say "  dry run: $*"; return 0; fi
  "$@" > "$log" 2>&1
}

( while sleep 20; do pack; done ) & PACKER=$!
TELEMETRY=
if [ -z "$DRY_RUN" ]; then  # clocks, power, temperature, throttle reasons of every GPU, every second
  q=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,memory.used
  nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv -c 1 > /dev/null 2>&1 && q=$q,clocks_event_reasons.active
  nvidia-smi --query-gpu=$q --format=csv -lms 1000 > "$WORK/telemetry.csv" 2>&1 & TELEMETRY=$!
fi
trap 'kill $PACKER $TELEMETRY 2>/dev/null; summary; pack' EXIT

say "start: parts '$PARTS', rungs '$RUNGS', $ROUNDS rounds from $ROUND_FIRST, $STEPS steps (09: $STEPS_09, article's $REF_STEPS), deadline $DEADLINE s, reference $REF"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$WORK/gpus.csv" 2>&1
nvidia-smi topo -m > "$WORK/topo.txt" 2>&1
{ nproc; lscpu | grep -Ei 'numa|model name|socket'; } > "$WORK/host.txt" 2>&1
{ $PY -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))"; git rev-parse HEAD; } > "$WORK/env.txt" 2>&1 &
say "GPUs: $(tail -n +2 "$WORK/gpus.csv" | cut -d, -f2 | sort | uniq -c | tr -s ' ' | tr '\n' ';') host: $(head -1 "$WORK/host.txt") cores"

rung() {  # rung NAME ROUND DEVICES GPUS RESERVE: one run of a rung (NAME: recipe[+variant]), fast mode
  local name=$1 round=$2 n=$3 gpus=$4 reserve=$5 recipe=${1%%+*} variant= tag extra_env=() flags=() steps=$STEPS
  [ "$recipe" = 09_cpu_offload ] && steps=$STEPS_09
  [ "$recipe" != "$name" ] && variant=${name#*+}
  tag=r$round${variant:+-$variant}
  case $variant in
    "") ;;
    compile) flags=(--compile) ;;
    sampler50) extra_env=(FMR_DEVICE_INTERVAL_S=0.05) ;;
    eager) flags=(--mode eager) ;;
    *) say "  $name: unknown variant '$variant' (compile, sampler50, eager)"; return ;;
  esac
  [ ! -f "recipes/$recipe.py" ] && { say "  $name: no recipes/$recipe.py"; return; }
  [ "$(left)" -gt $(( 45 + reserve )) ] || { say "  $recipe $tag x$n: not started (deadline)"; return; }
  mkdir -p "$WORK/x$n/logs"
  run "$WORK/x$n/logs/$recipe-$tag.log" env CUDA_VISIBLE_DEVICES="$gpus" ${extra_env[@]+"${extra_env[@]}"} timeout -k 20 "$(limit 150)" \
    $PY "recipes/$recipe.py" --data synthetic --weights none --max-steps "$steps" --eval-batches 1 --devices "$n" \
    --mode fast --tag "$tag" --results-dir "$WORK/x$n/r$round" ${flags[@]+"${flags[@]}"}
  say "  $recipe $tag x$n: exit $? $(grep -m1 -E '^   speed' "$WORK/x$n/logs/$recipe-$tag.log" 2>/dev/null | tr -s ' ')"
  pack
}
reference() {  # reference no-offload|as-written DEVICES GPUS: the article's script as fmr-compare runs it
  local kind=$1 n=$2 gpus=$3 key=reference-11_delay-allocation offload=()
  [ "$kind" = no-offload ] && { key=$key-no-offload; offload=(--fsdp-cpu-offload off); }
  [ "$(left)" -gt 40 ] || { say "  $key x$n: not started (deadline)"; return; }
  mkdir -p "$WORK/x$n/ref"
  run "$WORK/x$n/ref/$key.log" env CUDA_VISIBLE_DEVICES="$gpus" timeout -k 20 "$(limit 150)" $PY -m torch.distributed.run \
    --standalone --nproc-per-node "$n" -m fabric_memory_recipes.tools.compare.runner "$REF/11_delay-allocation.py" \
    --devices "$n" ${offload[@]+"${offload[@]}"} --steps "$REF_STEPS" --out "$WORK/x$n/ref/$key.json"
  say "  $key x$n: exit $? $($PY -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["status"], round(d["images_per_s"] or 0, 1), "img/s", round(d["peak_reserved_gb"] or 0, 2), "GB reserved")' "$WORK/x$n/ref/$key.json" 2>/dev/null)"
  pack
}
rounds() {  # rounds DEVICES GPUS COUNT: COUNT rounds of RUNGS, each rotated by one; the references between them
  local n=$1 gpus=$2 count=$3 r i k order pending=() rungs
  read -r -a rungs <<< "$RUNGS"
  case " $RUNGS " in *" 08_fsdp"*) pending+=(no-offload) ;; esac
  case " $RUNGS " in *" 09_cpu_offload"*) pending+=(as-written) ;; esac
  for (( i = 0; i < count; i++ )); do
    r=$(( ROUND_FIRST + i ))
    order=()
    for (( k = 0; k < ${#rungs[@]}; k++ )); do order+=("${rungs[(k + i) % ${#rungs[@]}]}"); done
    say "x$n round $r: ${order[*]}"
    for name in "${order[@]}"; do rung "$name" "$r" "$n" "$gpus" $(( 50 * ${#pending[@]} )); done
    if [ ${#pending[@]} -gt 0 ]; then  # one reference after each round (both after the last)
      if [ $(( i + 1 )) -lt "$count" ]; then reference "${pending[0]}" "$n" "$gpus"; pending=("${pending[@]:1}")
      else for kind in "${pending[@]}"; do reference "$kind" "$n" "$gpus"; done; pending=(); fi
    fi
    summary
  done
}
wants rounds 100 && rounds 4 0,1,2,3 "$ROUNDS"
wants x2 100 && rounds 2 0,1 "$ROUNDS_X2"

your_model() {  # your_model NAME CONFIG GPUS PORT [flags]: one sharded run of a causal LM, in the background
  local name=$1 config=$2 gpus=$3 port=$4 n
  shift 4
  n=$(( $(tr -cd , <<< "$gpus" | wc -c) + 1 ))
  mkdir -p "$WORK/your-model"
  run "$WORK/your-model-$name.log" env CUDA_VISIBLE_DEVICES="$gpus" MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    timeout -k 20 "$(limit 240)" $PY recipes/your_model.py --model "hf:examples/configs/$config" --fsdp --devices "$n" \
    --precision bf16-mixed --batch-size 8 --seq-len 1024 --checkpoint-blocks --data synthetic --mode eager \
    --max-steps "$YM_STEPS" --eval-batches 1 --results-dir "$WORK/your-model/$name" "$@" &
}
if wants models 60; then
  say "models: GPT-NeoX 1.4 B --cpu-offload (GPUs 0,1), GPT-NeoX 1.4 B fast (2,3), TinyLlama 1.1 B fast (0,1), at once"
  pids=()
  your_model neox-1.4b-x2-cpu-offload gpt-neox-1.4b 0,1 29611 --cpu-offload; pids+=($!)
  your_model neox-1.4b-x2-fast-b4 gpt-neox-1.4b 2,3 29612 --mode fast --batch-size 4; pids+=($!)
  your_model tinyllama-1.1b-x2-fast-b4 tinyllama-1.1b 0,1 29613 --mode fast --batch-size 4; pids+=($!)
  wait "${pids[@]}"
  for log in "$WORK"/your-model-*.log; do
    [ -f "$log" ] && say "  $(basename "$log" .log): $(grep -m1 -E '^== ' "$log" || tail -n 1 "$log" | cut -c1-160)"
  done
  summary; pack
fi

if wants nodes 60; then  # docs/08_fsdp.md's two-machine command, both "machines" on this host, beside one node
  args=(recipes/08_fsdp2.py --data synthetic --weights none --max-steps "$NODES_STEPS" --eval-batches 1 --mode eager --log-every 1)
  say "nodes: one torchrun node of 4 and two torchrun nodes of 2, at once"
  run "$WORK/nodes-one.log" timeout -k 20 "$(limit 150)" $PY -m torch.distributed.run --standalone --nproc-per-node 4 \
    "${args[@]}" --devices 4 --results-dir "$WORK/nodes/one-node" & pids=($!)
  for rank in 0 1; do
    run "$WORK/nodes-two-rank$rank.log" env CUDA_VISIBLE_DEVICES=$(( 2 * rank )),$(( 2 * rank + 1 )) timeout -k 20 "$(limit 150)" \
      $PY -m torch.distributed.run --nnodes 2 --node-rank $rank --nproc-per-node 2 --master-addr 127.0.0.1 \
      --master-port 29538 "${args[@]}" --devices 2 --num-nodes 2 --results-dir "$WORK/nodes/two-nodes" & pids+=($!)
  done
  wait "${pids[@]}"
  mkdir -p "$WORK/nodes"
  $PY scripts/gpu/publish_sharded_runs.py --equivalence "$WORK/nodes" 2>&1 | tee -a "$WORK/progress.log"
  pack
fi

if wants profile 70; then
  for spec in $PROFILE_RUNS; do
    recipe=${spec%%:*} n=${spec#*:}
    gpus=$(seq -s, 0 $(( n - 1 )))
    [ "$(left)" -gt 60 ] || { say "profile $recipe x$n: not started (deadline)"; continue; }
    say "profile: $recipe on $n GPUs (rank 0, 3 steps after 6)"
    run "$WORK/profile-$recipe-x$n.log" env CUDA_VISIBLE_DEVICES="$gpus" timeout -k 20 "$(limit 180)" $PY \
      scripts/gpu/profile_sharded_step.py --out "$WORK/profile/$recipe-x$n" --wait 5 --active 3 -- "recipes/$recipe.py" \
      --data synthetic --weights none --max-steps 10 --eval-batches 1 --devices "$n" --mode fast --no-cuda-graphs \
      --results-dir "$WORK/profile/$recipe-x$n"
    say "  exit $? $(grep -m1 '^\[profile\]' "$WORK/profile-$recipe-x$n.log" 2>/dev/null)"
  done
  dirs=("$WORK"/profile/*/)
  [ -f "${dirs[0]}profile.json" ] && $PY scripts/gpu/profile_sharded_step.py --table "${dirs[@]}" 2>&1 | tee -a "$WORK/progress.log"
  cp -f "$WORK/profile/profile_summary.md" "$OUT/" 2>/dev/null
  pack
fi

if wants fit 90; then  # --memory-budget-gb per process: the sharded sets measured on emulated 16 GB cards
  say "fit: fmr-estimate --fit 16GB --devices 2 --measure on GPUs 0,1"
  run "$WORK/fit.log" env CUDA_VISIBLE_DEVICES=0,1 timeout -k 20 "$(left)" $PY -m fabric_memory_recipes.planning \
    --model hf:examples/configs/gpt-neox-1.4b --seq-len 1024 --batch-size 8 --precision bf16-mixed --fit 16GB \
    --devices 2 --top 3 --measure --measure-steps 5 --measure-dir "$WORK/fit"
  say "fit: exit $? ($(grep -m1 -E '^Fastest measured|^None of' "$WORK/fit.log"))"; pack
fi
summary
cat "$WORK/summary.md" 2>/dev/null || tail -n 5 "$WORK/summary.log"
say "end"
