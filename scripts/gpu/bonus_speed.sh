#!/usr/bin/env bash
# The bonus after cases against their before cases, on one GPU: samples/s and peak reserved memory of each
# candidate, REPEATS rounds (default 3), one recipe process per run, synthetic data and random weights as the
# committed bonus runs (results/published/h100/bonus/). The candidates (NAME = CASE-VARIANT; * = in the default set):
#
#   distilbert-before *          recipes/bonus_distilbert_before.py (fp32, batch 12)
#   distilbert-today *           the after case as committed before the CUDA graph: --no-cuda-graphs (compiled
#                                blocks, eager steps, the 2-D padding mask)
#   distilbert-graphs *          the after case's default now: compiled blocks + one CUDA graph per step (3 x 4)
#   distilbert-graphsnocompile   --no-compile: the CUDA graph of the eager blocks
#   distilbert-ckpt12x1          --accumulation-steps 1 --checkpointing full: micro-batch 12, checkpointed blocks
#   distilbert-eager             --mode eager (as committed: 161 samples/s, 1.00 GB)
#   bigbird-before *             recipes/bonus_bigbird_before.py (fp32, batch 12, 2048 tokens)
#   bigbird-graphs *             the after case's default now: random blocks kept on the GPU, one CUDA graph per
#                                step (1 x 12), nothing compiled
#   bigbird-ckpt2x6              --accumulation-steps 6 --checkpointing full: micro-batches of 2
#   bigbird-ckpt4x3              --accumulation-steps 3 --checkpointing full: micro-batches of 4
#   bigbird-today                --compile --no-cuda-graphs: the previous default (12 layer compilations: minutes)
#   bigbird-eager                --mode eager (as committed: 4.7 samples/s, 3.31 GB)
#   llm-before, llm-all          recipes/bonus_llm_finetune.py without flags, and --all (their target was met)
#
# ONLY selects (spaces or commas between): a case name (distilbert, bigbird, llm) runs its default set, a NAME or
# a glob (distilbert-*) those candidates, "all" every one. Case by case; within a case, round by round, so a call
# stopped early still has whole rounds. Measured on an H100 by the last call: a recipe process costs ~20 s
# before its first step. Expected on one H100: the default set ~8 min (DistilBERT ~4.5, BigBird ~3.5);
#   ONLY="distilbert-graphsnocompile distilbert-ckpt12x1 bigbird-ckpt2x6 bigbird-ckpt4x3"   ~7 min.
#
#   bash scripts/gpu/bonus_speed.sh                           # the default set, one H100
#   ONLY=bigbird REPEATS=1 bash scripts/gpu/bonus_speed.sh    # one round of BigBird's
#   DRY=1 OUT=/tmp/out ONLY=all REPEATS=1 bash scripts/gpu/bonus_speed.sh   # CPU dry run: tiny models, 2 steps
#
# Each run's peak reserved memory and samples/s are read from its results JSON (memory.peak_reserved_gb,
# timing.samples_per_s). After every run $OUT/summary.md (per candidate: the median and range of the rounds,
# ÷ before, the committed after's memory, the loss every 5 steps) and $OUT/bonus_speed.tgz (every JSON and log)
# are rewritten. Each run gets at most RUN_LIMIT s (default 150) and the time left before LIMIT (default 470 s);
# it is stopped with SIGINT, and a recipe stopped so still writes its JSON (status "interrupted").
# Carried (ignored path): .whl, only for the llm case (liger-kernel: the fused loss's kernel).
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
PY=${PYTHON:-python3}; T0=$(date +%s); LIMIT=${LIMIT:-470}; RUN_LIMIT=${RUN_LIMIT:-150}; REPEATS=${REPEATS:-3}
ONLY=${ONLY:-distilbert bigbird}; ONLY=${ONLY//,/ }
RUNS=/tmp/bonus_speed; rm -rf "$RUNS"; mkdir -p "$RUNS/runs" "$OUT"
log() { echo "[bonus_speed $(( $(date +%s) - T0 )) s] $*" | tee -a "$RUNS/log.txt"; }

# NAME DEFAULT RECIPE FLAGS...
CANDIDATES=(
  "distilbert-before 1 bonus_distilbert_before"
  "distilbert-today 1 bonus_distilbert_after --no-cuda-graphs"
  "distilbert-graphs 1 bonus_distilbert_after"
  "distilbert-graphsnocompile 0 bonus_distilbert_after --no-compile"
  "distilbert-ckpt12x1 0 bonus_distilbert_after --accumulation-steps 1 --checkpointing full"
  "distilbert-eager 0 bonus_distilbert_after --mode eager"
  "bigbird-before 1 bonus_bigbird_before"
  "bigbird-graphs 1 bonus_bigbird_after"
  "bigbird-ckpt2x6 0 bonus_bigbird_after --accumulation-steps 6 --checkpointing full"
  "bigbird-ckpt4x3 0 bonus_bigbird_after --accumulation-steps 3 --checkpointing full"
  "bigbird-today 0 bonus_bigbird_after --compile --no-cuda-graphs"
  "bigbird-eager 0 bonus_bigbird_after --mode eager"
  "llm-before 1 bonus_llm_finetune"
  "llm-all 1 bonus_llm_finetune --all"
)
selected() {  # selected NAME DEFAULT: is the candidate in ONLY?
  local pat
  for pat in $ONLY; do
    [ "$pat" = all ] && return 0
    [ "$pat" = "${1%%-*}" ] && [ "$2" = 1 ] && return 0
    # shellcheck disable=SC2053
    [[ $1 == $pat ]] && return 0
  done
  return 1
}

summary() { "$PY" - "$RUNS" <<'PY'
import json, pathlib, statistics, sys
runs, committed = pathlib.Path(sys.argv[1]) / "runs", pathlib.Path("results/published/h100/bonus")
TODAY = {"distilbert": "bonus_distilbert_after.json", "bigbird": "bonus_bigbird_after.json",
         "llm": "bonus_llm_finetune-all.json"}
rows = {}
for f in sorted(runs.glob("*/*.json")):
    name, d = f.parent.name, json.loads(f.read_text())  # name: CASE-VARIANT-rN
    case, variant = name.split("-")[0], "-".join(name.split("-")[1:-1])
    t, m, c, x = (d.get(k) or {} for k in ("timing", "memory", "config", "extra"))
    rows.setdefault((case, variant), []).append(dict(
        name=name, status=d.get("status"), speed=t.get("samples_per_s"), reserved=m.get("peak_reserved_gb"),
        allocated=m.get("peak_allocated_gb"), step=t.get("median_step_s"),
        warmup=(m.get("warmup") or {}).get("peak_reserved_gb"), steady=(m.get("steady") or {}).get("peak_reserved_gb"),
        pool=(x.get("cuda_graphs") or {}).get("graph_pool_reserved_gb"),
        how=f"{c.get('micro_batch_size')}x{c.get('accumulation_steps')} {c.get('precision')}"
            f"{' compiled' if c.get('compile') else ''}{' graphs' if c.get('cuda_graphs') else ''}"
            f"{' ckpt-' + c['checkpointing'] if c.get('checkpointing') else ''}",
        curve=" ".join(f"{s}:{v:.4f}" for s, v in (d.get("loss") or {}).get("curve", []))))
def med(rs, key):
    v = [r[key] for r in rs if r["status"] == "ok" and isinstance(r[key], (int, float))]
    return statistics.median(v) if v else None
def spread(rs, key):
    v = [r[key] for r in rs if r["status"] == "ok" and isinstance(r[key], (int, float))]
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}, n={len(v)})" if v else "-"
f2 = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-"
print("| case | variant | how | samples/s median (range, n of ok runs) | ÷ before | peak reserved GB median (range) |"
      " statuses |\n|---|---|---|---|---:|---|---|")
