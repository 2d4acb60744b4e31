#!/usr/bin/env bash
# Encoder-decoders (T5, mT5, BART) on one GPU: the estimate's predicted peak allocated, reserved and whole device
# against what each training run measured (recipes/your_model.py records both), and one --fit SIZE --measure (does
# the pick fit its emulated card?). One device command, about 6 minutes on one H100, from the repository root:
#
#   bash scripts/gpu/seq2seq_check.sh            # results: $OUT/seq2seq.tgz, $OUT/rows.json, $OUT/table.md
#   DRY=1 OUT=/tmp/out bash scripts/gpu/seq2seq_check.sh   # the same on a CPU: tiny configs, no --measure
#
# Rows (4 optimizer steps each, synthetic pairs, JOBS=3 processes at a time: each its own allocator and NVML
# entry): T5-small 256 -> 64 tokens at batch 32 and 64; T5-base 512 -> 128 with checkpointing at 16 (eager) and
# 32 (fast mode: compiled blocks); BART-base 512 -> 128 at 16 and at 32 with checkpointing (fast); mT5-base at
# the article's batch 32 x 10 tokens in fp32, and 16 x 256 -> 64 with the fused loss and checkpointing (fast).
# Meanwhile the --fit: T5-small, batch 64 x 256 -> 64, bf16-mixed, a 4 GB card, its top 2 sets measured.
# Carried (ignored path): .whl (liger-kernel, for the fused loss on CUDA). Each command stops at the call's limit
# (LIMIT, default 400 s, by timeout), so what finished comes back.
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
LIMIT=${LIMIT:-400}; JOBS=${JOBS:-3}; R=/tmp/seq2seq; limit_clock seq2seq_check "$R"; mkdir -p "$R/runs"
PY=${PY:-python3}
[ -n "${DRY:-}" ] || install_for_runs

# The table: every run's predicted (the estimate it recorded) against measured, and the --fit's sets.
cat > "$R/summarize.py" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1]); rows = []
def err(p, m):
    return None if p is None or not m else round(100 * (p - m) / m, 1)
for path in sorted(root.glob("runs/*/*.json")):
    d = json.loads(path.read_text()); c, m, x = d.get("config", {}), d.get("memory", {}), d.get("extra", {})
    est, card = d.get("estimate") or {}, x.get("predicted_card") or {}
    row = {"name": path.parent.name, "status": d.get("status"), "model": c.get("model"), "batch_size": c.get("batch_size"),
           "accumulation_steps": c.get("accumulation_steps"), "seq_len": c.get("seq_len"), "target_len": c.get("target_len"),
           "precision": c.get("precision"), "mode": c.get("mode"), "checkpoint_blocks": c.get("checkpoint_blocks"),
           "fused_loss": c.get("fused_loss"), "gpu": d.get("provenance", {}).get("gpu_name"),
           "estimate_error": est.get("error"), "samples_per_s": d.get("timing", {}).get("samples_per_s")}
    for key, pred in (("peak_allocated_gb", est.get("peak_allocated_gb")), ("peak_reserved_gb", card.get("peak_reserved_gb")),
                      ("device_peak_gb", card.get("device_peak_gb"))):
        row[f"measured_{key}"], row[f"predicted_{key}"] = m.get(key), pred
        row[f"error_{key}_pct"] = err(pred, m.get(key))
    rows.append(row)
fit = {}
for plan in root.glob("fit/*/plan.json"):
    fit = json.loads(plan.read_text())
(root / "rows.json").write_text(json.dumps({"rows": rows, "fit": fit}, indent=2))
lines = ["| run | status | model | batch x src -> tgt | set | alloc meas/pred (err) | reserved meas/pred (err) | device meas/pred (err) |",
         "|---|---|---|---|---|---|---|---|"]
for r in rows:
    cell = lambda k: (f"{r[f'measured_{k}']:.2f} / {r[f'predicted_{k}']:.2f} ({r[f'error_{k}_pct']:+.1f} %)"
                      if r[f"measured_{k}"] is not None and r[f"predicted_{k}"] is not None else "—")
    tech = ", ".join(t for t, on in ((r["precision"], True), (r["mode"], True), ("checkpointing", r["checkpoint_blocks"]),
                                     ("fused loss", r["fused_loss"])) if on)
    shape = f"{r['batch_size']} x {r['seq_len']} -> {r['target_len'] or r['seq_len']}"
    lines.append(f"| {r['name']} | {r['status']} | {(r['model'] or '').split('/')[-1]} | {shape} | {tech} | {cell('peak_allocated_gb')}"
                 f" | {cell('peak_reserved_gb')} | {cell('device_peak_gb')} |")
if fit:
    lines += ["", f"--fit: budget {fit.get('budget_gb')} GB; predicted pick {fit.get('predicted_pick')}; measured pick {fit.get('measured_pick')}",
              "", "| # | status | predicted device GB | measured device GB | set |", "|---|---|---|---|---|"]
    for i, s in enumerate(fit.get("sets", []), 1):
        lines.append(f"| {i} | {s.get('status')} | {s.get('predicted_device_peak_gb')} | {s.get('measured_device_peak_gb')} | {s.get('label')} |")
