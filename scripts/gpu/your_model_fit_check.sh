#!/usr/bin/env bash
# Does the CPU ranking's first pick run fastest? fmr-estimate --model ... --fit SIZE --measure on one GPU: the
# top sets predicted on the CPU, each run a few steps on the card emulated (--memory-budget-gb), ranked by what
# they did (planning/your_model/measure.py). One device command per part, under 10 minutes; carried: .whl
# (liger-kernel). Results: $OUT/fit-<part>.tgz (each model's plan.json / plan.md and console output).
#
#   bash scripts/gpu/your_model_fit_check.sh lm       # GPT-NeoX 0.4 B at 10 GB, Llama 0.36 B at 8 GB (8 x 1024)
#   bash scripts/gpu/your_model_fit_check.sh vision   # ResNet-50 at 4 GB, ViT-B/16 (timm) at 6 GB, ConvNeXt-T at 4 GB
set -u
part=${1:?lm or vision}
: "${OUT:?set OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 FMR_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R=/tmp/fit-$part; mkdir -p $R
trap 'nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.csv; git log -1 --format="%H %s" > $R/commit.txt; tar czf "$OUT/fit-$part.tgz" -C /tmp fit-$part' EXIT
fit() { local name=$1; shift
        python3 -m fabric_memory_recipes.planning "$@" --top ${TOP:-3} --measure --measure-steps ${STEPS:-12} \
            --measure-dir $R/$name > $R/$name.log 2>&1; echo "$name: exit $?" | tee -a $R/log.txt; }
case $part in
  lm)
    fit neox-10gb --model hf:examples/configs/gpt-neox-0.4b --seq-len 1024 --batch-size 8 --precision bf16-mixed --fit 10GB
    fit llama-8gb --model hf:examples/configs/llama-0.36b --seq-len 1024 --batch-size 8 --precision bf16-mixed --fit 8GB ;;
  vision)
    fit resnet50-4gb --model torchvision:resnet50 --batch-size 128 --precision bf16-mixed --fit 4GB
    fit vitb-6gb --model timm:vit_base_patch16_224 --batch-size 64 --precision bf16-mixed --fit 6GB
    fit convnext-4gb --model timm:convnext_tiny --batch-size 128 --precision bf16-mixed --fit 4GB ;;
esac
