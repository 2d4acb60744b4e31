#!/usr/bin/env bash
# Where fast mode's memory outside the CUDA graph's pool goes, request by request. Rungs 02 and 04 replay
# 0.30 and 0.23 GB more there than they measure (`extra.cuda_graphs.other_reserved_gb`), rung 03 within a
# page: in the replay the Adam state, laid out in warm-up step 1 among the gradients of its backward,
# shares its 20 MiB pages with the gradients' holes, which `empty_cache` cannot return. Which layout the
# GPU's compiled blocks give is what this records: each rung in its default fast mode, the caching
# allocator's history (torch.cuda.memory._record_memory_history) on from the start of the process until
# just after the first capture, when a snapshot of the segments is taken (what `other_reserved_gb` reads).
# `--snapshot` refuses CUDA graphs, so the recipe runs under a small driver that records around it; the
# expandable segments fast mode sets are set in the environment first. The run goes on afterwards and
# writes its results JSON, whose `extra.cuda_graphs` says whether recording changed the layout (the
# committed runs: rung 02 11.4756 / 4.0454 GB, rung 03 10.1754 / 2.0657, rung 04 2.5459 / 2.1055).
# Each trace is reduced on the GPU machine to one line per event (action, address, size, stream, the
# Python frame that asked: the project's line, torch.optim's, inductor's generated code) and the
# segments at the capture, gzip'd, with a summary per run: per pool and stream the mapped and allocated
# bytes at the capture, and the side stream's live blocks at the first `empty_cache` (the gradients the
# state is laid out among). About 5 minutes on one H100
# (three compiled ViT-L/16 runs of 4 steps), from the repository root; nothing carried.
# Results: $OUT/fast-warmup-traces.tgz.
#
#   OUT=... bash scripts/gpu/fast_warmup_traces.sh       # ONLY=name,name: r04 r02 r03
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); R=/tmp/fast-warmup-traces; mkdir -p "$R"
log() { echo "[fast_warmup_traces $(( $(date +%s) - T0 )) s] $*" | tee -a "$R/log.txt"; }
finish() { record_machine "$R"; tar czf "$OUT/fast-warmup-traces.tgz" -C /tmp fast-warmup-traces; }
trap finish EXIT
install_checkout || log "pip install -e . failed"
QUICK=(--data synthetic --weights none --max-steps 4 --eval-batches 1)

record() {  # RECIPE ARGS...: the recipe under the recording driver; $TRACE_DIR gets the trace
python3 - "$@" <<'PY'
import gzip, json, os, pickle, re, runpy, sys
import torch
from fabric_memory_recipes.training import graphs

out = os.environ["TRACE_DIR"]
os.makedirs(out, exist_ok=True)
torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")  # no C++ symbols: quick
LIB = re.compile(r"cudnn|cublas|Workspace|flash|attention", re.I)

def origin(e):  # the Python line of the project or torch.optim that asked, the ATen op, the autograd node
    frames = e.get("frames") or []
    names = [f["name"] for f in frames]
    aten = next((m.group(1) for n in names if (m := re.match(r"at::_ops::(\w+)::", n))), None)
    lib = next((re.sub(r"\(.*", "", n) for n in names if LIB.search(n) and not n.startswith(("c10::", "torch::"))), None)
    node = next((m.group(1) for n in names if (m := re.search(r"autograd::generated::(\w+)::apply", n))), None)
    py = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames
          if f.get("filename", "").endswith(".py") and ("/torch/optim/" in f["filename"] or "/torch/" not in f["filename"])]
    return " / ".join(x for x in (lib or aten, node, py[0] if py else None) if x) or "?"

def dump():
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    rows = [{"a": e["action"], "addr": e["addr"], "size": e["size"], "stream": e["stream"],
             "op": origin(e) if e["action"] == "alloc" else ""} for e in snap["device_traces"][0]]
    segments = [{k: s.get(k) for k in ("address", "total_size", "allocated_size", "stream", "segment_type",
                                        "segment_pool_id", "is_expandable")}
                | {"blocks": [{"size": b["size"], "state": b["state"]} for b in s["blocks"]]}
                for s in snap["segments"]]
    with gzip.open(os.path.join(out, "trace.json.gz"), "wt") as f:
        json.dump({"events": rows, "segments": segments}, f)
    summarise(rows, segments)

def summarise(rows, segments):
    print("[trace] events:", len(rows), flush=True)
    for s in sorted(segments, key=lambda s: (tuple(s["segment_pool_id"] or (0, 0)), s["stream"], s["segment_type"])):
        free = [b["size"] for b in s["blocks"] if b["state"] != "active_allocated"]
        print(f"[trace] at capture: pool {tuple(s['segment_pool_id'] or (0, 0))} stream {s['stream']} {s['segment_type']}"
              f" mapped {s['total_size'] / 2**20:.1f} MiB allocated {s['allocated_size'] / 2**20:.1f} MiB,"
              f" {len(free)} free pieces, largest {max(free, default=0) / 2**20:.2f} MiB", flush=True)
    # the side stream's live blocks at the first unmapping (warm-up step 1's empty_cache, gradients live)
    live, first = {}, None
    for i, r in enumerate(rows):
        if r["a"] == "alloc":
            live[r["addr"]] = r
        elif r["a"] == "free_requested":
            live.pop(r["addr"], None)
        elif r["a"] == "segment_unmap" and first is None:
            first = i
            side = sorted((a, x["size"], x["stream"], x["op"]) for a, x in live.items() if x["size"] > 2**20)
            print(f"[trace] first unmapping at event {i}: {len(side)} live blocks over 1 MiB", flush=True)
            for a, n, stream, op in side[:400]:
                print(f"[trace]   {a:#x} {n / 2**20:8.3f} MiB stream {stream} {op}", flush=True)

real_capture = graphs.StepGraph._capture
def capture_then_dump(self, group_size):
    real_capture(self, group_size)
    if not getattr(graphs, "_dumped", False):
        graphs._dumped = True
        torch.cuda.synchronize()
        dump()
graphs.StepGraph._capture = capture_then_dump
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
}

run() { local name=$1 limit=$2 recipe=$3; shift 3
        case ",${ONLY:-$name}," in *",$name,"*) ;; *) return ;; esac
        log "start $name: $recipe $*"
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TRACE_DIR="$R/$name" \
          timeout "$limit" bash -c "$(declare -f record); record \"\$@\"" _ "recipes/$recipe.py" "${QUICK[@]}" "$@" --results-dir "$R/$name" > "$R/$name.log" 2>&1
        log "end $name: exit $?"
        grep '^\[trace\] at capture' "$R/$name.log" | tee -a "$R/log.txt"
        python3 -c "import json,glob; [print(f, json.load(open(f))['memory']['run_peak_reserved_gb'], json.load(open(f))['extra'].get('cuda_graphs')) for f in glob.glob('$R/$name/*.json')]" | tee -a "$R/log.txt"; }
run r04 180 04_lower_batch_size  # the first run compiles the blocks cold
run r02 150 02_mixed_precision
run r03 150 03_true_half_precision
log done
