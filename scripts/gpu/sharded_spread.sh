#!/usr/bin/env bash
# The sharded rungs' speed with its spread, and your model sharded: one call on a machine with 4 GPUs
# (nvidia-h100-x4; an H200 machine if that is what comes: the summary names the GPUs), from the repository
# root (this checkout's package on PYTHONPATH; .whl's wheels installed when carried), the article's
# checkout at $REF. About 9-10 minutes:
#
#   OUT=/some/folder bash scripts/gpu/sharded_spread.sh     # PARTS="compare models repeats models4" by default
#
# Parts, in this order, each packed as soon as it ends (and every 20 s meanwhile) into $OUT/spread.tgz
# (the only other files in $OUT: progress.log and, at the end, summary.md):
#   compare   scripts/gpu/sharded_four_gpus.sh's gpu4 part: fmr-compare --devices 4, the article's
#             11_delay-allocation.py without and with its cpu_offload, and the first repeat of 08_fsdp,
#             08_fsdp2 and 09 in fast mode (about 220 s)
#   models    your model sharded, bf16-mixed, checkpointed blocks, 8 x 1024 tokens, $YM_STEPS steps, all at
#             once: three causal LMs >= 1 B (GPT-NeoX 1.4 B, Qwen2 1.5 B, TinyLlama 1.1 B) on 2 GPUs in eager
#             mode (FSDP), GPT-NeoX with --cpu-offload, and GPT-NeoX in fast mode (FSDP2, compiled blocks;
#             batch 4). Memory is per process (allocated, reserved, NVML's entry of the process), so runs
#             that share a GPU measure what each alone would (about 53 and 46 GB predicted on GPUs 0,1 and
#             2,3); their speed is not kept
#   repeats   08_fsdp, 08_fsdp2, 09 again, twice (09 first in each round): the same flags as the compare's
#             runs; each results JSON has every step's interval (timing.intervals_s) for rung 09's p90/p10
#   models4   if time is left: the three LMs on 4 GPUs, eager (GPT-NeoX's is the issue's configuration)
#   fit       not by default (PARTS="fit" alone, about 5 minutes): fmr-estimate --fit 16GB --devices 2
#             --measure for GPT-NeoX 1.4 B, its 3 fastest sets run on GPUs 0,1, each process capped at 16 GB
# Then scripts/gpu/sharded_spread_summary.py writes summary.md/json into the tar and $OUT: the median and
# range of each rung's img/s over the repeats against the article's, and your model predicted against
# measured. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the rest, /work/.library/device/KINDS.md).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export PYTHONUNBUFFERED=1 FMR_OFFLINE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's package, installed or not
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then  # liger-kernel for a --fused-loss set (part fit), if carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OUT=${OUT:?set OUT to the folder whose files come back}
REF=${REF:-.ref/pytorch-memory-optim}
[ -d "$REF" ] || { [ -d shared/reference/pytorch-memory-optim ] && REF=shared/reference/pytorch-memory-optim; }
STEPS=${STEPS:-20}
YM_STEPS=${YM_STEPS:-5}
PARTS=${PARTS-compare models repeats models4}
DEADLINE=${DEADLINE:-575}   # seconds: no run starts after it; a run is given at most the time left
PY=${PYTHON:-python3}
SCRATCH=$(mktemp -d)
WORK=$SCRATCH/spread
mkdir -p "$WORK" "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
say() { echo "[$(elapsed) s] $*" | tee -a "$WORK/progress.log" "$OUT/progress.log"; }
pack() { tar -czf "$SCRATCH/spread.tgz" -C "$SCRATCH" spread 2>/dev/null; cp -f "$SCRATCH/spread.tgz" "$OUT/.spread.tgz" && mv -f "$OUT/.spread.tgz" "$OUT/spread.tgz"; }
wants() { case " $PARTS " in *" $1 "*) [ "$(left)" -gt "${2:-40}" ] || { say "$1: not started (deadline)"; return 1; } ;; *) return 1 ;; esac; }
summary() { $PY scripts/gpu/sharded_spread_summary.py "$WORK" > "$WORK/summary.log" 2>&1; cp -f "$WORK/summary.md" "$OUT/" 2>/dev/null; }

( while sleep 20; do pack; done ) & PACKER=$!
trap 'kill $PACKER 2>/dev/null; summary; pack' EXIT

say "start: parts '$PARTS', $STEPS steps, deadline $DEADLINE s, reference $REF, NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$WORK/gpus.csv" 2>&1
nvidia-smi topo -m > "$WORK/topo.txt" 2>&1
{ nproc; lscpu | grep -Ei 'numa|model name|socket'; } > "$WORK/host.txt" 2>&1
$PY -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" > "$WORK/env.txt" 2>&1
git rev-parse HEAD >> "$WORK/env.txt" 2>/dev/null
say "GPUs: $(tail -n +2 "$WORK/gpus.csv" | cut -d, -f2 | sort | uniq -c | tr -s ' ' | tr '\n' ';') host: $(head -1 "$WORK/host.txt") cores"

