#!/usr/bin/env bash
# Where a vision model's graphed step spends its GPU time, with and without checkpointing: MobileNetV3-Large,
# Swin-V2-T and ResNet-50 as the ranking check's sets ran them (results/published/h200/ranking-check/), an eager
# run of MobileNetV3's to pair kernels with ops, and GPT-2 small's ranking pick. Each run is
# `devtools.speed.rung_profile` (4 steps after step 8); read the traces with `python -m devtools.speed.trace_kernels`.
#   OUT=DIR [LIMIT=480] bash scripts/gpu/vision_graph_profile.sh   ->   $OUT/opprof.tgz, $OUT/log.txt, $OUT/summary.txt
#   LIST=1 bash scripts/gpu/vision_graph_profile.sh                 # each run's tag and recipe flags; runs nothing
set -u
V="--precision bf16-mixed --optimizer adamw --data synthetic --weights none --eval-batches 1 --max-steps 14"
if [ -n "${LIST:-}" ]; then
  prof() { echo "$* $V"; }
else
  . scripts/gpu/common.sh; export_run_env; install_wheels >/dev/null 2>&1; install_checkout
  T0=$(date +%s); D=$OUT/opprof; mkdir -p "$D"; record_machine "$D"
  prof() {
    local tag=$1; shift
    if [ $(( $(date +%s) - T0 )) -gt "${LIMIT:-480}" ]; then echo "skip $tag" >> "$D/log.txt"; return; fi
    echo "[$(( $(date +%s) - T0 )) s] $tag: $*" >> "$D/log.txt"
    # shellcheck disable=SC2086
    timeout 150 python3 -m devtools.speed.rung_profile --out "$D" --tag "$tag" --start 8 --steps 4 -- \
      recipes/your_model.py "$@" $V --results-dir "$D/runs/$tag" > "$D/$tag.log" 2>&1
    echo "[$(( $(date +%s) - T0 )) s] $tag rc=$?" >> "$D/log.txt"
  }
fi
M=torchvision:mobilenet_v3_large
prof mnv3-ckpt --model $M --batch-size 128 --checkpoint-blocks --mode fast --memory-budget-gb 3
prof mnv3-plain --model $M --batch-size 128 --mode fast
prof mnv3-ckpt-eager --model $M --batch-size 128 --checkpoint-blocks --mode eager
prof swin-ckpt --model torchvision:swin_v2_t --batch-size 64 --checkpoint-blocks --mode fast --memory-budget-gb 4
prof swin-plain --model torchvision:swin_v2_t --batch-size 64 --mode fast
prof r50-ckpt --model torchvision:resnet50 --batch-size 128 --accumulation-steps 2 --checkpoint-blocks --mode fast \
  --memory-budget-gb 4
prof r50-plain --model torchvision:resnet50 --batch-size 128 --accumulation-steps 2 --mode fast
prof gpt2-pick --model hf:examples/configs/gpt2-small --seq-len 1024 --batch-size 8 --checkpoint-blocks \
  --checkpoint-mode selective --fused-loss --mode fast --memory-budget-gb 6
prof mnv3-acc2 --model $M --batch-size 128 --accumulation-steps 2 --mode fast --memory-budget-gb 3
[ -n "${LIST:-}" ] || { cd "$OUT" && tar czf opprof.tgz opprof && cp opprof/log.txt . && grep -hE "^## |busy" opprof/*.md > summary.txt; }