for (case, variant), rs in sorted(rows.items()):
    before = med(rows.get((case, "before"), []), "speed")
    ratio = f2(med(rs, "speed") / before) if before and med(rs, "speed") else "-"
    print(f"| {case} | {variant} | {rs[0]['how']} | {spread(rs, 'speed')} | {ratio} | {spread(rs, 'reserved')} |"
          f" {' '.join(str(r['status']) for r in rs)} |")
print("\n| run | status | samples/s | median step s | peak reserved GB | allocated | warm-up / steady reserved |"
      " graph pool GB | loss (step:value) |\n|---|---|---:|---:|---:|---:|---|---:|---|")
for rs in rows.values():
    for r in rs:
        print(f"| {r['name']} | {r['status']} | {f2(r['speed'])} | {r['step'] if r['step'] is None else round(r['step'], 4)}"
              f" | {f2(r['reserved'])} | {f2(r['allocated'])} | {f2(r['warmup'])} / {f2(r['steady'])} | {f2(r['pool'])}"
              f" | {r['curve']} |")
print("\nVerdicts (median samples/s of the ok runs against before's; the largest peak reserved against the committed"
      " after's, results/published/h100/bonus/):")
for (case, variant), rs in sorted(rows.items()):
    if variant == "before":
        continue
    old = committed / TODAY[case]
    old = json.loads(old.read_text()) if old.exists() else {}
    old_reserved = (old.get("memory") or {}).get("peak_reserved_gb")
    sb, sa = med(rows.get((case, "before"), []), "speed"), med(rs, "speed")
    ra = max((r["reserved"] for r in rs if r["status"] == "ok" and r["reserved"]), default=None)
    print(f"- {case}-{variant}: {f2(sa)} vs {f2(sb)} samples/s: speed target {'met' if sa and sb and sa >= sb else 'NOT met'};"
          f" {f2(ra)} GB vs {f2(old_reserved)} GB: memory target {'met' if ra and old_reserved and ra <= old_reserved else 'NOT met'}")
