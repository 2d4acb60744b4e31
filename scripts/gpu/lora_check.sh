#!/usr/bin/env bash
# LoRA on your model, predicted against measured on one GPU (recipes/your_model.py --lora-rank R; docs/your_model.md):
# causal LMs at two ranks (and with checkpointing, other targets), two encoders (their classifier head trained too)
# and a timm ViT, each one process after another (eager, synthetic data, random weights, 6 steps). Each run records
# its own prediction (extra.predicted_card: peak reserved, whole device; estimate.peak_allocated_gb) next to what it
# measured (the whole run: model load, training, evaluation); rows marked "ckpt" also save a checkpoint at step 3
# (training/checkpoints.py), whose size on disk is compared with extra.predicted_card.checkpoint_file.
#
#   OUT=/some/dir bash scripts/gpu/lora_check.sh          # about 6 minutes on one H100
#   ROWS="qwen-r8 bert-r8" OUT=... bash scripts/gpu/lora_check.sh   # only these rows
#   DRY=1 OUT=/tmp/x bash scripts/gpu/lora_check.sh       # on a CPU: tiny sizes, 1 step, the same files
#
# Writes as it goes under $OUT: lora_check.json (every row), lora_check.md (the table), lora_check.tgz (the runs'
# results JSON, logs, GPU and commit). No run starts after LIMIT seconds (default 330).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); LIMIT=${LIMIT:-330}; RUNS=/tmp/lora-check; CK=/tmp/lora-check-ckpt
rm -rf "$RUNS" "$CK"; mkdir -p "$RUNS/runs" "$CK" "$OUT"
log() { echo "[lora_check $(( $(date +%s) - T0 )) s] $*" | tee -a "$RUNS/log.txt"; }
finish() { record_machine "$RUNS"; tar czf "$OUT/lora_check.tgz" -C /tmp lora-check; }
trap finish EXIT
if [ -z "${DRY:-}" ]; then
  install_checkout || log "pip install -e . failed"
  PY=python3; STEPS=6; EVERY=3; SIZE=full
else  # a CPU dry run: the same rows, tiny shapes
  PY=${PY:-python3}; STEPS=2; EVERY=1; SIZE=tiny
fi

# the table of every run so far: $OUT/lora_check.json and $OUT/lora_check.md
table() { $PY - "$RUNS" "$OUT" <<'EOF'
import json, pathlib, sys
runs, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = []
for line in (runs / "rows.txt").read_text().splitlines():
    name, flags = line.split("\t")
    path = runs / "runs" / f"your_model-{name}.json"
    r = json.loads(path.read_text()) if path.exists() else {}
    card, mem, est = (r.get("extra") or {}).get("predicted_card") or {}, r.get("memory") or {}, r.get("estimate") or {}
    ckpt = (runs / f"{name}.ckpt_bytes")
    row = {"name": name, "flags": flags, "status": r.get("status", "not run"), "error": r.get("error"),
           "lora": (r.get("extra") or {}).get("lora"), "parameters": r.get("parameters"),
           "trainable_parameters": (r.get("extra") or {}).get("trainable_parameters"),
           "predicted_allocated_gb": est.get("peak_allocated_gb"), "measured_allocated_gb": mem.get("run_peak_allocated_gb"),
           "predicted_reserved_gb": card.get("peak_reserved_gb"), "measured_reserved_gb": mem.get("run_peak_reserved_gb"),
           "predicted_device_gb": card.get("device_peak_gb"), "measured_device_gb": mem.get("device_peak_gb"),
           "device_method": mem.get("device_method"),
           "predicted_checkpoint_bytes": (card.get("checkpoint_file") or {}).get("total_bytes") if ckpt.exists() else None,
           "checkpoint_bytes": int(ckpt.read_text()) if ckpt.exists() and ckpt.read_text().strip() else None}
    rows.append(row)
(out / "lora_check.json").write_text(json.dumps(rows, indent=1))
def pct(p, m):
    return f"{100 * (p / m - 1):+.1f}%" if isinstance(p, (int, float)) and isinstance(m, (int, float)) and m else "—"
def f(x, spec=".2f"):
    return format(x, spec) if isinstance(x, (int, float)) else "—"
lines = ["| row | flags | status | trainable | alloc pred / meas GB | err | reserved pred / meas GB | err |"
         " device pred / meas GB | err | checkpoint pred / file MB | err |", "|---|---|---|---:|---|---:|---|---:|---|---:|---|---:|"]
for x in rows:
    ck_p, ck_m = x["predicted_checkpoint_bytes"], x["checkpoint_bytes"]
    lines.append(f"| {x['name']} | `{x['flags']}` | {x['status']} | {x['trainable_parameters'] or '—'} |"
                 f" {f(x['predicted_allocated_gb'])} / {f(x['measured_allocated_gb'])} | {pct(x['predicted_allocated_gb'], x['measured_allocated_gb'])} |"
                 f" {f(x['predicted_reserved_gb'])} / {f(x['measured_reserved_gb'])} | {pct(x['predicted_reserved_gb'], x['measured_reserved_gb'])} |"
                 f" {f(x['predicted_device_gb'])} / {f(x['measured_device_gb'])} | {pct(x['predicted_device_gb'], x['measured_device_gb'])} |"
                 f" {f(ck_p and ck_p / 1e6, '.1f')} / {f(ck_m and ck_m / 1e6, '.1f')} | {pct(ck_p, ck_m)} |")
(out / "lora_check.md").write_text("LoRA on one GPU: predicted against measured (whole run, eager)\n\n" + "\n".join(lines) + "\n")
print("\n".join(lines[-1:]))
EOF
}

