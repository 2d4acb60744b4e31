#!/usr/bin/env bash
# The bonus cases at speed, on one GPU: "before" and "after" of each case in its default mode, REPEATS rounds
# (default 3), one recipe process per run, synthetic data and random weights as the committed bonus runs:
#   distilbert  recipes/bonus_distilbert_before.py   against recipes/bonus_distilbert_after.py
#   bigbird     recipes/bonus_bigbird_before.py      against recipes/bonus_bigbird_after.py
#   llm         recipes/bonus_llm_finetune.py        (vanilla) against recipes/bonus_llm_finetune.py --all
# Case by case, before and after alternating, so a call stopped early still has whole pairs; BigBird last (its
# first compiled "after" is the slowest run). Then, while time is left, one run each of today's "after"
# (--mode eager; for the LLM also full checkpointing and the plain loss) for its memory in the same call, and
# DistilBERT's "after" at micro-batches of 6. About 17 s of each run is the process starting.
# Each run's peak reserved memory and samples/s are read from its results JSON (memory.peak_reserved_gb,
# timing.samples_per_s); summary.md gives per case the median and range of the rounds, after / before, and
# today's committed "after" (results/published/h100/bonus/).
#
#   bash scripts/gpu/bonus_speed.sh          # one H100, carried: .whl (liger-kernel: the fused loss's kernel)
#   DRY=1 OUT=/tmp/out bash scripts/gpu/bonus_speed.sh   # CPU dry run: tiny models, 2 steps, the same flow
#
# Results: $OUT/bonus_speed.tgz (every run's JSON and log, summary) and $OUT/summary.md. Each run gets at most
# the time left before LIMIT (default 460 s): it is stopped with SIGINT, and a recipe stopped so still writes
# its JSON (status "interrupted").
set -u
: "${OUT:?set OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 FMR_OFFLINE=1
PY=${PYTHON:-python3}; T0=$(date +%s); LIMIT=${LIMIT:-460}; REPEATS=${REPEATS:-3}
RUNS=/tmp/bonus_speed; rm -rf "$RUNS"; mkdir -p "$RUNS/runs"
log() { echo "[bonus_speed $(( $(date +%s) - T0 )) s] $*" | tee -a "$RUNS/log.txt"; }
summary() { "$PY" - "$RUNS" <<'PY' | tee "$RUNS/summary.md"
import json, pathlib, statistics, sys
runs, committed = pathlib.Path(sys.argv[1]) / "runs", pathlib.Path("results/published/h100/bonus")
TODAY = {"distilbert": "bonus_distilbert_after.json", "bigbird": "bonus_bigbird_after.json",
         "llm": "bonus_llm_finetune-all.json"}
rows = {}
for f in sorted(runs.glob("*/*.json")):
    name, d = f.parent.name, json.loads(f.read_text())  # name: CASE-VARIANT-rN
    case, variant = name.split("-")[0], "-".join(name.split("-")[1:-1])
    t, m = d.get("timing") or {}, d.get("memory") or {}
    rows.setdefault((case, variant), []).append(
        (name, d.get("status"), t.get("samples_per_s"), m.get("peak_reserved_gb"), t.get("median_step_s"),
         (d.get("extra") or {}).get("compiled_blocks"))
    )
def spread(values):
    v = [x for x in values if x is not None]
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}, n={len(v)})" if v else "-"
print("| case | variant | samples/s median (range, n) | peak reserved GB median (range, n) | statuses | compiled blocks |")
print("|---|---|---|---|---|---|")
for (case, variant), rs in sorted(rows.items()):
    print(f"| {case} | {variant} | {spread(r[2] for r in rs)} | {spread(r[3] for r in rs)} |"
          f" {' '.join(str(r[1]) for r in rs)} | {rs[0][5]} |")
print("\n| run | status | samples/s | peak reserved GB | median step s |\n|---|---|---:|---:|---:|")
for rs in rows.values():
    for r in rs:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} |")
