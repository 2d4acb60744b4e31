#!/usr/bin/env bash
# Run the recipe ladder, each recipe in its own process, then render the report.
#
#   ./run_all.sh                         every numbered recipe (GPU: full size, into runs/ladder; no GPU: the
#                                        quick CPU path, into runs/cpu)
#   ./run_all.sh --quick                 GPU: the single-GPU ladder (01-07, 10-16), 20 steps each, synthetic
#                                        data, into runs/quick, 6 recipes at a time (--jobs); no GPU: the CPU path
#   ./run_all.sh --jobs N                up to N recipes at once (default 1; --quick on a GPU: 6): start-up,
#                                        model building and evaluation overlap, the training loops take
#                                        turns on the GPU (one at a time), so peaks and speeds stay each
#                                        rung's own; the output of each recipe is shown when it ends
#   ./run_all.sh --only 01,03            recipes whose name starts with 01 or 03
#   ./run_all.sh -- --max-steps 50       everything after -- is passed to every recipe
#   ./run_all.sh -- --data synthetic     the memory/speed ladder as committed: CIFAR-sized splits offline
#   ./run_all.sh --cpu                   force the quick CPU path (tiny model, real digits, 15 steps), then
#                                        predict every rung at full size (python -m fabric_memory_recipes.planning --ladder)
#   ./run_all.sh --results-dir DIR       where the JSON and the report go (default: a folder under runs/,
#                                        ignored by git; results/published/ only with FMR_PUBLISH=1)
#   ./run_all.sh --bonus                 the bonus cases instead, into runs/bonus (CPU: runs/cpu/bonus;
#                                        committed: results/published/h100/bonus): DistilBERT and BigBird
#                                        on IMDb before/after, and the LLM fine-tuning toggles table
#   PYTHON=/path/to/python ./run_all.sh  the interpreter that runs the recipes and the report (default:
#                                        python3; fmr-ladder passes the one it runs in, as the tests do)
#
# A recipe that fails or runs out of memory does not stop the ladder; the script exits non-zero at the
# end with a one-line-per-recipe summary. A recipe's status is the one its results JSON of this run
# records (ok, oom, interrupted, error); without one, its exit code: 0 ok, 2 bad flags, 3 out of memory,
# 130/143/138/129 stopped by SIGINT/SIGTERM/SIGUSR1/SIGHUP. Ctrl-C (or SIGTERM or SIGHUP to the process
# group: a closed terminal, a dropped ssh session) stops the ladder: the running recipe stops at its next
# optimizer step and records what it measured, then the summary is printed, the report of what exists is
# rendered, and the script exits 130 (143 for SIGTERM, 129 for SIGHUP). After SIGHUP, what would go to
# the closed terminal goes to DIR/run_all.log.
# DIR/run_all.json records this invocation (its start, the recipes it started): the report shows the
# results this invocation wrote in its table and figure, and any others in DIR, left by earlier runs,
# in a section of their own, "Earlier runs". One ladder at a time per DIR: a second one into it refuses at
# its start (exit 2).
set -u
caller=$PWD  # a relative --results-dir is the caller's, as with any command (fmr-ladder runs from anywhere)
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
# Recipes import `fabric_memory_recipes`; make that work from a plain checkout too (pip install -e . is still the way).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
only=""
quick=0
QUICK_STEPS=20  # GPU --quick: 19 step intervals, 3 of them warm-up: 16 timed (the speed's median and range)
CPU_STEPS=15    # CPU path: a digits epoch at batch 64 is 20 steps (rung 15's batch 256: 5)
force_cpu=0
bonus=0
results_dir=""
extra=()
jobs=""
QUICK_JOBS=6  # GPU --quick: recipes at once (their training loops one at a time)

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }  # the comment above
# A signal while a recipe runs reaches the recipe too (one process group); bash acts on the trap once
# the recipe has stopped. Between recipes it stops the ladder before the next one starts.
stopped=0
hangup_log=/dev/null  # where the output goes once the terminal is gone (DIR/run_all.log once DIR exists)
# SIGHUP: a terminal that closed fails every write; the rest of the ladder's output goes to the log.
hang_up() { stopped=129; if [ -t 1 ] || [ -t 2 ]; then exec >>"$hangup_log" 2>&1; fi; }
trap 'stopped=130' INT
trap 'stopped=143' TERM
trap 'hang_up' HUP
# The name of a stop's exit code, for the summary ("stopped (SIGTERM)"); empty for any other code.
stop_signal() { case $1 in 129) echo SIGHUP ;; 130) echo SIGINT ;; 138) echo SIGUSR1 ;; 143) echo SIGTERM ;; esac; }

