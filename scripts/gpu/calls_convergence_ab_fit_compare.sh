#!/usr/bin/env bash
# GPU calls for the convergence benchmark, the compensated bf16 default's A/B, the fit proof and the
# comparison's rungs 11 and 15, each one device command of at most 10 minutes, from the repository root
# of a fresh GPU machine, results under $OUT (one tar per part: at most 8 files come back):
#
#   bash scripts/gpu/calls_convergence_ab_fit_compare.sh conv  # 4 GPUs: the convergence benchmark (compensated_bf16_checks.sh
#                                                         #   convergence), resumed from .wt/conv (a copy of
#                                                         #   results/published/h100/convergence) -> conv.tgz
#   bash scripts/gpu/calls_convergence_ab_fit_compare.sh ab    # 4 GPUs: the compensated default's A/B (plain base e81b449
#                                                         #   at build/ab-base vs this checkout), a quarter of the
#                                                         #   rungs per GPU; then the stochastic fast == eager rows
#                                                         #   (GPU 2) and the learning-rate probes (GPU 3)
#   bash scripts/gpu/calls_convergence_ab_fit_compare.sh one   # 1 GPU: the fit proof for swin_t, then rung 11's
#                                                         #   convergence runs again (resumed from .wt/conv, the
#                                                         #   conv call's folder)
#   bash scripts/gpu/calls_convergence_ab_fit_compare.sh cmp   # 1 GPU: the comparison of rungs 11 and 15 (as
#                                                         #   scripts/gpu/compare_rungs_11_15.sh)
#
# Carried (ignored paths): .whl (torchao, torch-optimi wheels), .ref (the article's scripts), .wt/conv,
# build/ab-base. Every part stops its runs with SIGINT before the call's limit (LIMIT, default 570 s), so
# what finished, and the interrupted runs' partial results, come back.
set -u
part=${1:?conv, ab, one or cmp}
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[calls $part $(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/calls-$part.log"; }
install_wheels
install_checkout || log "pip install -e . failed"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$OUT/gpus-$part.csv" 2>&1
git log -1 --format='%H %s' > "$OUT/commit-$part.txt" 2>/dev/null || true
log "installed; $(python3 -c 'import torch, torchao; print(torch.__version__, torchao.__version__)' 2>&1)"

# stop_at S PATTERN: at S seconds into the call, Ctrl-C every process matching PATTERN (the recipes write
# their results as "interrupted" and exit), then SIGKILL what is left 20 s later
stop_at() { ( sleep $(( $1 - ($(date +%s) - T0) )); log "limit near: SIGINT to '$2'"; pkill -INT -f "$2";
              sleep 20; pkill -KILL -f "$2" ) & }

case $part in
  conv)
    mkdir -p /tmp/c && rm -rf /tmp/c/convergence && cp -r .wt/conv /tmp/c/convergence
    stop_at $(( LIMIT - 40 )) "recipes/[0-9][0-9]_"
    bash scripts/gpu/compensated_bf16_checks.sh convergence /tmp/c 4 --parallel 9 --deadline-s 60 > "$OUT/conv.log" 2>&1
    log "convergence exit $?"
    tar -czf "$OUT/conv.tgz" -C /tmp/c convergence
    ;;
  ab)
    mkdir -p /tmp/ab
    quarter=("04 05 06" "07 10 11" "12 13" "14 15")
    for g in 0 1 2 3; do
      ( export CUDA_VISIBLE_DEVICES=$g
        python3 -m devtools.ab_ladder --base build/ab-base --new . --out /tmp/ab/ab-gpu$g \
          --modes fast --rungs ${quarter[$g]} --budget 330 --timeout 200 --memory-tolerance 0.02 \
          --speed-tolerance 0.05 -- --data synthetic --weights none --max-steps 20 --eval-batches 1 \
          > /tmp/ab/ab-gpu$g.log 2>&1
        echo "[gpu$g] ab exit $?" >> /tmp/ab/ab-gpu$g.log
        if [ $g = 2 ]; then  # fast == eager, the stochastic rows, every compensated rung (vit_tiny)
          python3 -m devtools.check_equivalence --rungs 03,04,05,06,07,10,11,12,13,14,15 \
            --checks stochastic --model vit_tiny --steps 10 --parallel 6 --out /tmp/ab/equivalence \
            > /tmp/ab/equivalence.log 2>&1; echo "equivalence exit $?" >> /tmp/ab/equivalence.log
        fi
        if [ $g = 3 ]; then  # the learning-rate probes (docs/accuracy.md), seed 0, beside each other
          for spec in "12,14 --sgd-lr 0.0075" "04 --adam-lr 5e-5" "15 --adam-lr 4e-4"; do
            set -- $spec; r=$1; shift
            python3 -m fabric_memory_recipes.tools.convergence.benchmark --model vit_l_16 --out /tmp/ab/lr-probe-${r//,/-} \
              --seed-list 0 --rungs $r --no-variants --no-memory --lost-seeds "" --parallel 2 "$@" \
              > /tmp/ab/lr-probe-${r//,/-}.log 2>&1 &
          done; wait
        fi ) &
    done
    stop_at $(( LIMIT - 35 )) "recipes/[0-9][0-9]_"
    wait; log "ab parts done"
    tar -czf "$OUT/ab.tgz" -C /tmp ab
    ;;
  one)  # swin_t's fit proof, then rung 11's convergence runs again (after its capture fix), resumed from .wt/conv
    mkdir -p /tmp/fit; [ -d .wt/fit ] && cp -rn .wt/fit/. /tmp/fit/
    timeout 330 python3 -m devtools.fit_proof --out /tmp/fit --gpus 0 --only swin_t \
      --deadline 170 > "$OUT/fit.log" 2>&1; log "fit proof exit $?"
    tar -czf "$OUT/fit.tgz" -C /tmp fit
    mkdir -p /tmp/c && rm -rf /tmp/c/convergence && cp -r .wt/conv /tmp/c/convergence
    stop_at $(( LIMIT - 30 )) "recipes/[0-9][0-9]_"
    bash scripts/gpu/compensated_bf16_checks.sh convergence /tmp/c 1 --rungs 11 --parallel 3 --no-memory > "$OUT/conv.log" 2>&1
    log "convergence exit $?"
    tar -czf "$OUT/conv.tgz" -C /tmp/c convergence
    ;;
  cmp)  # the comparison's rungs 11 and 15 again, one call of the tool each (11 first: it is short)
    mkdir -p /tmp/cmp/compare && cp -r results/published/h100/compare/. /tmp/cmp/compare/
    for r in 11 15; do
      timeout $(( $(left) - 8 )) python3 -m fabric_memory_recipes.tools.compare.reference \
        --reference .ref/pytorch-memory-optim --rungs $r --out /tmp/cmp/compare --budget 150 --timeout 150 \
        > "$OUT/compare-$r.log" 2>&1; log "comparison of rung $r exit $?"
      tar -czf "$OUT/compare.tgz" -C /tmp/cmp compare
    done
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
log "done"