if wants compare 120; then  # the article's script and the first repeat, through the existing 4-GPU script
  say "compare: scripts/gpu/sharded_four_gpus.sh PARTS=gpu4"
  OUT=$WORK/compare PARTS=gpu4 STEPS=$STEPS REF=$REF DEADLINE=$(( $(left) > 270 ? 270 : $(left) )) \
    bash scripts/gpu/sharded_four_gpus.sh > "$WORK/compare.log" 2>&1
  tar -xzf "$WORK/compare/sharded.tgz" -C "$WORK/compare" 2>/dev/null && rm -f "$WORK/compare/sharded.tgz"
  say "compare: done ($(grep -c ': ok,' "$WORK/compare.log") runs ok)"; summary; pack
fi

your_model() {  # your_model NAME CONFIG GPUS PORT [flags]: one sharded run of a causal LM, in the background
  local name=$1 config=$2 gpus=$3 port=$4 n
  shift 4
  n=$(( $(tr -cd , <<< "$gpus" | wc -c) + 1 ))
  CUDA_VISIBLE_DEVICES=$gpus MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout "$(( $(left) > 30 ? $(left) : 30 ))" \
    $PY recipes/your_model.py --model "hf:examples/configs/$config" --fsdp --devices "$n" --precision bf16-mixed \
    --batch-size 8 --seq-len 1024 --checkpoint-blocks --data synthetic --mode eager --max-steps "$YM_STEPS" \
    --eval-batches 1 --results-dir "$WORK/your-model/$name" "$@" > "$WORK/your-model-$name.log" 2>&1 &
}
models_done() {  # wait for the runs started, then one line each
  wait "$@"
  for log in "$WORK"/your-model-*.log; do
    [ -f "$log.said" ] || { say "  $(basename "$log" .log): $(grep -m1 -E '^== ' "$log" || tail -n 1 "$log" | cut -c1-160)"; touch "$log.said"; }
  done
  summary; pack
}

if wants models 60; then
  say "models: 3 causal LMs on 2 GPUs, at once (GPUs 0,1: NeoX 1.4 B eager and fast, TinyLlama 1.1 B; 2,3: Qwen2 1.5 B, NeoX with CPU offload)"
  pids=()
  your_model neox-1.4b-x2 gpt-neox-1.4b 0,1 29611; pids+=($!)
  your_model tinyllama-1.1b-x2 tinyllama-1.1b 0,1 29612; pids+=($!)
  your_model neox-1.4b-x2-fast-b4 gpt-neox-1.4b 0,1 29613 --mode fast --batch-size 4; pids+=($!)
  your_model qwen2-1.5b-x2 qwen2-1.5b 2,3 29614; pids+=($!)
  your_model neox-1.4b-x2-cpu-offload gpt-neox-1.4b 2,3 29615 --cpu-offload; pids+=($!)
  models_done "${pids[@]}"
fi

rung() {  # rung RECIPE ROUND: one 4-GPU run with the compare's flags
  [ "$(left)" -gt 45 ] || { say "  $1 r$2: not started (deadline)"; return; }
  timeout "$(( $(left) < 150 ? $(left) : 150 ))" $PY "recipes/$1.py" --data synthetic --weights none \
    --max-steps "$STEPS" --eval-batches 1 --devices 4 --mode fast --tag "r$2" \
    --results-dir "$WORK/repeats/r$2" > "$WORK/repeats-$1-r$2.log" 2>&1
  say "  $1 r$2: exit $? $(grep -m1 -E '^   speed' "$WORK/repeats-$1-r$2.log" | tr -s ' ')"
}
if wants repeats 45; then
  for round in 2 3; do
    say "repeats: round $round"
    for r in 09_cpu_offload 08_fsdp2 08_fsdp; do rung "$r" "$round"; done
    summary; pack
  done
fi

if wants models4 70; then
  say "models4: the three LMs on 4 GPUs, at once (about 58 GB predicted per GPU)"
  pids=()
  your_model neox-1.4b-x4 gpt-neox-1.4b 0,1,2,3 29616; pids+=($!)
  your_model qwen2-1.5b-x4 qwen2-1.5b 0,1,2,3 29617; pids+=($!)
  your_model tinyllama-1.1b-x4 tinyllama-1.1b 0,1,2,3 29618; pids+=($!)
  models_done "${pids[@]}"
fi
if wants fit 90; then  # --memory-budget-gb per process: the sharded sets measured on emulated 16 GB cards
  say "fit: fmr-estimate --fit 16GB --devices 2 --measure on GPUs 0,1"
  CUDA_VISIBLE_DEVICES=0,1 timeout "$(left)" $PY -m fabric_memory_recipes.planning --model hf:examples/configs/gpt-neox-1.4b \
    --seq-len 1024 --batch-size 8 --precision bf16-mixed --fit 16GB --devices 2 --top 3 --measure --measure-steps 5 \
    --measure-dir "$WORK/fit" > "$WORK/fit.log" 2>&1
  say "fit: exit $? ($(grep -m1 -E '^Fastest measured|^None of' "$WORK/fit.log"))"; pack
fi
summary
cat "$WORK/summary.md" 2>/dev/null || tail -n 5 "$WORK/summary.log"
say "end"
