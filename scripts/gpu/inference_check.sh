#!/usr/bin/env bash
# Inference predicted against measured on one GPU (docs/inference.md). Each row is one
# `recipes/your_model.py --infer` run (generate() of a causal LM, or one forward pass of an encoder or a vision
# model under inference_mode), which records its peak allocated, peak reserved and whole-device peak (NVML)
# next to the prediction it made on the CPU first. Rows run one at a time, each in its own process forked from
# one that imported torch, Lightning, transformers, timm and torchao once (devtools/your_model/forked_runs.py): a fresh
# CUDA context per row without a fresh import. 16 rows (11 causal LMs, prefill- and decode-dominated, an fp8 KV
# cache, fp16, and int8 weights; 3 encoders, one with int8 weights; 2 ViTs), then the two answers of
# `fmr-estimate --infer --fit 24GB` (predicted on the CPU meanwhile), each run on a 24 GB card emulated with
# --memory-budget-gb. From the repository root of a fresh GPU machine, with the torchao wheel in .whl/:
#
#   OUT=$OUT bash scripts/gpu/inference_check.sh                 # every row, expected 6-7 minutes on one H100
#   ROWS="bert vit-base" OUT=$OUT bash scripts/gpu/inference_check.sh   # only these rows (a second call:
#                                                                      # the rows the first did not reach)
#   SMALL=1 ROWS=... OUT=/tmp/x bash scripts/gpu/inference_check.sh    # tiny shapes on a CPU (a dry run)
#
# Under $OUT, rewritten after every row (what finished comes back even if the call is cut): inference_check.json
# and inference_check.md (predicted against measured), progress.log, and inference.tgz (every run's results
# JSON and log, the fit's answer). Near the call's limit (LIMIT, default 540 s) the running row gets SIGINT
# and no row starts after it (a second SIGINT 12 s later ends a row still running: its results are lost).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export PYTHONUNBUFFERED=1 FMR_OFFLINE=1 HF_HUB_OFFLINE=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
T0=$(date +%s); LIMIT=${LIMIT:-540}; RUNS=/tmp/inference-check; rm -rf "$RUNS"; mkdir -p "$RUNS/cfg" "$RUNS/runs" "$OUT"
log() { echo "[inference_check $(( $(date +%s) - T0 )) s] $*" | tee -a "$RUNS/log.txt"; cp "$RUNS/log.txt" "$OUT/progress.log"; }
summarise() { python3 -m fabric_memory_recipes.planning.inference.check "$RUNS/runs" > "$RUNS/check.log" 2>&1
              cp "$RUNS"/runs/inference_check.* "$OUT/" 2>/dev/null
              tar czf "$OUT/inference.tgz.part" -C /tmp inference-check 2>/dev/null && mv "$OUT/inference.tgz.part" "$OUT/inference.tgz"; }
finish() { kill "$WATCH" 2>/dev/null
           record_machine "$RUNS"
           python3 -c "import torch, transformers, timm; print(torch.__version__, transformers.__version__, timm.__version__)" > "$RUNS/versions.txt" 2>&1
           summarise; log "done"; }
trap finish EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${SMALL:-}" ] && ls .whl/torchao-*.whl > /dev/null 2>&1; then  # the GPU image lacks torchao
  install_wheels .whl/torchao-*.whl || log "torchao wheel: install failed (the int8 rows will say so)"
fi
( sleep $(( LIMIT - 30 )); touch "$RUNS/stop"; echo "limit near: SIGINT" >> "$RUNS/log.txt"
  [ -s "$RUNS/pid" ] && kill -INT "$(cat "$RUNS/pid")"; sleep 12  # generate() has no step to stop at: a
  [ -s "$RUNS/pid" ] && kill -INT "$(cat "$RUNS/pid")" ) > /dev/null 2>&1 &  # second SIGINT ends the row
