#!/usr/bin/env bash
# A/B of `./run_all.sh --quick` on one GPU, one device command: a base checkout ($BASE, default
# build/ab-base, e.g. `git archive 40354b9`, the code before the package relayout, carried) and this
# checkout, back to back on one machine, base first on cold compile caches. Results under $OUT: base.tgz,
# after.tgz (each run folder with its console log and `time -v`).
#
#   OUT=... bash scripts/gpu/ab_run_all_quick.sh [SIDE ...]   # carry .whl (torchao, torch-optimi wheels), $BASE
#
# SIDEs run in the order given (default: base after); a side named base* runs $BASE, any other
# this checkout, so `after base after2` measures both sides on warm caches, after a cold first run.
# ONLY=14,15,16 passes `--only` to run_all.sh; COLD=1 gives each side its own empty compile caches (inductor,
# triton), so every side starts cold. $OUT/compare.txt: each rung's peak allocated and reserved per side.
set -u
: "${OUT:?set OUT}"
BASE=${BASE:-build/ab-base}
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s)
log() { echo "[ab_run_all_quick $(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/ab_run_all_quick.log"; }
install_wheels
export PYTHONPATH=/tmp/site  # the wheels only: each side imports its own installed checkout
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$OUT/gpus.csv" 2>&1
HERE=$(pwd)
sides=("$@"); [ ${#sides[@]} -eq 0 ] && sides=(base after)
for side in "${sides[@]}"; do
  dir=$HERE; case $side in base*) dir=$HERE/$BASE ;; esac
  (cd "$dir" && install_checkout) || log "$side: pip install -e failed"
  log "$side: starting in $dir"
  mkdir -p /tmp/E
  left=$(( ${LIMIT:-585} - ($(date +%s) - T0) - 15 ))  # the tars must come back before the call's limit
  if [ -n "${COLD:-}" ]; then
    export TORCHINDUCTOR_CACHE_DIR=/tmp/caches/$side/inductor TRITON_CACHE_DIR=/tmp/caches/$side/triton
  fi
  (cd "$dir" && timeout -s INT "$left" /usr/bin/time -v -o "/tmp/E/$side-time.txt" ./run_all.sh --quick \
      ${ONLY:+--only "$ONLY"} --results-dir "/tmp/E/$side" > "/tmp/E/$side-console.log" 2> "/tmp/E/$side-stderr.log")
  log "$side: exit $?"
  tar -czf "$OUT/$side.tgz" -C /tmp/E "$side" "$side-console.log" "$side-time.txt" "$side-stderr.log"
done
python3 - "${sides[@]}" <<'PY' | tee "$OUT/compare.txt"
import json, pathlib, sys
sides = sys.argv[1:]
runs = {s: {f.stem: json.loads(f.read_text()) for f in pathlib.Path("/tmp/E", s).glob("[0-9]*.json")} for s in sides}
print(f"{'rung':28}" + "".join(f" {s + ' alloc':>14} {s + ' reserved':>16}" for s in sides))
for rung in sorted(set().union(*runs.values())):
    cells = []
    for s in sides:
        m = runs[s].get(rung, {}).get("memory", {})
        cells.append(f" {m.get('peak_allocated_gb', float('nan')):14.4f} {m.get('peak_reserved_gb', float('nan')):16.4f}")
    print(f"{rung:28}" + "".join(cells))
PY
log done
