#!/usr/bin/env bash
# The sharded rungs' GPU runs on one machine with 4 GPUs (H100 or H200), from the repository root, the project installed
# (python3 -m pip install --no-deps --no-build-isolation -e .), the article's checkout at $REF:
#
#   OUT=/some/folder bash scripts/gpu/sharded_four_gpus.sh            # PARTS="gpu4 gpu2 yourmodel nodes" by default
#   OUT=... PARTS="yourmodel nodes" bash scripts/gpu/sharded_four_gpus.sh   # a second call for what the first missed
#
# Parts, in this order, each kept as soon as it ends (and every 20 s meanwhile) in $OUT/sharded.tgz (the
# only files in $OUT are that tar and progress.log; the runs' folders are packed from a scratch folder):
#   gpu4       fmr-compare --devices 4: the article's 11_delay-allocation.py with cpu_offload off (rung 08's
#              row) and as written (rung 09's row), 08_fsdp, 08_fsdp2, 09 in fast mode; every rung run
#              records its whole-device peak per rank: what 4 processes hold outside the allocator
#   gpu2       the same on CUDA_VISIBLE_DEVICES=0,1 with --devices 2
#   yourmodel  recipes/your_model.py --fsdp on a 1.5 B causal LM (examples/configs/qwen2-1.5b), 4 then 2 GPUs
#   nodes      08_fsdp2 eager: one torchrun node of 4 vs two torchrun "nodes" of 2 on this host, same
#              steps, then their loss curves compared (nodes/equivalence.json)
# Then: python3 scripts/gpu/publish_sharded_runs.py $OUT/sharded.tgz (on any machine) publishes it.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env  # no NVLink multicast
OUT=${OUT:?set OUT to the folder whose files come back}
REF=${REF:-.ref/pytorch-memory-optim}
STEPS=${STEPS:-20}
PARTS=${PARTS-gpu4 gpu2 yourmodel nodes}
DEADLINE=${DEADLINE:-530}   # seconds: no part starts after it, a compare gets only the time left
PY=${PYTHON:-python3}
start_clock sharded  # SCRATCH, WORK=$SCRATCH/sharded, T0; elapsed, left, say
pack() { tar -czf "$SCRATCH/sharded.tgz" -C "$SCRATCH" sharded 2>/dev/null; cp -f "$SCRATCH/sharded.tgz" "$OUT/.sharded.tgz" && mv -f "$OUT/.sharded.tgz" "$OUT/sharded.tgz"; }
wants() { case " $PARTS " in *" $1 "*) [ "$(left)" -gt 30 ] || { say "$1: not started (deadline)"; return 1; } ;; *) return 1 ;; esac; }

( while sleep 20; do pack; done ) & PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT

say "start: parts '$PARTS', $STEPS steps, deadline $DEADLINE s, reference $REF"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$WORK/gpus.csv" 2>&1
$PY -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" > "$WORK/env.txt" 2>&1
git rev-parse HEAD >> "$WORK/env.txt" 2>/dev/null
say "GPUs: $(tail -n +2 "$WORK/gpus.csv" | cut -d, -f2 | sort | uniq -c | tr -s ' ' | tr '\n' ';')"

compare() {  # compare DEVICES: the article's FSDP script against rungs 08, 08-fsdp2 and 09
  local n=$1 budget
  budget=$(( $(left) - 10 ))
  say "compare on $n GPUs (budget $budget s)"
  $PY -m fabric_memory_recipes.tools.compare.reference --reference "$REF" --rungs 08,08-fsdp2,09 \
    --modes fast --devices "$n" --steps "$STEPS" --project-args "--eval-batches 1" --timeout 170 \
    --budget "$budget" --out "$WORK/x$n/compare" 2>&1 | tee -a "$WORK/x$n-compare.log" | sed "s/^/    /"
  say "compare on $n GPUs: done"
  pack
}
wants gpu4 && compare 4
wants gpu2 && CUDA_VISIBLE_DEVICES=0,1 compare 2

your_model() {  # your_model DEVICES
  local n=$1
  say "your model --fsdp on $n GPUs"
  timeout "$(( $(left) > 20 ? $(left) : 20 ))" $PY recipes/your_model.py --model hf:examples/configs/qwen2-1.5b \
    --fsdp --devices "$n" --precision bf16-mixed --batch-size 8 --seq-len 512 --checkpoint-blocks \
    --data synthetic --max-steps "$STEPS" --eval-batches 1 --results-dir "$WORK/x$n/your-model" \
    > "$WORK/x$n-your-model.log" 2>&1
  say "your model on $n GPUs: exit $? ($(grep -m1 -E '^== ' "$WORK/x$n-your-model.log"))"
  pack
}
if wants yourmodel; then
  your_model 4
  [ "$(left)" -gt 60 ] && CUDA_VISIBLE_DEVICES=0,1 your_model 2
fi

if wants nodes; then
  args=(--data synthetic --weights none --max-steps "$STEPS" --eval-batches 1 --mode eager)
  say "nodes: one torchrun node of 4"
  $PY -m torch.distributed.run --nproc-per-node 4 recipes/08_fsdp2.py --devices 4 "${args[@]}" \
    --results-dir "$WORK/nodes/one-node" > "$WORK/nodes-one.log" 2>&1
  say "nodes: one node exit $?; two torchrun nodes of 2 on this host"
  pids=()
  for rank in 0 1; do  # docs/08_fsdp.md's two-machine command, both "machines" on this host
    CUDA_VISIBLE_DEVICES=$(( 2 * rank )),$(( 2 * rank + 1 )) $PY -m torch.distributed.run --nnodes 2 \
      --node-rank $rank --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29538 \
      recipes/08_fsdp2.py --devices 2 --num-nodes 2 "${args[@]}" \
      --results-dir "$WORK/nodes/two-nodes" > "$WORK/nodes-two-rank$rank.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  say "nodes: two nodes done (exit $?)"
  bash -n docs/slurm_requeue.sbatch && say "docs/slurm_requeue.sbatch: shell syntax ok"
  $PY scripts/gpu/publish_sharded_runs.py --equivalence "$WORK/nodes" 2>&1 | tee -a "$WORK/progress.log"
  pack
fi
for n in 4 2; do [ -f "$WORK/x$n/compare/comparison.md" ] && { echo "== $n GPUs"; head -n 8 "$WORK/x$n/compare/comparison.md"; }; done
say "end"