WATCH=$!
cat > "$RUNS/cfg/gpt2.json" <<'EOF'
{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12, "n_head": 12,
 "n_positions": 1024, "vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256}
EOF
C=examples/configs
# name | model | batch | prompt (or sequence) | new tokens | precision | KV cache dtype | weights
# In the order they run: one of each kind first (a shortened call still covers them), the two --fit picks where
# the line "fit" stands (once the fit has answered), the slowest last.
ROWS_ALL="
neox-prefill|hf:$C/gpt-neox-0.4b|64|1024|8|bf16-true|auto|none
bert|hf:$C/bert-base-uncased|1024|512|0|bf16-true|auto|none
vit-base|timm:vit_base_patch16_224|2048|0|0|bf16-true|auto|none
qwen05-int8-prefill|hf:$C/qwen2-0.5b|128|1024|8|bf16-true|auto|int8
llama036-decode|hf:$C/llama-0.36b|512|64|128|bf16-true|auto|none
qwen05-prefill|hf:$C/qwen2-0.5b|64|2048|8|bf16-true|auto|none
roberta-fp32|hf:$C/roberta-base|512|512|0|32-true|auto|none
vit-large|timm:vit_large_patch16_224|512|0|0|32-true|auto|none
bert-int8|hf:$C/bert-base-uncased|512|512|0|bf16-true|auto|int8
tinyllama-prefill|hf:$C/tinyllama-1.1b|64|2040|8|bf16-true|auto|none
fit
gpt2-decode|hf:$RUNS/cfg/gpt2.json|128|256|192|bf16-true|auto|none
tinyllama-int8|hf:$C/tinyllama-1.1b|512|128|64|bf16-true|auto|int8
neox-decode|hf:$C/gpt-neox-0.4b|128|128|160|bf16-true|auto|none
qwen15-decode|hf:$C/qwen2-1.5b|512|32|128|bf16-true|auto|none
tinyllama-fp16|hf:$C/tinyllama-1.1b|128|512|96|16-true|auto|none
neox-decode-fp8kv|hf:$C/gpt-neox-0.4b|128|128|160|bf16-true|fp8|none
"
want() { [ -z "${ROWS:-}" ] || [[ " $ROWS " == *" $1 "* ]]; }
# The fit's question, answered on the CPU beside the GPU rows: on a 24 GB card (FIT_GB), the largest batch at
# 128 + 64 new tokens, and the most new tokens at batch 512 (FIT_BATCH), each predicted on the card.
FIT_GB=${FIT_GB:-24}; FIT_BATCH=${FIT_BATCH:-512}; FIT_NEW=${FIT_NEW:-64}
FIT_MODEL=(--model "hf:$C/gpt-neox-0.4b" --precision bf16-true --seq-len 128)
if want fit-batch || want fit-tokens; then
  ( timeout "${FIT_S:-300}" python3 -m fabric_memory_recipes.planning --infer "${FIT_MODEL[@]}" --batch-size "$FIT_BATCH" \
      --new-tokens "$FIT_NEW" --fit "${FIT_GB}GB" --json > "$RUNS/fit-neox.json" 2> "$RUNS/fit.log"
    echo $? > "$RUNS/fit.done" ) &
fi
# rows: the lines devtools/your_model/forked_runs.py reads (NAME ARGS...); at "fit", the fit's two picks
fit_rows() {
  want fit-batch || want fit-tokens || return 0
  while [ ! -e "$RUNS/fit.done" ] && [ ! -e "$RUNS/stop" ]; do sleep 2; done
  read -r FB FN < <(python3 -c "import json; a = json.load(open('$RUNS/fit-neox.json'));
print(a['largest_batch'] or 0, a['most_new_tokens'] or 0)" 2>/dev/null || echo "0 0")
  echo "# fit: largest batch $FB at 128 + $FIT_NEW, most new tokens $FN at batch $FIT_BATCH" >> "$RUNS/log.txt"
  FIT_ARGS=(--infer "${FIT_MODEL[@]}" --data synthetic --mode eager)
  [ -n "${SMALL:-}" ] && FIT_ARGS+=(--accelerator cpu) || FIT_ARGS+=(--memory-budget-gb "$FIT_GB")
  for pick in "fit-batch|$FB|$FIT_NEW" "fit-tokens|$FIT_BATCH|$FN"; do
    IFS='|' read -r name batch new <<< "$pick"
    [ -n "${SMALL:-}" ] && [ "$batch" -gt 2 ] && batch=2; [ -n "${SMALL:-}" ] && [ "$new" -gt 6 ] && new=6
    [ "$batch" -gt 0 ] && [ "$new" -gt 0 ] && want "$name" || continue
    echo "$name ${FIT_ARGS[*]} --batch-size $batch --new-tokens $new --results-dir $RUNS/runs --tag $name"
  done
}
rows() {
  echo "$ROWS_ALL" | while IFS='|' read -r name model batch seq new precision kv quant; do
    [ "$name" = fit ] && { fit_rows; continue; }
    [ -n "$name" ] && want "$name" || continue
    if [ -n "${SMALL:-}" ]; then batch=2; [ "$seq" -gt 0 ] && seq=32; [ "$new" -gt 0 ] && new=6; fi
    args=(--infer --model "$model" --batch-size "$batch" --precision "$precision" --data synthetic --mode eager)
    [ "$seq" -gt 0 ] && args+=(--seq-len "$seq")
    [ "$new" -gt 0 ] && args+=(--new-tokens "$new" --kv-cache-dtype "$kv")
    [ "$quant" != none ] && args+=(--weights-quant "$quant")
    [ -n "${SMALL:-}" ] && args+=(--accelerator cpu)
    echo "$name ${args[*]} --results-dir $RUNS/runs --tag $name"
  done
}
PRELOAD=(transformers transformers.models.gpt_neox.modeling_gpt_neox transformers.models.llama.modeling_llama
         transformers.models.qwen2.modeling_qwen2 transformers.models.gpt2.modeling_gpt2
         transformers.models.bert.modeling_bert transformers.models.roberta.modeling_roberta timm torchao.quantization)
log "start: ${ROWS:-every row}${SMALL:+ (SMALL: tiny shapes on the CPU)}"
EXPECT=(--expect-cuda); [ -n "${SMALL:-}" ] && EXPECT=()  # a GPU row's forked child must find the GPU
rows | python3 -m devtools.your_model.forked_runs recipes/your_model.py --logs "$RUNS" --pid-file "$RUNS/pid" \
  --stop-file "$RUNS/stop" ${EXPECT[@]+"${EXPECT[@]}"} --preload "${PRELOAD[@]}" 2> "$RUNS/driver.err" |
while read -r what name rest; do
  log "$what $name $rest"
  [ "$what" = end ] && summarise
done
[ -e "$RUNS/fit.done" ] && log "fit: exit $(cat "$RUNS/fit.done") (fit-neox.json)"