while [ $# -gt 0 ]; do
  case "$1" in
    --only) only="${2:-}"; shift 2 || { echo "run_all.sh: --only needs a value" >&2; exit 2; } ;;
    --only=*) only="${1#--only=}"; shift ;;
    --cpu) force_cpu=1; shift ;;
    --quick) quick=1; shift ;;
    --jobs) jobs="${2:-}"; shift 2 || { echo "run_all.sh: --jobs needs a value" >&2; exit 2; } ;;
    --jobs=*) jobs="${1#--jobs=}"; shift ;;
    --bonus) bonus=1; shift ;;
    --results-dir) results_dir="${2:-}"; shift 2 || { echo "run_all.sh: --results-dir needs a value" >&2; exit 2; } ;;
    --results-dir=*) results_dir="${1#--results-dir=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run_all.sh: unknown option '$1' (see --help; recipe flags go after --)" >&2; exit 2 ;;
  esac
done
case $results_dir in /*|"") ;; *) results_dir=$caller/$results_dir ;; esac  # a given one is the caller's

case "$jobs" in
  '') ;;
  *[!0-9]*|0) echo "run_all.sh: --jobs $jobs: expected a whole number >= 1" >&2; exit 2 ;;
esac

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
if [ -z "$gpus" ]; then
  echo "run_all.sh: cannot import torch with $PYTHON; install the project first (python3 -m pip install -e .) or set PYTHON to the interpreter that has it" >&2
  exit 2
fi
[ "$force_cpu" = 1 ] && gpus=0

if [ "$gpus" = 0 ]; then
  if [ "$bonus" = 1 ]; then
    echo "No CUDA GPU found: running the quick CPU path of the bonus cases (tiny configs, synthetic data, 5 steps)."
    echo "Its numbers show that every case runs end to end (tests/recipes/test_bonus.py checks that they learn); memory and speed figures need a GPU."
  else
    echo "No CUDA GPU found: running the quick CPU path (vit_tiny, scikit-learn's digits, random init, $CPU_STEPS steps)."
    echo "It shows that every rung runs end to end; its memory columns are predicted for ViT-L/16 at each rung's GPU configuration (fabric_memory_recipes.planning), not measured: on a CPU only the process's RSS can be. $CPU_STEPS steps do not train a model (accuracy: python -m fabric_memory_recipes.tools.convergence.benchmark)."
  fi
  mode=cpu
  # digits: real, bundled with scikit-learn, and quicker to load than the 60,000 synthetic images
  base=(--accelerator cpu --model vit_tiny --data digits --weights none --max-steps "$CPU_STEPS")
  if [ "$bonus" = 1 ]; then
    results_dir=${results_dir:-runs/cpu/bonus}
    base=(--accelerator cpu --data synthetic --weights none --max-steps 5 --eval-batches 2)
  fi
  results_dir=${results_dir:-runs/cpu}
  # No compilation on the CPU path: an eager CPU run compiles nothing, torchao's optimizer steps included
  # (fabric_memory_recipes/training/lifecycle.py: compiling_as_asked); kept for the tools run here too.
  export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
elif [ "$quick" = 1 ] && [ "$bonus" = 0 ]; then
  echo "Found $gpus CUDA GPU(s): running the quick single-GPU ladder (01-07, 10-16) at full size, $QUICK_STEPS steps each, synthetic data, random init."
  mode=quick
  jobs=${jobs:-$QUICK_JOBS}
  results_dir=${results_dir:-runs/quick}
  base=(--data synthetic --weights none --max-steps "$QUICK_STEPS" --eval-batches 1)
else
  if [ "$bonus" = 1 ]; then what="bonus cases"; else what=ladder; fi
  echo "Found $gpus CUDA GPU(s): running the $what at full size."
  mode=gpu
  [ "$bonus" = 1 ] && results_dir=${results_dir:-runs/bonus}
  results_dir=${results_dir:-runs/ladder}
  base=()
fi

jobs=${jobs:-1}

# Rungs that shard across GPUs: run with min(GPUs, 4) processes; skipped with fewer than 2 GPUs, except
# on the CPU path for those that also shard across CPU processes (gloo), which run there with 2.
MULTI_GPU_RECIPES=" 08_fsdp 08_fsdp2 09_cpu_offload "
CPU_SHARDED_RECIPES=" 08_fsdp2 09_cpu_offload "
MULTI_GPU_DEFAULT_DEVICES=4
is_multi_gpu() { case "$MULTI_GPU_RECIPES" in *" $1 "*) return 0 ;; esac; return 1; }
shards_on_cpu() { case "$CPU_SHARDED_RECIPES" in *" $1 "*) return 0 ;; esac; return 1; }

# Recipe-specific changes for the CPU path: fp16 autocast needs CUDA, bf16 autocast is the CPU analogue.
cpu_overrides() {
  case "$1" in
    02_*) echo "--precision bf16-mixed" ;;
    bonus_distilbert_*) echo "--model distilbert-tiny --max-length 128" ;;
    bonus_bigbird_*) echo "--model bigbird-tiny --max-length 128" ;;
    bonus_llm_*) echo "--model qwen2-tiny --max-length 64" ;;
  esac
}

# The LLM fine-tuning table: one run of bonus_llm_finetune per row, tagged with the row name.
LLM_TABLE="vanilla half mixed checkpointing lora sdpa all"
llm_flags() {
  case "$1" in
    half) echo "--half" ;;
    mixed) echo "--mixed" ;;
    checkpointing) echo "--grad-checkpointing" ;;
    lora) echo "--lora" ;;
    sdpa) echo "--half --attn sdpa" ;;  # torch's fused attention (flash or memory-efficient kernel); vs half
    all) echo "--all" ;;
  esac
}

selected() {
  [ -z "$only" ] && return 0
  local p
  IFS=',' read -ra pats <<< "$only"
  for p in "${pats[@]}"; do
    case "$1" in "$p"*) return 0 ;; esac
  done
  return 1
}

recipes=()  # entries: NAME, or NAME:TAG for a row of the LLM table
if [ "$bonus" = 1 ]; then files=(recipes/bonus_*.py); else files=(recipes/[0-9][0-9]_*.py); fi
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  if [ "$name" = bonus_llm_finetune ]; then
    for row in $LLM_TABLE; do selected "$name-$row" && recipes+=("$name:$row"); done
  else
    selected "$name" && recipes+=("$name")
  fi
done
if [ ${#recipes[@]} -eq 0 ]; then
  echo "run_all.sh: no recipe matches --only '$only'" >&2
  exit 2
fi

# Committed evidence is written on purpose only (fabric_memory_recipes/paths.py; each recipe checks again).
case "$results_dir" in /*) ;; *) results_dir=$PWD/$results_dir ;; esac  # a default: runs/ of the checkout, said in full
abs_dir=$results_dir
case "$abs_dir/" in
  */results/published/*)
    if [ "${FMR_PUBLISH:-}" != 1 ]; then
      echo "run_all.sh: --results-dir $results_dir: inside results/published/, the committed evidence; write to runs/ instead, or set FMR_PUBLISH=1 to publish there on purpose" >&2
      exit 2
    fi ;;
esac
# A folder the file system cannot hold, refused before anything is made (as fabric_memory_recipes/paths.py):
# not UTF-8, a folder name over 255 bytes, or over 3840 bytes in all (room for its files under 4096).
path_problem() {
  local LC_ALL=C part parts
  if command -v iconv > /dev/null && ! printf '%s' "$1" | iconv -f UTF-8 -t UTF-8 > /dev/null 2>&1; then
    echo "is not UTF-8 text (undecodable bytes in a folder name): choose a name in UTF-8"; return
  fi
  IFS=/ read -ra parts <<< "$1"
  for part in "${parts[@]}"; do
    if [ ${#part} -gt 255 ]; then
      echo "a folder name is ${#part} bytes long (${part:0:24}…): at most 255 bytes each"; return
    fi
  done
  [ ${#1} -le 3840 ] || echo "${#1} bytes long: an output folder is at most 3840, to leave room for its files under the 4096 bytes of a path"
}
problem=$(path_problem "$results_dir")
if [ -n "$problem" ]; then
  shown=$results_dir
  [ ${#shown} -le 120 ] || shown="${shown:0:60}…${shown: -60} (${#results_dir} characters)"
  echo "run_all.sh: --results-dir $shown: $problem" >&2
  exit 2
fi
if [ -e "$results_dir" ] && [ ! -d "$results_dir" ]; then
  echo "run_all.sh: --results-dir $results_dir: is a file, not a folder" >&2
  exit 2
fi
mkdir -p "$results_dir" || { echo "run_all.sh: --results-dir $results_dir: cannot be created" >&2; exit 2; }
hangup_log=$results_dir/run_all.log
# One ladder per folder: a second ./run_all.sh into it would mix its runs and run_all.json with this one's
# (each recipe's own lock would turn the rungs they share into "bad flags"). An flock on DIR/.run_all.lock,
# held by this shell and its recipes; the kernel releases it however the ladder ends.
lock=$results_dir/.run_all.lock
if command -v flock > /dev/null; then
  exec 9>> "$lock" || { echo "run_all.sh: --results-dir $results_dir: cannot create $lock" >&2; exit 2; }
  if ! flock -n 9; then
    echo "run_all.sh: another ./run_all.sh (pid $(head -c 20 "$lock" | tr -dc 0-9)) is writing to $results_dir: wait for it to end, or give this one another --results-dir" >&2
    exit 2
  fi
  echo $$ > "$lock"
fi
ladder_start=$(date +%s)

# DIR/run_all.json: this invocation's start and the recipes it started (the report tells this run's
# results from earlier ones by it). Rewritten as each recipe starts, so its modification time is that
# recipe's start: a results JSON newer than it was written by that recipe.
manifest="$results_dir/run_all.json"
started=()
write_manifest() {
  local list="" r tmp="$manifest.tmp.$$"
  for r in ${started[@]+"${started[@]}"}; do list+="${list:+, }\"$r\""; done
  printf '{\n  "what": "./run_all.sh: the recipes this invocation started into this folder",\n  "started": %s,\n  "mode": "%s",\n  "state": "%s",\n  "recipes": [%s]\n}\n' \
    "$ladder_start" "$mode" "$1" "$list" > "$tmp" && mv -f "$tmp" "$manifest"
}
# The status recorded by the results JSON that recipe $1 wrote during this run (<run>.json, or beside it
# <run>.<status>.json, newer than the marker touched when the recipe started); empty when it wrote none
# (then its exit code tells).
markers=$(mktemp -d "${TMPDIR:-/tmp}/run_all.XXXXXX")
trap 'rm -rf "$markers"; rm -f "$lock"' EXIT  # the lock file goes while still held
recorded_status() {
  local f
  for f in "$results_dir/$1.json" "$results_dir/$1".*.json; do
    if [ -f "$f" ] && [ "$f" -nt "$markers/$1.start" ]; then
      sed -n 's/^  "status": "\([a-z_]*\)".*/\1/p' "$f" | head -n 1
      return
    fi
  done
}
# The recipe's arguments, into label/args; returns 1 (after a summary line) for a rung skipped here.
prepare() {
  local entry=$1 row
  name=${entry%%:*}
  label=$name
  args=("${base[@]}")
  if [ "$entry" != "$name" ]; then
    row=${entry#*:}
    label="$name-$row"
    read -ra ov <<< "$(llm_flags "$row")"
    args+=("${ov[@]}" --tag "$row")
  fi
  if is_multi_gpu "$name"; then
    if [ "$mode" = quick ]; then
      echo
      echo ">>> $name skipped: --quick runs the single-GPU ladder"
      summary+=("$(printf '%-34s %-30s' "$name" "skipped (--quick: one GPU)")")
      return 1
    elif [ "$mode" = cpu ] && shards_on_cpu "$name"; then
      args+=(--devices 2)
    elif [ "$gpus" -lt 2 ]; then
      echo
      echo ">>> $name skipped: it shards across GPUs and this machine has $gpus (needs at least 2)"
      summary+=("$(printf '%-34s %-30s' "$name" "skipped (needs >= 2 GPUs)")")
      return 1
    else
      args+=(--devices "$(( gpus < MULTI_GPU_DEFAULT_DEVICES ? gpus : MULTI_GPU_DEFAULT_DEVICES ))")
    fi
  fi
  if [ "$mode" = cpu ]; then
    read -ra ov <<< "$(cpu_overrides "$name")"
    args+=("${ov[@]}")
  fi
  return 0
}
# The status of a step after the recipes (the prediction, the report) that ended with exit code $1:
# ok, stopped by a signal (which stops the ladder), or failed (which makes the exit code non-zero); into
# $status (not printed: a $(...) would lose what it sets).
step_status() {
  local rc=$1 name
  name=$(stop_signal "$rc")
  if [ "$rc" = 0 ]; then status=ok
  elif [ -n "$name" ]; then [ "$stopped" = 0 ] && stopped=$rc; status="stopped ($name)"
  else failed=1; status="failed (exit $rc)"
  fi
}
# A recipe has ended with exit code $2 after $3 seconds: its status line in the summary.
finished() {
  local label=$1 rc=$2 secs=$3 recorded status
  echo "$label $secs" >> "$markers/walls"
  case $rc in 129|130|138|143) [ "$stopped" = 0 ] && stopped=$rc ;; esac
  recorded=$(recorded_status "$label")
  case "$recorded:$rc" in
    ok:0) status=ok ;;
    ok:129|ok:130|ok:138|ok:143) status="ok (stopped after: exit $rc)" ;;  # the signal came after its results
    ok:*) status="ok (recorded; then exit $rc)"; failed=1 ;;
    oom:*) status="out of memory (recorded)"; failed=1 ;;
    interrupted:*) status="interrupted (exit $rc)"; failed=1 ;;
    error:*) status="failed (recorded; exit $rc)"; failed=1 ;;
    *:0) status=ok ;;
    *:2) status="bad flags (exit 2)"; failed=1 ;;
    *:3) status="out of memory (recorded)"; failed=1 ;;
    *:129|*:130|*:138|*:143) status="interrupted (exit $rc)"; failed=1 ;;
    *) status="failed (exit $rc)"; failed=1 ;;
  esac
  summary+=("$(printf '%-34s %-30s %5ss' "$label" "$status" "$secs")")
}
write_manifest running
summary=()
failed=0
not_run=()
pids=()  # the recipes running in the background (--jobs), with their run names and start times
plabels=()
pstarts=()
if [ "$jobs" -gt 1 ]; then
  # Several recipes at once (--jobs): each writes to its own log, shown when it ends; the training loops
  # take turns on the GPU through this lock (fabric_memory_recipes/measurement/gpu_lock.py).
  export FMR_GPU_LOCK="$markers/gpu.lock"
  echo "Running up to $jobs recipes at once; their training loops take turns on the GPU."
  trap 'stopped=130; [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null' INT
  trap 'stopped=143; [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null' TERM
  trap 'hang_up; [ ${#pids[@]} -gt 0 ] && kill -HUP "${pids[@]}" 2>/dev/null' HUP
