#!/usr/bin/env bash
# The source article's mT5 examples on one GPU (docs/estimating_like_the_article.md): mT5-base at batch 32 x 10
# tokens in fp32, trained in full (AdamW) and with LoRA (rank 8 on every attention's q and v: 884,736 trainable
# parameters), and its greedy generate() at batch 1 (10 source tokens -> 10 new tokens). Each row is one
# recipes/your_model.py process (eager, synthetic data, random weights) that records its own prediction next to
# what it measured: peak allocated, peak reserved and the whole-device peak (NVML); the LoRA row also saves a
# checkpoint at step 3, whose size on disk is compared with its prediction. About 3 minutes on one H100:
#
#   OUT=/some/dir bash scripts/gpu/article_mt5_check.sh
#   DRY=1 OUT=/tmp/x bash scripts/gpu/article_mt5_check.sh    # on a CPU: a 2-layer mT5 of width 64, 2 steps
#   ROWS=mt5-infer-b1 OUT=/some/dir bash scripts/gpu/article_mt5_check.sh   # only the rows named (about 1 minute)
#
# Writes as it goes under $OUT: article_mt5.json (every row), article_mt5.md (the table), article_mt5.tgz (the
# runs' results JSON, logs, GPU and commit). No row starts after LIMIT seconds (default 400).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export PYTHONUNBUFFERED=1 FMR_OFFLINE=1 HF_HUB_OFFLINE=1
T0=$(date +%s); LIMIT=${LIMIT:-400}; RUNS=/tmp/article-mt5; rm -rf "$RUNS"; mkdir -p "$RUNS/runs" "$RUNS/ckpt" "$OUT"
log() { echo "[article_mt5 $(( $(date +%s) - T0 )) s] $*" | tee -a "$RUNS/log.txt"; }
PY=${PY:-python3}
table() { $PY - "$RUNS" "$OUT" <<'EOF'
import json, pathlib, sys
runs, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = []
for path in sorted((runs / "runs").glob("your_model-*.json")):
    r = json.loads(path.read_text()); x, mem = r.get("extra") or {}, r.get("memory") or {}
    pred = x.get("predicted_inference") or {**(x.get("predicted_card") or {}),
                                            "peak_allocated_gb": (r.get("estimate") or {}).get("peak_allocated_gb")}
    ckpt = runs / f"{r.get('tag')}.ckpt_bytes"
    row = {"name": r.get("tag"), "status": r.get("status"), "error": r.get("error"), "config": r.get("config"),
           "gpu": (r.get("provenance") or {}).get("gpu"), "trainable_parameters": x.get("trainable_parameters"),
           "checkpoint_bytes": int(ckpt.read_text()) if ckpt.exists() and ckpt.read_text().strip() else None,
           "predicted_checkpoint_bytes": (pred.get("checkpoint_file") or {}).get("total_bytes"),
           "model_load_allocated_gb": ((mem.get("phases") or {}).get("model_load") or {}).get("peak_allocated_gb"),
           "model_load_reserved_gb": ((mem.get("phases") or {}).get("model_load") or {}).get("peak_reserved_gb")}
    for name, predicted, measured in (("allocated", "peak_allocated_gb", "run_peak_allocated_gb"),
                                      ("reserved", "peak_reserved_gb", "run_peak_reserved_gb"),
                                      ("device", "device_peak_gb", "device_peak_gb")):
        row[f"predicted_{name}_gb"], row[f"measured_{name}_gb"] = pred.get(predicted), mem.get(measured)
    rows.append(row)
(out / "article_mt5.json").write_text(json.dumps(rows, indent=1))
def cell(p, m):
    if not isinstance(p, (int, float)) or not isinstance(m, (int, float)) or not m:
        return "—"
    return f"{p:.2f} / {m:.2f} ({100 * (p / m - 1):+.1f} %)"
lines = ["| row | status | alloc pred / meas GB | reserved pred / meas GB | device pred / meas GB | checkpoint pred / file bytes |",
         "|---|---|---|---|---|---|"]
for x in rows:
    ck = f"{x['predicted_checkpoint_bytes']} / {x['checkpoint_bytes']}" if x["checkpoint_bytes"] else "—"
    lines.append(f"| {x['name']} | {x['status']} | {cell(x['predicted_allocated_gb'], x['measured_allocated_gb'])} |"
                 f" {cell(x['predicted_reserved_gb'], x['measured_reserved_gb'])} |"
                 f" {cell(x['predicted_device_gb'], x['measured_device_gb'])} | {ck} |")
(out / "article_mt5.md").write_text("The source article's mT5 examples on one GPU: predicted / measured\n\n" + "\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}
finish() { record_machine "$RUNS"; table > /dev/null 2>> "$RUNS/log.txt"
           tar czf "$OUT/article_mt5.tgz" -C /tmp article-mt5; }
trap finish EXIT

MT5=hf:examples/configs/mt5-base; BATCH=32; SEQ=10; STEPS=4; EVERY=3; DEV=()
if [ -z "${DRY:-}" ]; then
  install_checkout || log "pip install -e . failed"
else  # a CPU dry run: the same rows on a 2-layer mT5 of width 64
  mkdir -p "$RUNS/tiny"; MT5=hf:$RUNS/tiny; BATCH=2; STEPS=2; EVERY=1; DEV=(--accelerator cpu)
  echo '{"model_type":"mt5","vocab_size":1000,"d_model":64,"d_ff":128,"d_kv":16,"num_layers":2,"num_heads":4,
"is_encoder_decoder":true,"tie_word_embeddings":false,"pad_token_id":0,"eos_token_id":1,"decoder_start_token_id":0}' \
    > "$RUNS/tiny/config.json"
fi
# row NAME FLAGS...: one recipes/your_model.py process, its results JSON in $RUNS/runs/your_model-NAME.json
ROWS=${ROWS:-"mt5-full mt5-lora-r8 mt5-infer-b1"}
row() { local name=$1; shift
        case " $ROWS " in *" $name "*) ;; *) return;; esac
        if [ $(( $(date +%s) - T0 )) -gt "$LIMIT" ]; then log "skip $name: past ${LIMIT} s"; return; fi
        log "start $name: $*"
        $PY recipes/your_model.py --model "$MT5" --seq-len "$SEQ" --precision 32-true --mode eager --data synthetic \
            --weights none "$@" "${DEV[@]}" --results-dir "$RUNS/runs" --tag "$name" > "$RUNS/$name.log" 2>&1
        log "end $name: exit $?"
        if [ -d "$RUNS/ckpt/$name" ]; then
          stat -c %s "$RUNS/ckpt/$name"/step-*.ckpt 2>/dev/null | head -1 > "$RUNS/$name.ckpt_bytes"; rm -rf "$RUNS/ckpt/$name"
        fi
        table | tee -a "$RUNS/log.txt"; }

row mt5-full --batch-size "$BATCH" --max-steps "$STEPS" --eval-batches 1
row mt5-lora-r8 --batch-size "$BATCH" --max-steps "$STEPS" --eval-batches 1 --lora-rank 8 --lora-targets q,v \
    --checkpoint-every "$EVERY" --checkpoint-dir "$RUNS/ckpt/mt5-lora-r8" --keep-checkpoints 1
row mt5-infer-b1 --infer --batch-size 1 --new-tokens 10
log "done"
