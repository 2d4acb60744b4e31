#!/usr/bin/env bash
# The default-mode ladder again, against the committed one: ./run_all.sh --quick on one H100, then each
# rung's peak reserved (and speed) beside results/published/h100/ladder/ (a refactor must leave memory
# within 1 %). One device command, from the repository root of a fresh GPU machine; carried: .whl (torchao,
# torch-optimi). Results: $OUT/quick.tgz (the run folder, the comparison table).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
install_wheels .whl/torchao*.whl .whl/torch_optimi*.whl
install_checkout
R=/tmp/quick; mkdir -p $R
trap 'tar czf "$OUT/quick.tgz" -C /tmp quick' EXIT
( time ./run_all.sh --quick --results-dir $R/runs ) > $R/console.log 2>&1
record_machine $R
python3 - <<'PY' | tee $R/compare.txt
import json, pathlib
new, old = pathlib.Path("/tmp/quick/runs"), pathlib.Path("results/published/h100/ladder")
print(f"{'rung':32} {'reserved old':>12} {'new':>8} {'diff %':>7} {'img/s old':>10} {'new':>8}")
for f in sorted(old.glob("[0-9]*.json")):
    g = new / f.name
    if not g.exists():
        print(f"{f.stem:32} missing"); continue
    a, b = json.loads(f.read_text()), json.loads(g.read_text())
    ra, rb = a["memory"]["peak_reserved_gb"], b["memory"]["peak_reserved_gb"]
    sa, sb = a["timing"].get("images_per_s"), b["timing"].get("images_per_s")
    print(f"{f.stem:32} {ra:12.3f} {rb:8.3f} {100 * (rb - ra) / ra:+7.2f} {sa or 0:10.1f} {sb or 0:8.1f} {b['status']}")
PY
