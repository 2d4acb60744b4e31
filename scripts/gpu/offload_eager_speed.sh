#!/usr/bin/env bash
# Rung 11's eager speed: the batched side-stream copies against the code before them, on one GPU, one
# device command of about 5 minutes (LIMIT, default 540 s), from the repository root:
#
#   git archive BASE_COMMIT fabric_memory_recipes recipes pyproject.toml | (mkdir -p build/offload-base && tar -x -C build/offload-base)
#   OUT=... bash scripts/gpu/offload_eager_speed.sh          # carry build/offload-base and .whl
# (BASE_COMMIT: the code before the batched copies, 4d24fe7 where they were written)
#
# 1. devtools/speed/offload_hooks.py (about 1.5 min): forward+backward of rung 11's micro-batches under each
#    offload mode in one process (none, compute-stream order, side streams one tensor at a time, side
#    streams batched): ms per micro-batch, the host's share, the hooks' own host time, peak reserved, and
#    a torch.profiler table of one step per side-stream mode (the hooks as offload.pack/offload.unpack,
#    the CUDA runtime calls by self CPU time).
# 2. recipes/11_activation_offload.py, 20 steps (16 timed), synthetic data, RUNS (default 3) runs of each:
#    eager-before (the base tree: one tensor at a time), eager-after (batched), eager-compute
#    (--offload-window-mb 0: the compute stream's order), fast-before, fast-after (fast mode passes
#    batched=False: the same copies as before). Up to JOBS (3) processes at once; their training loops
#    take turns on the GPU through the recipes' own lock (FMR_GPU_LOCK, as ./run_all.sh --quick), the
#    rounds interleaved. Without build/offload-base the "before" runs are skipped.
# Results under $OUT: summary.md (img/s median [min-max], median step, peak reserved, whole device),
# summary.json, offload_hooks.json, profile-*.txt, log.txt, runs.tgz (every results JSON and log).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); LIMIT=${LIMIT:-540}; RUNS=${RUNS:-3}; JOBS=${JOBS:-3}; BASE=${BASE:-build/offload-base}
W=/tmp/offload-eager; rm -rf "$W"; mkdir -p "$W/runs"
HERE=$(pwd)
log() { echo "[offload_eager_speed $(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
finish() {
  for p in $(jobs -rp); do kill -INT "$p" 2>/dev/null; done  # this shell's runs still going, if any
  wait
  python3 - "$W/runs" "$OUT" <<'EOF' || log "summary failed"
import glob, json, statistics, sys
runs, out = sys.argv[1], sys.argv[2]
by = {}
for path in sorted(glob.glob(f"{runs}/*.json")):
    d = json.load(open(path))
    variant = d["tag"].rsplit("-r", 1)[0]
    t, m = d["timing"], d["memory"]
    by.setdefault(variant, []).append({
        "status": d["status"], "img_s": t["images_per_s"], "median_step_s": t["median_step_s"],
        "reserved_gb": m["peak_reserved_gb"], "run_reserved_gb": m["run_peak_reserved_gb"],
        "device_gb": m["device_peak_gb"], "gpu": d["provenance"]["gpu_name"], "extra": d["extra"]})
rows = ["| variant | runs | img/s median [min-max] | median step ms | peak reserved GB (train) | whole run | whole device |",
        "|---|---:|---:|---:|---:|---:|---:|"]
for variant, rs in sorted(by.items()):
    ok = [r for r in rs if r["status"] == "ok" and r["img_s"]]
    if not ok:
        rows.append(f"| {variant} | 0 of {len(rs)} ok | | | | | |")
        continue
    speeds = [r["img_s"] for r in ok]
    rows.append(f"| {variant} | {len(ok)} | {statistics.median(speeds):.1f} [{min(speeds):.1f}-{max(speeds):.1f}] "
                f"| {1000 * statistics.median(r['median_step_s'] for r in ok):.1f} "
                f"| {max(r['reserved_gb'] for r in ok):.3f} | {max(r['run_reserved_gb'] for r in ok):.3f} "
                f"| {max(r['device_gb'] or 0 for r in ok):.3f} |")
text = "\n".join(rows) + f"\n\nGPU: {sorted({r['gpu'] for rs in by.values() for r in rs})}\n"
print(text)
open(f"{out}/summary.md", "w").write(text)
json.dump(by, open(f"{out}/summary.json", "w"), indent=1)
EOF
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$W/gpu.csv" 2>&1
  tar czf "$OUT/runs.tgz" -C /tmp offload-eager
  log done
}
trap finish EXIT
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: a dry run in an environment that has the project
  [ -d .whl ] && install_wheels
  install_checkout || log "pip install -e . failed"
fi
export FMR_GPU_LOCK=$W/gpu.lock
: > "$FMR_GPU_LOCK"
code_of() {  # which offload code a tree's recipes import: batched (this tree) or not (the base)
  (cd "$1" && PYTHONPATH=$1${PYTHONPATH:+:$PYTHONPATH} python3 -c "import inspect
from fabric_memory_recipes.training.techniques import offload as o
print(o.__file__, 'batched' in inspect.signature(o.offload_activations).parameters)" 2>&1 | tail -1)
}
log "this tree: $(code_of "$HERE")"
have_base=0
if [ -d "$BASE/recipes" ]; then have_base=1; BASE=$(cd "$BASE" && pwd); log "base tree: $(code_of "$BASE")"
else log "no $BASE: the before runs are skipped"; fi

log "devtools.speed.offload_hooks (holding the GPU lock)"
read -ra probe <<< "${PROBE_ARGS:-}"  # e.g. "--device cpu --model vit_tiny --min-kb 1" for a dry run
flock "$FMR_GPU_LOCK" timeout 200 python3 -m devtools.speed.offload_hooks --out "$OUT" ${probe[@]+"${probe[@]}"} > "$W/offload_hooks.log" 2>&1
log "offload_hooks: exit $? $(grep -c '^{' "$W/offload_hooks.log") modes"; grep '^{' "$W/offload_hooks.log" | cut -c1-300

read -ra extra <<< "${EXTRA:-}"  # e.g. EXTRA="--accelerator cpu --model vit_tiny" for a dry run on a CPU
COMMON=(--data synthetic --data-dir "$HERE/data" --weights none --max-steps 20 --eval-batches 1 --results-dir "$W/runs" ${extra[@]+"${extra[@]}"})
# start NAME TREE ARGS...: one recipe process in the background, at most JOBS at once, stopped with SIGINT
# (it records what it measured) before the call's limit
start() {
  local name=$1 tree=$2 left; shift 2
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  left=$(( LIMIT - ($(date +%s) - T0) - 20 ))
  if [ "$left" -lt 45 ]; then log "skip $name: too close to the limit"; return; fi
  log "start $name: $*"
  (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} exec timeout -s INT "$left" python3 \
      recipes/11_activation_offload.py "${COMMON[@]}" --tag "$name" "$@" > "$W/runs/$name.log" 2>&1) &
}
for r in $(seq 1 "$RUNS"); do
  [ "$have_base" = 1 ] && start "eager-before-r$r" "$BASE" --mode eager
  start "eager-after-r$r" "$HERE" --mode eager
  start "eager-compute-r$r" "$HERE" --mode eager --offload-window-mb 0
  [ "$have_base" = 1 ] && start "fast-before-r$r" "$BASE"
  start "fast-after-r$r" "$HERE"
done
wait
log "runs ended"
