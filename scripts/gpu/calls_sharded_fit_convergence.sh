#!/usr/bin/env bash
# GPU calls that share a machine between the sharded rungs' runs (sharded_four_gpus.sh), the fit proof
# (devtools/fit_proof.py) and the convergence benchmark, from the repository root, the project installed,
# results in $OUT:
#   bash scripts/gpu/calls_sharded_fit_convergence.sh A   # 4 GPUs: the sharded 4-GPU comparison; then the 2-GPU
#                                                       # comparison on GPUs 0,1 beside the fit proof on GPUs 2,3
#   bash scripts/gpu/calls_sharded_fit_convergence.sh B   # 4 GPUs: the fit proof on 4; then the your-model FSDP
#                                                       # and nodes parts of sharded_four_gpus.sh
#   bash scripts/gpu/calls_sharded_fit_convergence.sh F   # 1 GPU: the fit proof alone, resumable
#   bash scripts/gpu/calls_sharded_fit_convergence.sh C   # 1 GPU: the compensated bf16 convergence runs (as many as fit)
# The fit proof resumes from .wt/fit (the last call's fit.tgz, unpacked there) when it is carried.
set -u
phase=${1:?A, B or C}
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); left() { echo $(( ${LIMIT:-570} - ($(date +%s) - T0) )); }
FIT=/tmp/fit; mkdir -p $FIT; [ -d .wt/fit ] && cp -rn .wt/fit/. $FIT/
packfit() { tar -czf $OUT/.fit.tgz -C /tmp fit && mv -f $OUT/.fit.tgz $OUT/fit.tgz; }
fit() {  # fit GPUS STOP NEWJOBS: the fit proof, stopped at STOP seconds, no job started after NEWJOBS
  timeout "$2" python3 -m devtools.fit_proof --out $FIT --gpus "$1" --deadline "$3" \
    > $OUT/fit-$phase.log 2>&1; packfit
}
nvidia-smi --query-gpu=index,name,memory.total --format=csv > $OUT/gpus-$phase.csv 2>&1
case $phase in
  A)
    mkdir -p $OUT/a4 $OUT/a2
    OUT=$OUT/a4 PARTS=gpu4 DEADLINE=260 bash scripts/gpu/sharded_four_gpus.sh > $OUT/a4.log 2>&1
    OUT=$OUT/a2 PARTS=gpu2 DEADLINE=$(( $(left) - 20 )) bash scripts/gpu/sharded_four_gpus.sh > $OUT/a2.log 2>&1 &
    fit 2,3 $(( $(left) - 15 )) $(( $(left) - 100 )); wait ;;
  B)  # the fit proof first, then what time is left for the sharded runs' parts
    mkdir -p $OUT/b
    fit 0,1,2,3 ${FIT_STOP:-420} ${FIT_NEW:-250}
    OUT=$OUT/b PARTS="yourmodel nodes" DEADLINE=$(( $(left) - 10 )) bash scripts/gpu/sharded_four_gpus.sh > $OUT/b.log 2>&1 ;;
  F)  # 1 GPU: the fit proof alone (call again with .wt/fit carried to go on)
    fit 0 $(( $(left) - 15 )) $(( $(left) - 200 )) ;;
  C)
    timeout $(( $(left) - 20 )) bash scripts/gpu/compensated_bf16_checks.sh convergence /tmp/conv 1 --seed-list 0 --parallel 13 --no-memory --deadline-s 30 \
      > $OUT/conv.log 2>&1
    tar -czf $OUT/conv.tgz -C /tmp conv ;;
esac
echo "calls_sharded_fit_convergence $phase: $(( $(date +%s) - T0 )) s"
