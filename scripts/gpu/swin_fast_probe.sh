#!/usr/bin/env bash
# Swin-V2-T in fast mode on one GPU: the ranking check's first pick for it at 4 GB (recipes/your_model.py
# --model torchvision:swin_v2_t, bf16-mixed AdamW, checkpointing, micro-batch 64 x 2, --mode fast; the
# command planning/your_model/measure.py runs), its first step's time and its steady speed. Its blocks need
# 12 distinct compiled graphs (training/your_model/regions.py), so fast mode now runs them eagerly inside its
# CUDA graph and says so in one line. From the repository root; results under $OUT:
#
#   bash scripts/gpu/swin_fast_probe.sh                   # parts "fast eager equal": ~3 minutes
#   PARTS="fast eager compiled" bash scripts/gpu/swin_fast_probe.sh   # + the compile fast mode declined:
#                                                         # the 12 checkpointed blocks compiled with static
#                                                         # shapes, 3 forward+backward steps timed against
#                                                         # eager ones (at most 4 more minutes)
#
# Parts: fast (the set as the ranking runs it), eager (the same set, --mode eager), equal (fast == eager:
# `python -m devtools.your_model.equivalence --only swin_v2_t`, 6 fp32 steps from one start, batch 16; its
# eager checkpointed blocks draw stochastic depth's random bits inside the captured step), compiled (above).
# Each recipe run is stopped (SIGINT) after RUN_LIMIT s (150), equal after 200 s, compiled after 240 s. Results:
# $OUT/summary.md (first step, median step, samples/s, compiled blocks, the fast-mode line, whole-device
# peak per run) and $OUT/swin_fast_probe.tgz (the runs' JSONs and logs).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s); R=/tmp/swin_fast_probe; mkdir -p "$R/runs"
log() { echo "[swin_fast_probe $(( $(date +%s) - T0 )) s] $*" | tee -a "$R/log.txt"; }
summary() { python3 - "$R" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
print("| run | status | process s | first step s | median step s | samples/s | compiled blocks | device peak GB |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for f in sorted((root / "runs").glob("*/your_model.json")):
    d = json.loads(f.read_text()); t = d.get("timing") or {}; m = d.get("memory") or {}
    first = (t.get("train_wall_s") or 0) - sum(t.get("intervals_s") or [])  # the first step: compile, capture
    wall = (root / f"{f.parent.name}.wall").read_text().strip() if (root / f"{f.parent.name}.wall").exists() else "?"
    print(f"| {f.parent.name} | {d.get('status')} | {wall} | {first:.1f} | {t.get('median_step_s') or 0:.4f}"
          f" | {t.get('samples_per_s') or 0:.1f} | {(d.get('extra') or {}).get('compiled_blocks')}"
          f" | {m.get('device_peak_gb')} |")
for log in sorted(root.glob("*.log")):
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith(("fast mode:", "compiled", "{"))]
    print(f"\n{log.stem}: " + (" / ".join(lines) if lines else "no fast-mode line"))
EOF
}
finish() { record_machine "$R"
           { echo "Made by \`PARTS=\"${PARTS:-fast eager equal}\" bash scripts/gpu/swin_fast_probe.sh\` on"
             echo "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), commit $(git log -1 --format=%h 2>/dev/null), $(date -u +%F)."
             echo; summary; } > "$OUT/summary.md" 2>&1
           tar czf "$OUT/swin_fast_probe.tgz" -C /tmp swin_fast_probe; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu_start.txt"
SET=(--model torchvision:swin_v2_t --precision bf16-mixed --batch-size 64 --accumulation-steps 2 --optimizer adamw
     --checkpoint-blocks --data synthetic --weights none --eval-batches 1 --max-steps 10 --memory-budget-gb 4)

# run NAME ARGS...: one recipes/your_model.py process (its JSON in $R/runs/NAME, its log $R/NAME.log)
run() { local name=$1 start; shift; log "start $name: $*"; start=$(date +%s)
        timeout -k 15 -s INT "${RUN_LIMIT:-150}" python3 recipes/your_model.py "$@" --results-dir "$R/runs/$name" \
            > "$R/$name.log" 2>&1
        local rc=$?; echo $(( $(date +%s) - start )) > "$R/$name.wall"
        log "end $name: exit $rc after $(cat "$R/$name.wall") s; $(grep -h '^fast mode:' "$R/$name.log" | head -1)"
        grep -h "speed " "$R/$name.log" | tail -1; }

for part in ${PARTS:-fast eager equal}; do
  case $part in
    fast) run fast "${SET[@]}" --mode fast ;;
    eager) run eager "${SET[@]}" --mode eager ;;
    equal)
      log "start equal: fast == eager for Swin-V2-T (devtools/your_model/equivalence.py)"
      timeout -k 15 -s INT 200 python3 -m devtools.your_model.equivalence --only swin_v2_t --out "$R/equal" \
          > "$R/equal.log" 2>&1
      log "end equal: exit $?"; grep -h '^{' "$R/equal.log" | tee -a "$R/log.txt" ;;
    compiled)
      log "start compiled: the 12 checkpointed blocks compiled with static shapes, batch 64, bf16 autocast"
      timeout -k 15 -s INT 240 python3 - > "$R/compiled.log" 2>&1 <<'EOF'
import time
import torch
import torch.nn.functional as F
from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model import models, regions

torch.set_float32_matmul_precision("high")
torch._dynamo.config.recompile_limit = 32
um = models.resolve("torchvision:swin_v2_t")
with torch.device("cuda"):
    model = models.build(um)
blocks, _ = models.repeated_blocks(model)
checkpointing.checkpoint_blocks(model, blocks)
wrapped = [m for m in model.modules() if isinstance(m, checkpointing.CheckpointedBlock)]
print(f"compiled graphs counted: {regions.distinct_graphs(model, wrapped)} for {len(wrapped)} blocks", flush=True)
x = torch.randn(64, 3, model.image_size, model.image_size, device="cuda")
y = torch.randint(0, 10, (64,), device="cuda")


def steps(label: str, n: int) -> None:
    for i in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.cuda.synchronize()
        print(f"compiled part, {label} step {i}: {time.perf_counter() - t:.3f} s (forward + backward)", flush=True)


steps("eager", 4)
for m in wrapped:
    m.compile(dynamic=False)
steps("blocks compiled", 4)
EOF
      log "end compiled: exit $?"; grep -h "^compiled" "$R/compiled.log" | tee -a "$R/log.txt" ;;
    *) log "unknown part $part (fast, eager, equal, compiled)" ;;
  esac
done
summary | tee -a "$R/log.txt"
