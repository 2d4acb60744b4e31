#!/usr/bin/env bash
# Rung 15 (recipes/15_speed.py) in the configuration of `./run_all.sh --quick` (--data synthetic --weights none
# --eval-batches 1, fast mode), on one GPU, from the repository root; one part per device command:
#
#   OUT=... bash scripts/gpu/speed_rung_profile.sh profile   # ~3 min: where the step's GPU time goes
#   OUT=... bash scripts/gpu/speed_rung_profile.sh ab        # ~5 min: settings A/B'd, each run alone
#   OUT=... bash scripts/gpu/speed_rung_profile.sh autotune  # ~8 min: inductor's own tuning (long compiles)
#
# profile: devtools/speed/rung_profile.py runs the recipe with torch.profiler on for steps 9-12 (after the
#   compilation, the two eager warm-up steps and the capture), twice: fast mode as --quick runs it (one CUDA
#   graph per step: kernels by kind) and --no-cuda-graphs (the same compiled model launched from Python:
#   kernels by kind and by the phase that launched them, forward / backward / optimizer). Each table:
#   GPU ms per step in linear-layer matrix products, attention, the patch convolution, Triton reductions
#   (LayerNorm, softmax, loss) and pointwise kernels (GELU, residual adds, casts, copies), ATen kernels,
#   copies, the GPU idle between kernels; the model's FLOPs by kind against their kernels' time; the 25
#   longest kernels.
# ab: the recipe as --quick runs it (20 steps: 16 timed after 3 warm-up intervals), each setting its own
#   process, one at a time, the baseline first and last: --bf16-update plain (torch's fused Adam instead
#   of torchao's stochastic-rounding AdamW: information only, it changes the update), cuDNN's attention
#   (flash and memory-efficient SDPA off), cudnn.benchmark (the patch convolution's algorithm timed).
# autotune: baseline, inductor's coordinate-descent tuning of its Triton kernels (LayerNorm, GELU, adds),
#   then max_autotune_gemm (Triton GEMM templates against cuBLAS): minutes of compilation each, not
#   affordable in --quick's five minutes as they are; they say what the kernels could gain.
# Results under $OUT: <part>.md (img/s, median step, peak reserved per run; the profile tables), log.txt,
# <part>.tgz (results JSONs, logs, traces). Carry .whl (torchao: the rung's default optimizer needs it).
set -u
part=${1:-profile}
case $part in profile|ab|autotune) ;; *) echo "speed_rung_profile.sh: part must be profile, ab or autotune, not '$part'" >&2; exit 2 ;; esac
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); LIMIT=${LIMIT:-560}; W=/tmp/speed-$part; rm -rf "$W"; mkdir -p "$W/runs"
log() { echo "[speed_rung_profile $part $(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
finish() {
  python3 - "$W" "$OUT/$part.md" <<'EOF' || log "summary failed"
import glob, json, os, sys
w, out = sys.argv[1], sys.argv[2]
lines = []
runs = sorted(glob.glob(f"{w}/runs/*.json"), key=os.path.getmtime)
if runs:
    lines += ["| run | status | img/s | median step ms | step ms min-max (timed) | peak reserved GB | MFU |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for path in runs:
        d = json.load(open(path)); t = d["timing"]; s = t.get("step_s") or {}
        lines.append(f"| {d['tag']} | {d['status']} | {t['images_per_s'] or 0:.1f} | {1000 * (t['median_step_s'] or 0):.1f} "
                     f"| {1000 * s.get('min', 0):.1f}-{1000 * s.get('max', 0):.1f} | {d['memory']['peak_reserved_gb']:.2f} "
                     f"| {d['extra'].get('mfu') or 0:.3f} |")
    lines.append(f"\nGPU: {json.load(open(runs[0]))['provenance']['gpu_name']}\n")
for md in sorted(glob.glob(f"{w}/profile-*.md")):
    lines.append(open(md).read())
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$W/gpu.csv" 2>&1
  tar czf "$OUT/$part.tgz" -C /tmp "speed-$part"
  log done
}
trap finish EXIT
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: a dry run in an environment that has the project
  [ -d .whl ] && install_wheels
  install_checkout || log "pip install -e . failed"
fi
read -ra extra <<< "${EXTRA:-}"  # e.g. EXTRA="--accelerator cpu --model vit_tiny --batch-size 8" for a dry run
QUICK=(--data synthetic --weights none --eval-batches 1 ${extra[@]+"${extra[@]}"})  # run_all.sh --quick's flags

# run TAG [launcher flags] -- [recipe flags]: one process, stopped with SIGINT (it records what it
# measured) before the call's limit
run() {
  local tag=$1 left; shift
  left=$(( LIMIT - ($(date +%s) - T0) - 20 ))
  if [ "$left" -lt 60 ]; then log "skip $tag: too close to the limit"; return; fi
  local launcher=() recipe=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do launcher+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  recipe=("$@")
  log "start $tag: ${launcher[*]:-} -- ${recipe[*]:-}"
  timeout -s INT "$left" python3 -m devtools.speed.rung_profile --out "$W" --tag "$tag" ${launcher[@]+"${launcher[@]}"} -- \
    recipes/15_speed.py "${QUICK[@]}" --results-dir "$W/runs" --tag "$tag" ${recipe[@]+"${recipe[@]}"} > "$W/$tag.log" 2>&1
  log "end $tag: exit $? $(grep -h 'speed  ' "$W/$tag.log" | tail -1)"
}
case $part in
  profile)
    run fast --start 8 --steps 4 -- --max-steps 14
    run compiled --start 8 --steps 4 -- --max-steps 14 --no-cuda-graphs
    ;;
  ab)
    run baseline --no-profile -- --max-steps 20
    run plain-adam --no-profile -- --max-steps 20 --bf16-update plain
    run cudnn-attention --no-profile --knob cudnn-attention -- --max-steps 20
    run cudnn-benchmark --no-profile --knob cudnn-benchmark -- --max-steps 20
    run baseline-again --no-profile -- --max-steps 20
    ;;
  autotune)
    run baseline --no-profile -- --max-steps 20
    run coordinate-descent --no-profile --knob coordinate-descent -- --max-steps 20
    run max-autotune-gemm --no-profile --knob max-autotune-gemm -- --max-steps 20
    ;;
esac
