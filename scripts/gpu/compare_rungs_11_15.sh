#!/usr/bin/env bash
# Re-run the comparison's rungs 11 and 15 on one H100 after the speed levers (rung 11's
# side streams, rung 15's fused-qkv attention), so the comparison agrees with today's ladder. Run from the
# repository root on the GPU machine, with the article's scripts at .ref/pytorch-memory-optim (rungs 11 and
# 15 have no reference script: only the project's eager and fast runs of them are made). About 3.5 GPU
# minutes (earlier calls: rung 11 eager 22 s, fast 36 s; rung 15 up to 200 s for both modes).
#
# Everything goes under "$OUT/compare": the committed comparison is copied there first, so the tool keeps
# its other rows (each with its own call) and replaces rows 11 and 15. Then render it, and copy back:
#   cp -r "$OUT/compare/." results/published/h100/compare/
#   fmr-report --comparison results/published/h100/compare/comparison.json --readme docs/compare_reference.md:comparison --docs docs
set -euo pipefail
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$OUT/compare"
cp -r results/published/h100/compare/. "$OUT/compare/"
python3 -m fabric_memory_recipes.tools.compare.reference --reference .ref/pytorch-memory-optim \
  --rungs 11,15 --out "$OUT/compare" --budget 230 --timeout 150 2>&1 | tee "$OUT/compare/compare-11-15.log"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/compare/gpu.txt" || true
