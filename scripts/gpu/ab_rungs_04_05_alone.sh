#!/usr/bin/env bash
# Rungs 05 and 04 alone on the GPU, base ($BASE, default build/ab-base) and after (this checkout) alternating,
# --quick's flags, one process at a time: is run_all's rung-05 difference the code or the concurrency?
#   OUT=... bash scripts/gpu/ab_rungs_04_05_alone.sh      # carry .whl, $BASE
set -u
: "${OUT:?set OUT}"
BASE=${BASE:-build/ab-base}
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export PYTHONUNBUFFERED=1 FMR_OFFLINE=1
T0=$(date +%s); HERE=$(pwd)
install_wheels
mkdir -p /tmp/A
i=0
for pair in 05:base 05:after 05:base 05:after 05:base 05:after 04:base 04:after 04:after 04:base; do
  rung=${pair%%:*}; side=${pair##*:}; i=$((i + 1))
  [ $(( $(date +%s) - T0 )) -gt 500 ] && { echo "deadline: stop before run $i" >> "$OUT/alone.log"; break; }
  dir=$HERE; [ "$side" = base ] && dir=$HERE/$BASE
  script=$(ls "$dir"/recipes/${rung}_*.py)
  (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout 150 python3 "$script" --data synthetic --weights none \
     --max-steps 20 --eval-batches 1 --results-dir "/tmp/A/$i-$rung-$side" > "/tmp/A/$i-$rung-$side.log" 2>&1)
  echo "run $i $rung $side exit $? at $(( $(date +%s) - T0 )) s" >> "$OUT/alone.log"
  tar -czf "$OUT/alone.tgz" -C /tmp A
done
