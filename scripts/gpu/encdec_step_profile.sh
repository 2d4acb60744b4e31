#!/usr/bin/env bash
# Where an encoder-decoder's training step goes in fast mode (compiled blocks, eager step, no CUDA graph), on one
# GPU, from the repository root: the three --fit picks that ran 1.6-2.6x slower than predicted on an H200
# (results/published/h200/ranking-check/summary-seq2seq.md), each alone on the GPU, uncapped:
#
#   OUT=... bash scripts/gpu/encdec_step_profile.sh        # about 7 minutes on one H100; carry .whl (liger-kernel)
#   DRY=1 OUT=/tmp/out bash scripts/gpu/encdec_step_profile.sh   # the same on a CPU: tiny configs, eager, 2 rows
#   LIST=1 OUT=/tmp/out bash scripts/gpu/encdec_step_profile.sh  # (with SWEEP=...) print each row, run nothing
#   SWEEP=host OUT=... bash scripts/gpu/encdec_step_profile.sh  # T5-small fast at batch 16, 32, 128 (with the
#                  committed batch-64 row: host cost per sample against per compiled call) and BART-base's
#                  selective-checkpointing set (its per-op policy cost); about 8 minutes, LIMIT=560
#   SWEEP=lm OUT=... bash scripts/gpu/encdec_step_profile.sh    # Llama 0.36 B (micro-batch 8 and 2) and GPT-NeoX
#                  0.4 B fast with the fused loss, and T5-small fast at 16: the LMs' host cost per launch and per
#                  compiled call beside the encoder-decoder's; about 8 minutes, LIMIT=540, carry .whl
#
# Per row, two processes one after the other: the run timed as --measure times it (14 steps, the first 3
# intervals left out of the median), then the same run with torch.profiler on for steps 9-12
# (devtools/speed/rung_profile.py: GPU ms per step by kind of kernel and by phase, the GPU's idle time, kernel
# launches per step, and the host's time in calls that wait for the GPU: synchronisations and device-to-host
# copies). Rows: T5-small 64 x 256 -> 64 checkpointed, T5-base 16 x 256 -> 256 checkpointed with the fused
# loss, BART-base 16 = 4 x 4 x 256 -> 256, and T5-small's eager step for comparison. What the profile answers:
# GPU busy ms against the model's predicted GPU sum (the step is GPU-bound if busy is most of the span), and
# where the host's time goes if not (launches, waits, compiled-graph calls).
# Results under $OUT: summary.md (each row's median step and samples/s, and its profile table), log.txt,
# encdec_profile.tgz (results JSONs, logs, profiles, Chrome traces). Each command stops at LIMIT (default 480 s).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
LIMIT=${LIMIT:-480}; W=/tmp/encdec-profile; limit_clock encdec_step_profile "$W"; mkdir -p "$W/runs" "$W/prof"
PY=${PY:-python3}
[ -n "${DRY:-}${LIST:-}" ] || install_for_runs

finish() {
  record_machine "$W"
  $PY - "$W" > "$W/summary.md" 2>> "$W/log.txt" <<'EOF'
import glob, json, os, sys
w = sys.argv[1]
lines = ["| row | median step s | samples/s | timed intervals | mode |", "|---|---:|---:|---:|---|"]
for path in sorted(glob.glob(f"{w}/runs/*-timed/*.json")):
    d = json.load(open(path)); t = d.get("timing") or {}
    name = os.path.basename(os.path.dirname(path))[: -len("-timed")]
    lines.append(f"| {name} | {t.get('median_step_s') or 0:.4f} | {t.get('samples_per_s') or 0:.1f} |"
                 f" {t.get('timed_intervals')} | {d.get('mode')} |")
print("\n".join(lines) + "\n")
for path in sorted(glob.glob(f"{w}/prof/profile-*.md")):
    print(open(path).read())
EOF
  cp "$W/summary.md" "$W/log.txt" "$OUT/" 2>/dev/null
  tar czf "$OUT/encdec_profile.tgz" -C /tmp encdec-profile
}
trap finish EXIT

