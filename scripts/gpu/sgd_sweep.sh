#!/usr/bin/env bash
# The SGD rungs' (06, 07, 10, 11) and rung 15's learning rate, warm-up and epochs, chosen on the digits'
# validation split (fabric_memory_recipes/tools/convergence/sweep.py; docs/accuracy.md), then the
# convergence benchmark again for the rungs whose policy changed (3 seeds, the test split). One GPU, runs
# sharing it through CUDA MPS, as the benchmark's calls did. One device command per part, each under
# ~8 minutes, from the repository root of a fresh GPU machine; results under $OUT as one tar per part
# (plus its summary as a plain file):
#
#   bash scripts/gpu/sgd_sweep.sh sweep           # ~7-8 min: 14 runs at once, seed 0: rungs 06 and 10 at
#                                                 #   SGD lr 0.03/0.06/0.12 x warm-up 2/6 epochs (today's,
#                                                 #   0.03 and 2, read from the committed runs), rung 15 at
#                                                 #   Adam 1e-4/2e-4 x warm-up 2/6 and 1e-4 for 90 epochs
#                                                 #   -> sweep.tgz, sweep.md (validation accuracy only)
#   bash scripts/gpu/sgd_sweep.sh rerun RUNGS [tool flags]
#                                                 # the benchmark for RUNGS x 3 seeds, resumed from a copy
#                                                 #   of results/published/h100/convergence: only the runs
#                                                 #   whose policy (policy.TUNED, or the flags given) differs
#                                                 #   from the committed ones run -> convergence.tgz, README.md
#       rerun 06,07,10,11  ~7-8 min (12 ViT-L/16 runs at 4 x 4 at once: TUNED's SGD 0.06, warm-up 2 epochs)
#       rerun 15           ~3 min (3 runs: TUNED's Adam 2e-4, warm-up 6 epochs)
#       rerun 06 --variants 06   ~8-9 min: rung 06's plain, kahan (no CUDA graphs) and mixed runs at its
#                                 new policy; run it alone, LIMIT=580
#   A later part on the same machine goes on in the same folder (its README then has every part's rows).
#   Another policy than TUNED's: --no-tuned and the flags, one optimizer per call: e.g.
#       rerun 06,07,10,11 --no-tuned --sgd-lr 0.06 --warmup-epochs 6   (~7-8 min)
#       rerun 15 --no-tuned --adam-lr 1e-4 --epochs 90                  (~3 min)
#
# Carried (ignored path): .whl (the torchao and torch-optimi wheels: stochastic rounding, Kahan). Every
# part stops its runs with SIGINT before the call's limit (LIMIT, default 560 s): what finished comes back.
set -u
part=${1:?sweep or rerun}
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); LIMIT=${LIMIT:-560}; WORK=/tmp/sgd-$part; mkdir -p "$WORK"
log() { echo "[sgd_sweep $part $(( $(date +%s) - T0 )) s] $*" | tee -a "$WORK/log.txt"; }
left() { echo $(( LIMIT - 25 - ($(date +%s) - T0) )); }
finish() { mps_off
           record_machine "$WORK"
           tar czf "$OUT/$part.tgz" -C /tmp "sgd-$part"; }
trap finish EXIT
install_wheels
install_checkout || log "pip install -e . failed"
log "installed; $(python3 -c 'import torch, torchao; print(torch.__version__, torchao.__version__)' 2>&1)"
mps_on

# timeout sends SIGINT to the tool's whole process group (its recipe runs too): they write their results
# as interrupted and exit; what finished is in the summary, which the tool rewrites after every run
case $part in
  sweep)
    timeout -s INT -k 20 "$(left)" python3 -m fabric_memory_recipes.tools.convergence.sweep --model vit_l_16 \
      --out "$WORK/sweep" --seed-list 0 --parallel 14 --deadline-s 60 \
      --grid "06,10 lr=0.03,0.06,0.12 warmup=2,6" --grid "15 lr=1e-4,2e-4 warmup=2,6" --grid "15 epochs=90" \
      > "$WORK/sweep.log" 2>&1
    log "sweep exit $?"
    python3 -m fabric_memory_recipes.tools.convergence.sweep --report "$WORK/sweep" >> "$WORK/sweep.log" 2>&1
    cp "$WORK/sweep/sweep.md" "$OUT/sweep.md" 2>/dev/null; tail -n 40 "$WORK/sweep.log"
    ;;
  rerun)
    rungs=${2:?rerun RUNGS [tool flags]}; shift 2
    [ -d "$WORK/convergence" ] || cp -r results/published/h100/convergence "$WORK/convergence"
    timeout -s INT -k 20 "$(left)" python3 -m fabric_memory_recipes.tools.convergence.benchmark --model vit_l_16 \
      --out "$WORK/convergence" --rungs "$rungs" --seeds 3 --no-variants --no-memory --lost-seeds "" \
      --parallel 15 --deadline-s 60 "$@" > "$WORK/convergence.log" 2>&1
    log "convergence exit $?"
    python3 -m fabric_memory_recipes.tools.convergence.benchmark --report "$WORK/convergence" >> "$WORK/convergence.log" 2>&1
    cp "$WORK/convergence/README.md" "$OUT/README.md" 2>/dev/null; tail -n 30 "$WORK/convergence.log"
    ;;
  *) echo "unknown part $part: sweep or rerun" >&2; exit 2 ;;
esac
