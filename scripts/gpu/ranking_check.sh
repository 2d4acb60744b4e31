#!/usr/bin/env bash
# Does the CPU ranking's first pick run fastest, at the speed predicted, within its card? For 4 causal LMs
# (`lm`) or 4 vision models (`vision`): `fmr-estimate --model ... --fit SIZE --top 3` (the CPU ranking, the
# models' plans side by side on the host's cores), then each plan's 3 sets run as `--measure` runs them
# (planning/your_model/measure.py: one recipes/your_model.py process each, on the card emulated), and per
# model the predicted vs measured samples/s, fit / out of memory, and the first pick over the fastest
# measured (devtools/your_model/ranking_check.py, which lists the models and cards). One device command per
# part, each under 8 minutes on one H100, from the repository root; carried (ignored path): .whl (liger-kernel).
#
#   bash scripts/gpu/ranking_check.sh lm       # GPT-2 small 6 GB, Qwen2 0.2 B 8 GB, Llama 0.36 B 9 GB,
#                                              # GPT-NeoX 0.4 B 10 GB; 8 x 1024 tokens each
#   bash scripts/gpu/ranking_check.sh vision   # MobileNetV3-Large 3 GB, ResNet-50 4 GB (batch 128),
#                                              # Swin-V2-T 4 GB, ViT-B/16 (timm) 6 GB (batch 64)
#   bash scripts/gpu/ranking_check.sh peft     # LoRA rank 8: Qwen2 0.5 B 6 GB, Llama 0.36 B 4 GB (8 x 1024)
#   bash scripts/gpu/ranking_check.sh seq2seq  # T5-base 6 GB, BART-base 5 GB (16 x 256 source + 256 target),
#                                              # T5-small 4 GB (64 x 256 source + 64 target)
#   bash scripts/gpu/ranking_check.sh held-out # models no step-time fit has seen: EfficientNet-B0 4 GB,
#                                              # RegNetY-1.6GF 4 GB (batch 128), ConvNeXt-T 3 GB, DenseNet-121
#                                              # 3 GB (batch 64), TinyLlama 1.1 B 20 GB (8 x 1024)
#   bash scripts/gpu/ranking_check.sh unseen   # six more families no fit had seen: ResNeXt-50 5 GB, EfficientNetV2-S
#                                              # 6 GB, ShuffleNetV2 2.5 GB; OPT-350m 10 GB, BLOOM-560m 14 GB,
#                                              # Phi-1.5 32 GB (8 x 1024)
#   bash scripts/gpu/ranking_check.sh unfitted # neither in any fit: GPT-NeoX 1.4 B 32 GB (8 x 1024), RoBERTa-base
#                                              # 4 GB (32 x 512)
#
# bf16-mixed AdamW (the user's, kept). STEPS (10) optimizer steps per set; MEASURE_TOP=K measures each plan's
# first K sets only (the picks, when K is 1); ONLY=a,b (model names) reruns
# some; GPU=h200 plans for that kind's ceilings (default h100);
# PLANS=DIR (carried) reuses the plans a `--plan-only` run made there for the same command lines; no
# model starts measuring after DEADLINE (330 s) and the whole call stops at LIMIT (450 s). Time: the
# plans take minutes of CPU each (the slowest model's sets the first wait), each measured set 20-50 s (process
# start, the runner's own estimate, fast mode's compilation): a model not measured before DEADLINE is listed
# as such, and `ONLY=<those> bash scripts/gpu/ranking_check.sh <part>` measures it in another call.
# Results, rewritten after each model: $OUT/ranking-<part>.tgz (each model's fit.json, plan.json, plan.md,
# runs and logs), $OUT/summary-<part>.md (the table) and $OUT/summary-<part>.json.
set -u
part=${1:?lm, vision, held-out, unseen, unfitted, peft or seq2seq}
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
# a fresh folder: on a machine still warm from an earlier call, its runs would join this call's archive
R=/tmp/ranking-$part; rm -rf "$R"; mkdir -p "$R"
finish() { record_machine "$R"
           { echo "Made by \`bash scripts/gpu/ranking_check.sh $part\` (STEPS=${STEPS:-10}) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1),"
             echo "commit $(git log -1 --format=%h 2>/dev/null), $(date -u +%F): each model's sets from \`fmr-estimate ... --fit SIZE --top 3\`,"
             echo "measured one at a time on the card emulated (\`--memory-budget-gb SIZE\`), bf16-mixed AdamW."; echo
             python3 -m devtools.your_model.ranking_check --report "$R"; } > "$OUT/summary-$part.md" 2>&1
           cp "$R/summary.json" "$OUT/summary-$part.json" 2>/dev/null
           tar czf "$OUT/ranking-$part.tgz" -C /tmp "ranking-$part"; }
trap finish EXIT
install_wheels .whl/liger*.whl
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -k 20 -s INT "${LIMIT:-450}" python3 -m devtools.your_model.ranking_check "$part" --out "$R" --top 3 \
    --steps "${STEPS:-10}" ${MEASURE_TOP:+--measure-top "$MEASURE_TOP"} --deadline "${DEADLINE:-330}" --only "${ONLY:-}" --gpu "${GPU:-h100}" ${PLANS:+--plans "$PLANS"} --archive "$OUT/ranking-$part.tgz" \
    2>&1 | tee "$R/log.txt"
echo "ranking_check $part: exit ${PIPESTATUS[0]}"
