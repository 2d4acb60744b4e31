#!/usr/bin/env bash
# GPU evidence for the compensated bf16 default: the rungs with it (stochastic rounding), measured.
# Each part is one device command of at most 10 minutes; run from the repository root, results under OUT.
#
#   scripts/gpu/compensated_bf16_checks.sh smoke      OUT   # ~4 GPU-min, 1 GPU: fast == eager on a small model, 3 rungs at 20 steps
#   scripts/gpu/compensated_bf16_checks.sh ab N       OUT   # A/B plain (the base below) vs compensated default, 1 GPU,
#                                           #   N = 1, 2, 3 (a third of the rungs each, ~9 GPU-min each)
#   scripts/gpu/compensated_bf16_checks.sh equivalence OUT  # ~8 GPU-min, 1 GPU: every compensated rung, fast == eager (ViT-B/16)
#   scripts/gpu/compensated_bf16_checks.sh convergence OUT [GPUS] [tool flags...]
#                                           # ViT-L/16 on digits, 30 epochs, 3 seeds, fast mode: the rungs
#                                           #   whose default changed and rung 06's other rules. ~40 runs,
#                                           #   ~25 GPU-min (the published benchmark: 45 runs, 26.5 GPU-min);
#                                           #   GPUS=4: one 10-minute call. Resumable: call again with the
#                                           #   same OUT and it runs only what is missing.
#
#   scripts/gpu/compensated_bf16_checks.sh lr-probe   OUT   # ~8 GPU-min, 1 GPU: rungs 12/14 at SGD 0.0075, 04 at Adam 5e-5, seed 0
#
# The A/B base is the commit the compensated default was built on (e81b449), as a git archive beside the checkout:
#   git archive e81b449 --prefix=ab-base/ | tar -x -C build/     (then carry build/ab-base)
# On the GPU machines torchao/torch-optimi come from carried wheels (.whl), as in docs/install.md.
set -uo pipefail
part=${1:?part: smoke, ab, equivalence or convergence}
out=${2:?output folder}
mkdir -p "$out"
log() { echo "[compensated_bf16 $(date +%T)] $*" | tee -a "$out/compensated_bf16.log"; }
ALL="04 05 06 07 10 11 12 13 14 15"  # the rungs whose default is stochastic rounding (03 stays plain)
QUICK=(--data synthetic --weights none --max-steps 20 --eval-batches 1)

. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # mps_on, mps_off

case "$part" in
  smoke)
    for r in 06 14 04; do  # ViT-L/16, the compensated default, 20 steps in fast mode, beside the check
      timeout 240 python3 recipes/${r}_*.py "${QUICK[@]}" --results-dir "$out/runs" > "$out/run-$r.log" 2>&1 &
    done
    log "equivalence, vit_tiny, the stochastic rows (+ the rounding control) of rungs 03 04 06 12 13 14"
    timeout 250 python3 -m devtools.check_equivalence --rungs 03,04,06,12,13,14 \
      --checks stochastic --model vit_tiny --steps 10 --parallel 6 --out "$out/equivalence" \
      > "$out/equivalence.log" 2>&1; log "equivalence exit $?"
    wait; log "runs done"; tail -n 3 "$out"/run-*.log; tail -n 12 "$out/equivalence.log"
    ;;
  ab)
    n=${3:?ab N: 1, 2 or 3}
    rungs=$(case $n in 1) echo "04 05 06 07";; 2) echo "10 11 12";; 3) echo "13 14 15";; esac)
    log "A/B fast mode, base build/ab-base vs this checkout, rungs $rungs"
    python3 -m devtools.ab_ladder --base build/ab-base --new . --out "$out/ab" \
      --modes fast --rungs $rungs --budget 540 --timeout 200 --memory-tolerance 0.02 --speed-tolerance 0.05 \
      -- "${QUICK[@]}" 2>&1 | tee "$out/ab-$n.log"
    ;;
  equivalence)
    log "fast == eager: the stochastic rows of every compensated rung and rung 03 (ViT-B/16, 10 steps)"
    python3 -m devtools.check_equivalence --rungs "03,${ALL// /,}" --checks stochastic \
      --model vit_b_16 --steps 10 --parallel 4 --out "$out/equivalence" 2>&1 | tee "$out/equivalence.log"
    ;;
  convergence)
    gpus=${3:-1}; shift $(( $# < 3 ? $# : 3 ))
    mps_on
    # 10 runs per GPU at once (4 GPUs: all ~40 start together); no lost-update seeds (those run without
    # CUDA graphs, 3x slower: add --lost-seeds 0 to measure them); --deadline-s: nothing starts after 60 s
    python3 -m fabric_memory_recipes.tools.convergence.benchmark --model vit_l_16 --out "$out/convergence" --seeds 3 \
      --rungs "${ALL// /,}" --variants 06 --lost-seeds "" --gpus "$gpus" --parallel 10 --deadline-s 60 "$@" \
      2>&1 | tee -a "$out/convergence.log"
    mps_off
    ;;
  lr-probe)  # is a small-batch rung's gap its learning rate? one seed, its own folder (docs/accuracy.md)
    mps_on
    python3 -m fabric_memory_recipes.tools.convergence.benchmark --model vit_l_16 --out "$out/lr-probe-sgd" --seed-list 0 \
      --rungs 12,14 --no-variants --no-memory --lost-seeds "" --sgd-lr 0.0075 --parallel 2 2>&1 | tee -a "$out/lr-probe.log" &
    python3 -m fabric_memory_recipes.tools.convergence.benchmark --model vit_l_16 --out "$out/lr-probe-adam" --seed-list 0 \
      --rungs 04 --no-variants --no-memory --adam-lr 5e-5 --parallel 1 2>&1 | tee -a "$out/lr-probe.log"
    wait; mps_off
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