fi
# Wait until one of them has ended, report it, and forget it.
reap() {
  local i j rc
  while :; do
    for i in "${!pids[@]}"; do
      kill -0 "${pids[$i]}" 2>/dev/null && continue
      wait "${pids[$i]}"; rc=$?  # bash keeps an ended child's status until it is waited for
      echo
      echo ">>> ${plabels[$i]} ended (exit $rc); its output:"
      cat "$markers/${plabels[$i]}.log"
      finished "${plabels[$i]}" "$rc" "$(( $(date +%s) - ${pstarts[$i]} ))"
      local keep_p=() keep_l=() keep_s=()
      for j in "${!pids[@]}"; do
        [ "$j" = "$i" ] && continue
        keep_p+=("${pids[$j]}"); keep_l+=("${plabels[$j]}"); keep_s+=("${pstarts[$j]}")
      done
      pids=(${keep_p[@]+"${keep_p[@]}"}); plabels=(${keep_l[@]+"${keep_l[@]}"}); pstarts=(${keep_s[@]+"${keep_s[@]}"})
      return
    done
    sleep 0.5
  done
}
for entry in "${recipes[@]}"; do
  if [ "$stopped" != 0 ]; then not_run+=("${entry/:/-}"); continue; fi
  prepare "$entry" || continue
  echo
  echo ">>> $label ${args[*]} ${extra[*]:-} --results-dir $results_dir"
  started+=("$label")
  write_manifest running
  touch "$markers/$label.start"
  start=$(date +%s)
  if [ "$jobs" -gt 1 ]; then
    "$PYTHON" "recipes/$name.py" "${args[@]}" "${extra[@]}" --results-dir "$results_dir" > "$markers/$label.log" 2>&1 &
    pids+=($!); plabels+=("$label"); pstarts+=("$start")
    while [ ${#pids[@]} -ge "$jobs" ]; do reap; done
  else
    "$PYTHON" "recipes/$name.py" "${args[@]}" "${extra[@]}" --results-dir "$results_dir"
    finished "$label" $? "$(( $(date +%s) - start ))"
  fi
done
while [ ${#pids[@]} -gt 0 ]; do reap; done

if [ "$mode" = cpu ] && [ "$bonus" = 0 ] && [ "$stopped" = 0 ]; then
  # On a CPU the measured memory is the process's RSS; the report shows each rung's full-size prediction.
  echo
  echo ">>> predicting each rung at full size: $PYTHON -m fabric_memory_recipes.planning --ladder $results_dir"
  start=$(date +%s)
  "$PYTHON" -m fabric_memory_recipes.planning --ladder "$results_dir"
  step_status $?
  summary+=("$(printf '%-34s %-30s %5ss' "predicted ladder (ViT-L/16)" "$status" "$(( $(date +%s) - start ))")")
fi

if [ "$stopped" != 0 ]; then write_manifest stopped; else write_manifest finished; fi
echo
echo "Rendering the report from $results_dir ..."
"$PYTHON" -m fabric_memory_recipes.measurement.report.render "$results_dir"
step_status $?
[ "$status" = ok ] || summary+=("$(printf '%-34s %s' report "$status")")

if [ "$mode" != cpu ] && [ "$bonus" = 0 ] && [ -s "$markers/walls" ]; then
  echo
  "$PYTHON" -m fabric_memory_recipes.measurement.time_breakdown "$results_dir" "$markers/walls" || true
fi
# A signal during the prediction or the report: the ladder was stopped, whatever the manifest said then.
[ "$stopped" != 0 ] && write_manifest stopped
echo
echo "Summary ($mode path, results in $results_dir$([ "$jobs" -gt 1 ] && echo ", $jobs recipes at a time")):"
printf '  %s\n' "${summary[@]}"
echo "  total: $(( $(date +%s) - ladder_start )) s"
if [ "$stopped" != 0 ]; then
  [ ${#not_run[@]} -gt 0 ] && echo "  stopped before: ${not_run[*]}"
  exit "$stopped"
fi
exit $failed
