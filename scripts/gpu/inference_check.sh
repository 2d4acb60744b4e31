#!/usr/bin/env bash
# Inference predicted against measured on one GPU (docs/inference.md): each row one
# `recipes/your_model.py --infer --mode eager` process (generate() of a causal LM, or one forward pass of an
# encoder or a vision model under inference_mode), which records its peak allocated, peak reserved and
# whole-device peak (NVML) next to the prediction it made on the CPU first; then predicted vs measured as
# inference_check.json and inference_check.md. 13 rows (9 causal LMs, 2 encoders, 2 ViTs), then the two
# answers of `fmr-estimate --infer --fit 24GB` (predicted on the CPU meanwhile) run on a 24 GB card
# emulated with --memory-budget-gb. From the repository root of a fresh GPU machine:
#
#   OUT=/tmp/out bash scripts/gpu/inference_check.sh                  # every row, about 5-6 minutes on one H100
#   ROWS="neox-prefill bert" OUT=/tmp/out bash scripts/gpu/inference_check.sh   # only these rows
#   SMALL=1 ROWS=... OUT=/tmp/x bash scripts/gpu/inference_check.sh   # tiny shapes on a CPU (a dry run)
#
# Results under $OUT: inference_check.json, inference_check.md and one tar of everything (inference.tgz).
# The row running when the call's limit nears (LIMIT, default 560 s) gets SIGINT, and no row starts after
# it, so what finished comes back.
set -u
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 FMR_OFFLINE=1 HF_HUB_OFFLINE=1
T0=$(date +%s); LIMIT=${LIMIT:-560}; RUNS=/tmp/inference-check; rm -rf "$RUNS"; mkdir -p "$RUNS/cfg"
log() { echo "[inference_check $(( $(date +%s) - T0 )) s] $*" | tee -a "$RUNS/log.txt"; }
finish() { kill "$WATCH" 2>/dev/null; pkill -P "$WATCH" 2>/dev/null
           python3 -m fabric_memory_recipes.planning.inference.check "$RUNS/runs" > "$RUNS/check.log" 2>&1
           cp "$RUNS"/runs/inference_check.* "$OUT/" 2>/dev/null
           nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RUNS/gpu.csv" 2>&1
           python3 -c "import torch, transformers, timm; print(torch.__version__, transformers.__version__, timm.__version__)" > "$RUNS/versions.txt" 2>&1
           git log -1 --format='%H %s' > "$RUNS/commit.txt" 2>/dev/null; tar czf "$OUT/inference.tgz" -C /tmp inference-check; }
trap finish EXIT
if [ -z "${SMALL:-}" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || log "pip install -e . failed"
fi
( sleep $(( LIMIT - 25 )); touch "$RUNS/stop"; echo "limit near: SIGINT" >> "$RUNS/log.txt"
  [ -s "$RUNS/pid" ] && kill -INT "$(cat "$RUNS/pid")" ) > /dev/null 2>&1 &
WATCH=$!
# row NAME ARGS...: one recipes/your_model.py process (its PID in $RUNS/pid for the limit), unless stopped
row() { local name=$1; shift
        [ -e "$RUNS/stop" ] && { log "skip $name: the limit is near"; return; }
        log "start $name: $*"
        python3 recipes/your_model.py "$@" --results-dir "$RUNS/runs" --tag "$name" > "$RUNS/$name.log" 2>&1 &
        echo $! > "$RUNS/pid"; wait $!; local rc=$?; : > "$RUNS/pid"; log "end $name: exit $rc"; }
cat > "$RUNS/cfg/gpt2.json" <<'EOF'
{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12, "n_head": 12,
 "n_positions": 1024, "vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256}
EOF
C=examples/configs
# name | model | batch | prompt (or sequence) | new tokens | precision | KV cache dtype
ROWS_ALL="
neox-prefill|hf:$C/gpt-neox-0.4b|64|1024|8|bf16-true|auto
qwen05-prefill|hf:$C/qwen2-0.5b|64|2048|8|bf16-true|auto
tinyllama-prefill|hf:$C/tinyllama-1.1b|64|2040|8|bf16-true|auto
neox-decode|hf:$C/gpt-neox-0.4b|64|128|256|bf16-true|auto
llama036-decode|hf:$C/llama-0.36b|256|64|256|bf16-true|auto
qwen15-decode|hf:$C/qwen2-1.5b|128|128|384|bf16-true|auto
gpt2-decode|hf:$RUNS/cfg/gpt2.json|128|256|192|bf16-true|auto
neox-decode-fp8kv|hf:$C/gpt-neox-0.4b|64|128|256|bf16-true|fp8
tinyllama-fp16|hf:$C/tinyllama-1.1b|128|512|128|16-true|auto
bert|hf:$C/bert-base-uncased|1024|512|0|bf16-true|auto
roberta-fp32|hf:$C/roberta-base|512|512|0|32-true|auto
vit-base|timm:vit_base_patch16_224|2048|0|0|bf16-true|auto
vit-large|timm:vit_large_patch16_224|128|0|0|32-true|auto
"
# The fit answer for one card, predicted only (CPU, beside the GPU runs): the largest batch and the most new
# tokens that fit a 24 GB card (FIT_GB), predicted on the card.
timeout "${FIT_S:-240}" python3 -m fabric_memory_recipes.planning --model "hf:$C/gpt-neox-0.4b" --infer \
    --precision bf16-true --batch-size 32 --seq-len 128 --new-tokens "${FIT_NEW:-256}" --fit "${FIT_GB:-24}GB" --json \
    > "$RUNS/fit-neox.json" 2> "$RUNS/fit.log" &
FIT=$!
want() { [ -z "${ROWS:-}" ] || [[ " $ROWS " == *" $1 "* ]]; }
echo "$ROWS_ALL" | while IFS='|' read -r name model batch seq new precision kv; do
  [ -n "$name" ] && want "$name" || continue
  if [ -n "${SMALL:-}" ]; then batch=2; [ "$seq" -gt 0 ] && seq=32; [ "$new" -gt 0 ] && new=6; fi
  args=(--infer --model "$model" --batch-size "$batch" --precision "$precision" --data synthetic --mode eager)
  [ "$seq" -gt 0 ] && args+=(--seq-len "$seq")
  [ "$new" -gt 0 ] && args+=(--new-tokens "$new" --kv-cache-dtype "$kv")
  [ -n "${SMALL:-}" ] && args+=(--accelerator cpu)
  row "$name" "${args[@]}"
done
wait "$FIT" 2>/dev/null; log "fit: exit $? (fit-neox.json)"
# The fit's two answers run on the card emulated on this GPU (--memory-budget-gb): each must fit.
read -r FB FN < <(python3 -c "import json; a = json.load(open('$RUNS/fit-neox.json'));
print(a['largest_batch'] or 0, a['most_new_tokens'] or 0)" 2>/dev/null || echo "0 0")
FIT_ARGS=(--infer --model "hf:$C/gpt-neox-0.4b" --precision bf16-true --data synthetic --mode eager --seq-len 128)
[ -n "${SMALL:-}" ] && FIT_ARGS+=(--accelerator cpu) || FIT_ARGS+=(--memory-budget-gb "${FIT_GB:-24}")
for pick in "fit-batch|$FB|${FIT_NEW:-256}" "fit-tokens|32|$FN"; do
  IFS='|' read -r name batch new <<< "$pick"
  [ "$batch" -gt 0 ] && [ "$new" -gt 0 ] && want "$name" || { log "skip $name (batch $batch, new $new)"; continue; }
  row "$name" "${FIT_ARGS[@]}" --batch-size "$batch" --new-tokens "$new"
done