# row NAME ckpt|- FLAGS...: one recipes/your_model.py process
row() { local name=$1 ck=$2; shift 2
        case " ${ROWS:-$name} " in *" $name "*) ;; *) return ;; esac
        if [ $(( $(date +%s) - T0 )) -gt "$LIMIT" ]; then log "skip $name: past ${LIMIT} s"; return; fi
        printf '%s\t%s\n' "$name" "$*" >> "$RUNS/rows.txt"
        local extra=(); [ "$ck" = ckpt ] && extra=(--checkpoint-every "$EVERY" --checkpoint-dir "$CK/$name" --keep-checkpoints 1)
        log "start $name: $*"
        $PY recipes/your_model.py "$@" --mode eager --data synthetic --weights none --max-steps "$STEPS" \
            --eval-batches 1 --results-dir "$RUNS/runs" --tag "$name" "${extra[@]}" > "$RUNS/$name.log" 2>&1
        log "end $name: exit $?"
        if [ "$ck" = ckpt ]; then stat -c %s "$CK/$name"/step-*.ckpt 2>/dev/null | head -1 > "$RUNS/$name.ckpt_bytes"; rm -rf "$CK/$name"; fi
        table | tee -a "$RUNS/log.txt"; }

C=examples/configs
if [ "$SIZE" = full ]; then
  LM512=(--seq-len 512 --batch-size 8); LM1K=(--seq-len 1024 --batch-size 8); ENC=(--seq-len 512 --batch-size 32)
  TL=(--seq-len 1024 --batch-size 4); VIT=(--batch-size 64); VITM=timm:vit_base_patch16_224; DEV=()
else
  LM512=(--seq-len 32 --batch-size 2); LM1K=(--seq-len 32 --batch-size 2); ENC=(--seq-len 32 --batch-size 2)
  TL=(--seq-len 32 --batch-size 2); VIT=(--batch-size 2); VITM=timm:test_vit; DEV=(--accelerator cpu)
  C=$RUNS/tiny  # each example config shrunk: 2 layers of width 64, a 1000-token vocabulary
  $PY - "$C" <<'EOF'
import json, pathlib, sys
for src in pathlib.Path("examples/configs").glob("*/config.json"):
    c = json.loads(src.read_text())
    c.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000)
    c.update({k: 2 for k in ("num_key_value_heads",) if k in c})
    c.update({k: 0 for k in ("pad_token_id", "bos_token_id", "eos_token_id") if isinstance(c.get(k), int) and c[k] >= 1000})
    dst = pathlib.Path(sys.argv[1]) / src.parent.name
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(c))
EOF
fi
row qwen-r8        ckpt --model hf:$C/qwen2-0.5b "${LM512[@]}" --precision bf16-mixed --lora-rank 8 "${DEV[@]}"
row qwen-r64       -    --model hf:$C/qwen2-0.5b "${LM512[@]}" --precision bf16-mixed --lora-rank 64 "${DEV[@]}"
row llama-r16      ckpt --model hf:$C/llama-0.36b "${LM1K[@]}" --precision bf16-true --lora-rank 16 "${DEV[@]}"
row llama-r16-ckpt -    --model hf:$C/llama-0.36b "${LM1K[@]}" --precision bf16-true --lora-rank 16 --checkpoint-blocks "${DEV[@]}"
row neox-r8        -    --model hf:$C/gpt-neox-0.4b "${LM1K[@]}" --precision bf16-mixed --lora-rank 8 "${DEV[@]}"
row neox-r32-qkv   -    --model hf:$C/gpt-neox-0.4b "${LM1K[@]}" --precision bf16-mixed --lora-rank 32 --lora-targets query_key_value "${DEV[@]}"
row bert-r8        ckpt --model hf:$C/bert-base-uncased "${ENC[@]}" --precision bf16-mixed --lora-rank 8 "${DEV[@]}"
row vitb-r8        -    --model $VITM "${VIT[@]}" --precision bf16-mixed --lora-rank 8 "${DEV[@]}"
row roberta-r16    ckpt --model hf:$C/roberta-base "${ENC[@]}" --precision 32-true --lora-rank 16 "${DEV[@]}"
row tinyllama-r16  -    --model hf:$C/tinyllama-1.1b "${TL[@]}" --precision bf16-true --lora-rank 16 "${DEV[@]}"
log "done"