PY
}
write_out() {  # after every run: what is there so far
  summary > "$RUNS/summary.md" 2> "$RUNS/summary.err"; cp "$RUNS/summary.md" "$OUT/summary.md"
  tar czf "$OUT/bonus_speed.tgz" -C /tmp bonus_speed; }
finish() { record_machine "$RUNS"; write_out; }
trap finish EXIT

if [ -z "${DRY:-}" ]; then
  if [[ " $ONLY " == *" llm"* || " $ONLY " == *" all "* ]]; then
    install_wheels .whl/liger_kernel*.whl \
      || log "liger-kernel not installed (.whl not carried?): the fused loss runs its torch path"
  fi
  install_checkout || log "pip install -e . failed"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's package, installed or not

COMMON=(--data synthetic --weights none --eval-batches 1 --log-every 5)
if [ -n "${DRY:-}" ]; then  # the CPU's quick shapes: the same recipes, flags and flow (dynamo off: no CPU compile)
  export TORCHDYNAMO_DISABLE=1
  declare -A STEPS=([distilbert]="--accelerator cpu --model distilbert-tiny --max-length 64 --max-steps 2"
                    [bigbird]="--accelerator cpu --model bigbird-tiny --max-length 128 --max-steps 2"
                    [llm]="--accelerator cpu --model qwen2-tiny --max-length 32 --max-steps 2")
else
  declare -A STEPS=([distilbert]="--max-steps 20" [bigbird]="--max-steps 10" [llm]="--max-steps 10")
fi
# run NAME RECIPE FLAGS...: one recipe process, stopped with SIGINT at RUN_LIMIT or LIMIT; NAME = CASE-VARIANT-rN
run() { local name=$1 recipe=$2; shift 2; local left=$(( LIMIT - ($(date +%s) - T0) ))
        if [ "$left" -lt 25 ]; then log "skip $name: ${left} s left"; return; fi
        [ "$left" -gt "$RUN_LIMIT" ] && left=$RUN_LIMIT
        log "start $name: $recipe $* (limit ${left} s)"
        # shellcheck disable=SC2086
        timeout -s INT -k 20 "$left" "$PY" "recipes/$recipe.py" ${STEPS[${name%%-*}]} "$@" "${COMMON[@]}" \
          --results-dir "$RUNS/runs/$name" --tag "${name##*-}" > "$RUNS/$name.log" 2>&1
        log "end $name: exit $? ($(grep -m1 -o 'speed .*' "$RUNS/$name.log" | head -c 100))"
        write_out; }

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$RUNS/log.txt"
for case in distilbert bigbird llm; do
  chosen=()
  for c in "${CANDIDATES[@]}"; do
    read -r name default _ <<< "$c"
    [ "${name%%-*}" = "$case" ] && selected "$name" "$default" && chosen+=("$c")
  done
  [ ${#chosen[@]} -eq 0 ] && continue
  log "$case: ${#chosen[@]} candidates x $REPEATS rounds"
  for r in $(seq 1 "$REPEATS"); do
    for c in "${chosen[@]}"; do
      read -r name _ recipe flags <<< "$c"
      # shellcheck disable=SC2086
      run "$name-r$r" "$recipe" $flags
    done
  done
done
log "done"