print("\nVerdicts from the runs with status ok:")
for case in ("distilbert", "bigbird", "llm"):
    before, after = ([r for r in rows.get((case, v), []) if r[1] == "ok"] for v in ("before", "after"))
    speed = lambda rs: statistics.median(r[2] for r in rs if r[2]) if any(r[2] for r in rs) else None
    reserved = lambda rs: max(r[3] for r in rs if r[3]) if any(r[3] for r in rs) else None
    today = committed / TODAY[case]
    old = json.loads(today.read_text()) if today.exists() else {}
    old_reserved, old_speed = (old.get("memory") or {}).get("peak_reserved_gb"), (old.get("timing") or {}).get("samples_per_s")
    sb, sa, ra = speed(before), speed(after), reserved(after)
    ratio = f"{sa / sb:.2f}" if sa and sb else "-"
    f2 = lambda x: f"{x:.2f}" if isinstance(x, (int, float)) else "-"
    print(f"- {case}: after/before speed {ratio} (median samples/s {f2(sa)} vs {f2(sb)}); after's largest peak"
          f" reserved {f2(ra)} GB vs the committed after's {f2(old_reserved)} GB (at {f2(old_speed)} samples/s);"
          f" speed target {'met' if sa and sb and sa >= sb else 'NOT met'}, memory target"
          f" {'met' if ra and old_reserved and ra <= old_reserved else 'NOT met'}")
PY
}
finish() { summary > /dev/null 2>&1; cp "$RUNS/summary.md" "$OUT/summary.md" 2>/dev/null
           nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RUNS/gpu.csv" 2>&1
           git log -1 --format='%H %s' > "$RUNS/commit.txt" 2>/dev/null
           tar czf "$OUT/bonus_speed.tgz" -C /tmp bonus_speed; }
trap finish EXIT
if [ -z "${DRY:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger_kernel*.whl \
    || log "liger-kernel not installed (.whl not carried?): the fused loss runs its torch path"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || log "pip install -e . failed"
fi
"$PY" -c "import importlib.util as u; print('liger-kernel:', bool(u.find_spec('liger_kernel')))" 2>&1 | tee -a "$RUNS/log.txt"

COMMON=(--data synthetic --weights none --eval-batches 1)
if [ -n "${DRY:-}" ]; then  # the CPU's quick shapes: the same recipes, flags and flow
  DB=(--accelerator cpu --model distilbert-tiny --max-length 64 --max-steps 2)
  BB=(--accelerator cpu --model bigbird-tiny --max-length 128 --max-steps 2)
  LM=(--accelerator cpu --model qwen2-tiny --max-length 32 --max-steps 2)
else
  DB=(--max-steps 20); BB=(--max-steps 10); LM=(--max-steps 10)
fi
# run NAME RECIPE ARGS...: one recipe process, stopped with SIGINT at LIMIT; NAME = CASE-VARIANT-rN
run() { local name=$1 recipe=$2; shift 2; local left=$(( LIMIT - ($(date +%s) - T0) ))
        if [ "$left" -lt 20 ]; then log "skip $name: ${left} s left"; return; fi
        log "start $name: $recipe $*"
        timeout -s INT -k 20 "$left" "$PY" "recipes/$recipe.py" "$@" "${COMMON[@]}" \
          --results-dir "$RUNS/runs/$name" --tag "${name##*-}" > "$RUNS/$name.log" 2>&1
        log "end $name: exit $? ($(grep -m1 -o 'speed .*' "$RUNS/$name.log" | head -c 90))"; }

for r in $(seq 1 "$REPEATS"); do
  run "distilbert-before-r$r" bonus_distilbert_before "${DB[@]}"
  run "distilbert-after-r$r" bonus_distilbert_after "${DB[@]}"
done
for r in $(seq 1 "$REPEATS"); do
  run "llm-before-r$r" bonus_llm_finetune "${LM[@]}"
  run "llm-after-r$r" bonus_llm_finetune "${LM[@]}" --all
done
for r in $(seq 1 "$REPEATS"); do  # last: its first "after" compiles a graph per layer (12), later ones read the cache
  run "bigbird-before-r$r" bonus_bigbird_before "${BB[@]}"
  run "bigbird-after-r$r" bonus_bigbird_after "${BB[@]}"
done
run "distilbert-aftereager-r1" bonus_distilbert_after "${DB[@]}" --mode eager
run "llm-aftereager-r1" bonus_llm_finetune "${LM[@]}" --all --mode eager --checkpoint-mode full --no-fused-loss
run "distilbert-aftermb6-r1" bonus_distilbert_after "${DB[@]}" --accumulation-steps 2
run "bigbird-aftereager-r1" bonus_bigbird_after "${BB[@]}" --mode eager
summary
log "done"