C=examples/configs; T5S=hf:$C/t5-small; T5B=hf:$C/t5-base; BART=hf:$C/bart-base
COMMON=(--data synthetic --weights none --eval-batches 1 --precision bf16-mixed --optimizer adamw)
STEPS=14
ROWS=(
  "t5-small-fast $T5S --seq-len 256 --target-len 64 --batch-size 64 --checkpoint-blocks --mode fast"
  "t5-base-fast $T5B --seq-len 256 --target-len 256 --batch-size 16 --checkpoint-blocks --fused-loss --mode fast"
  "bart-base-fast $BART --seq-len 256 --target-len 256 --batch-size 16 --accumulation-steps 4 --mode fast"
  "t5-small-eager $T5S --seq-len 256 --target-len 64 --batch-size 64 --checkpoint-blocks --mode eager"
)
if [ "${SWEEP:-}" = host ]; then  # per-sample against per-call host cost: one model, the batch changed alone,
  # then BART-base's selective-checkpointing set (its per-op policy calls), each timed and profiled
  ROWS=()
  for b in 16 32 128; do
    ROWS+=("t5-small-fast-b$b $T5S --seq-len 256 --target-len 64 --batch-size $b --checkpoint-blocks --mode fast")
  done
  ROWS+=("bart-base-selective $BART --seq-len 256 --target-len 256 --batch-size 16 --accumulation-steps 4 --checkpoint-blocks --checkpoint-mode selective --mode fast")
fi
if [ "${SWEEP:-}" = lm ]; then  # the causal LMs' fast rows the speed model is fitted on (8 x 1024, fused loss,
  # checkpointing), Llama's at micro-batch 2 as well (its GPU work a quarter: the host's cost laid bare), and
  # T5-small's batch-16 row again: per launch and per compiled call, the LMs' host against the encoder-decoder's
  LLAMA=hf:$C/llama-0.36b; NEOX=hf:$C/gpt-neox-0.4b; LMFLAGS="--seq-len 1024 --checkpoint-blocks --fused-loss --mode fast"
  ROWS=("llama-fast-b8 $LLAMA --batch-size 8 $LMFLAGS" "llama-fast-b2 $LLAMA --batch-size 2 $LMFLAGS"
        "neox-fast-b8 $NEOX --batch-size 8 $LMFLAGS"
        "t5-small-fast-b16 $T5S --seq-len 256 --target-len 64 --batch-size 16 --checkpoint-blocks --mode fast")
fi
if [ -n "${DRY:-}" ]; then  # tiny configs of the same types, small shapes, eager on the CPU
  for kind in t5 bart; do mkdir -p "$W/cfg/$kind"; done
  echo '{"model_type":"t5","vocab_size":512,"d_model":64,"d_ff":128,"num_layers":2,"num_heads":4,"d_kv":16}' > "$W/cfg/t5/config.json"
  echo '{"model_type":"bart","vocab_size":512,"d_model":64,"encoder_layers":2,"decoder_layers":2,"encoder_attention_heads":4,"decoder_attention_heads":4,"encoder_ffn_dim":128,"decoder_ffn_dim":128,"max_position_embeddings":128}' > "$W/cfg/bart/config.json"
  ROWS=("t5-small-fast hf:$W/cfg/t5 --seq-len 16 --target-len 8 --batch-size 2 --checkpoint-blocks --mode eager"
        "bart-base-fast hf:$W/cfg/bart --seq-len 16 --target-len 16 --batch-size 4 --accumulation-steps 2 --mode eager")
  COMMON+=(--accelerator cpu); STEPS=4
fi
if [ -n "${LIST:-}" ]; then  # the rows' your_model.py flags, one row a line, and nothing run
  trap - EXIT; for r in "${ROWS[@]}"; do echo "$r ${COMMON[*]}"; done; exit 0
fi
START=$(( STEPS - 6 )); [ "$START" -lt 1 ] && START=1  # the profiler's first step, after compilation and warm-up

for r in "${ROWS[@]}"; do
  # shellcheck disable=SC2086
  set -- $r; name=$1; model=$2; shift 2
  t=$(left); if [ "$t" -lt 40 ]; then log "skip $name: $t s left"; continue; fi
  log "timed $name: $model $*"
  timeout -s INT "$t" $PY recipes/your_model.py --model "$model" "$@" "${COMMON[@]}" --max-steps "$STEPS" \
      --results-dir "$W/runs/$name-timed" > "$W/$name-timed.log" 2>&1
  log "end timed $name: exit $? $(grep -h -m1 -o 'speed .*' "$W/$name-timed.log" | head -c 120)"
  t=$(left); if [ "$t" -lt 40 ]; then log "skip the profile of $name: $t s left"; continue; fi
  log "profiled $name (steps $((START + 1))-$((START + 4)))"
  timeout -s INT "$t" $PY -m devtools.speed.rung_profile --out "$W/prof" --tag "$name" --start "$START" --steps 4 \
      -- recipes/your_model.py --model "$model" "$@" "${COMMON[@]}" --max-steps $(( START + 5 )) \
      --results-dir "$W/runs/$name-profiled" > "$W/$name-profiled.log" 2>&1
  log "end profiled $name: exit $? $(grep -h -m1 -o 'GPU span .*' "$W/prof/profile-$name.md" 2>/dev/null | head -c 160)"
done
log "done"