(root / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
finish() { record_machine "$R"
           $PY "$R/summarize.py" "$R" > /dev/null 2>> "$R/log.txt"
           cp "$R/rows.json" "$R/table.md" "$OUT/" 2>/dev/null; tar czf "$OUT/seq2seq.tgz" -C /tmp seq2seq; }
trap finish EXIT

C=examples/configs; T5S=hf:$C/t5-small; T5B=hf:$C/t5-base; BART=hf:$C/bart-base; MT5=hf:$C/mt5-base
FIT=(--seq-len 256 --target-len 64 --batch-size 64 --fit 4GB --top 2 --measure --measure-steps 6)
COMMON=(--data synthetic --weights none --max-steps 4 --eval-batches 1)
if [ -n "${DRY:-}" ]; then  # tiny configs of the same types, small shapes, the CPU; --fit without --measure
  for kind in t5 mt5 bart; do mkdir -p "$R/cfg/$kind"; done
  echo '{"model_type":"t5","vocab_size":512,"d_model":64,"d_ff":128,"num_layers":2,"num_heads":4,"d_kv":16}' > "$R/cfg/t5/config.json"
  echo '{"model_type":"mt5","vocab_size":512,"d_model":64,"d_ff":128,"num_layers":2,"num_heads":4,"d_kv":16,"tie_word_embeddings":false}' > "$R/cfg/mt5/config.json"
  echo '{"model_type":"bart","vocab_size":512,"d_model":64,"encoder_layers":2,"decoder_layers":2,"encoder_attention_heads":4,"decoder_attention_heads":4,"encoder_ffn_dim":128,"decoder_ffn_dim":128,"max_position_embeddings":128}' > "$R/cfg/bart/config.json"
  T5S=hf:$R/cfg/t5; T5B=hf:$R/cfg/t5; BART=hf:$R/cfg/bart; MT5=hf:$R/cfg/mt5
  FIT=(--seq-len 32 --target-len 16 --batch-size 4 --fit 1GB --top 2)
  COMMON=(--data synthetic --max-steps 2 --eval-batches 1 --accelerator cpu)
fi
shrink() { [ -z "${DRY:-}" ] && echo "$1" || echo "$2"; }  # the GPU's value, or the dry run's

# row NAME MODEL BATCH SEQ TARGET ARGS...: one recipes/your_model.py process, its results JSON in $R/runs/NAME
row() { local name=$1 model=$2 batch=$(shrink "$3" 2) seq=$(shrink "$4" 16) target=$(shrink "$5" 8); shift 5
        local t; t=$(left); if [ "$t" -lt 30 ]; then log "skip $name: $t s left"; return; fi
        log "start $name: $model $batch x $seq -> $target $*"
        timeout -s INT "$t" $PY recipes/your_model.py --model "$model" --batch-size "$batch" --seq-len "$seq" \
            --target-len "$target" "${COMMON[@]}" "$@" --results-dir "$R/runs/$name" > "$R/$name.log" 2>&1
        log "end $name: exit $? $(grep -h -m1 -o 'estimate .*' "$R/$name.log" | head -c 160)"
        $PY "$R/summarize.py" "$R" > /dev/null 2>> "$R/log.txt"; }

log "fit: $T5S ${FIT[*]}"
( timeout -s INT "$(left)" $PY -m fabric_memory_recipes.planning --model "$T5S" "${FIT[@]}" --precision bf16-mixed \
    --measure-dir "$R/fit/t5-small" > "$R/fit.log" 2>&1; log "fit: exit $?" ) &
FIT_PID=$!

ROWS=(
  "t5s-b32 $T5S 32 256 64 --precision bf16-mixed --mode eager"
  "t5s-b64 $T5S 64 256 64 --precision bf16-mixed --mode eager"
  "t5b-b16-ckpt $T5B 16 512 128 --precision bf16-mixed --mode eager --checkpoint-blocks"
  "t5b-b32-ckpt-fast $T5B 32 512 128 --precision bf16-mixed --mode fast --checkpoint-blocks"
  "bart-b16 $BART 16 512 128 --precision bf16-mixed --mode eager"
  "bart-b32-ckpt-fast $BART 32 512 128 --precision bf16-mixed --mode fast --checkpoint-blocks"
  "mt5-article-b32 $MT5 32 10 10 --precision 32-true --mode eager"
  "mt5-b16-fused-ckpt-fast $MT5 16 256 64 --precision bf16-mixed --mode fast --fused-loss --checkpoint-blocks"
)
[ -n "${DRY:-}" ] && ROWS=("${ROWS[@]//--mode fast/--mode eager}")  # no compiler on the dry run's CPU
PIDS=()
rows_running() { local n=0 p; for p in "${PIDS[@]}"; do kill -0 "$p" 2> /dev/null && n=$((n + 1)); done; echo $n; }
for r in "${ROWS[@]}"; do
  # shellcheck disable=SC2086
  row $r &
  PIDS+=($!)
  while [ "$(rows_running)" -ge "$JOBS" ]; do sleep 2; done
done
wait "${PIDS[@]}" "$FIT_PID"
$PY "$R/summarize.py" "$R" | tee -a "$R/log.txt"
log "done"
