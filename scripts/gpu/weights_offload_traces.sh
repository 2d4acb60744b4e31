#!/usr/bin/env bash
# What rung 16 holds on the GPU, request by request: the caching allocator's own record (`--snapshot`) of
# rung 16 at its default batch 24 and at batch 16, and of rung 04 in eager mode (batch 16, no streaming: the
# same unexplained block-backward allocations as rung 16, results/published/h100/estimate/eager/04_*.json),
# plus one unrecorded rung 16 run (the recording slows the host, which changes how long blocks freed after
# record_stream wait). Each trace is reduced on the GPU machine to one line per event (action, size,
# stream, time, and the first ATen/library frame that asked: which op allocated it) and summarised:
# per stream the segments at the peak, for blocks freed after record_stream how many requests passed
# before they were reusable, and the live blocks at the peak allocated by op. About 4 minutes on one H100,
# from the repository root; nothing carried. Results: $OUT/weights-offload-traces.tgz.
#
#   OUT=... bash scripts/gpu/weights_offload_traces.sh       # ONLY=name,name: r16-b24 r16-b16 r04-b16 r16-plain
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); R=/tmp/weights-offload-traces; mkdir -p "$R"
log() { echo "[weights_offload_traces $(( $(date +%s) - T0 )) s] $*" | tee -a "$R/log.txt"; }
finish() { record_machine "$R"
           tar czf "$OUT/weights-offload-traces.tgz" -C /tmp weights-offload-traces; }
trap finish EXIT
install_checkout || log "pip install -e . failed"
QUICK=(--data synthetic --weights none --eval-batches 1)

reduce() {  # SNAPSHOT.pickle -> SNAPSHOT.events.json.gz (one line per event) + a summary on stdout
python3 - "$1" <<'PY'
import collections, gzip, json, pickle, re, sys
path = sys.argv[1]
snap = pickle.load(open(path, "rb"))
trace = snap["device_traces"][0]
LIB = re.compile(r"cudnn|cublas|Workspace|flash|attention|convolution", re.I)
def op(e):  # the library call or ATen op that asked, the autograd node it ran for, the project's line
    frames = e.get("frames") or []
    names = [f["name"] for f in frames]
    lib = next((re.sub(r"\(.*", "", n) for n in names if LIB.search(n) and not n.startswith(("c10::", "torch::"))), None)
    aten = next((m.group(1) for n in names if (m := re.match(r"at::_ops::(\w+)::", n))), None)
    node = next((m.group(1) for n in names if (m := re.search(r"autograd::generated::(\w+)::apply", n))), None)
    py = next((f"{f['filename'].split('/')[-1]}:{f['line']}" for f in frames
               if f.get("filename", "").endswith(".py") and "/torch/" not in f["filename"]), None)
    return " / ".join(x for x in (lib or aten, node, py) if x) or "?"
rows = [{"a": e["action"], "addr": e["addr"], "size": e["size"], "stream": e["stream"], "t": e.get("time_us"),
         "op": op(e) if e["action"] == "alloc" else ""} for e in trace]
with gzip.open(path.replace(".pickle", ".events.json.gz"), "wt") as f:
    json.dump(rows, f)
streams = collections.Counter(r["stream"] for r in rows if r["a"] == "alloc")
print("allocations per stream:", dict(streams))
# blocks freed after record_stream: free_requested -> free_completed later; requests in between
allocs_seen, pending, lags = 0, {}, collections.Counter()
for r in rows:
    if r["a"] == "alloc":
        allocs_seen += 1
    elif r["a"] == "free_requested":
        pending[r["addr"]] = allocs_seen
    elif r["a"] == "free_completed" and r["addr"] in pending:
        lag = allocs_seen - pending.pop(r["addr"])
        if lag:
            lags[min(lag // 16 * 16, 512)] += 1
print("blocks reusable only after N more requests (record_stream), N in 16s:", dict(sorted(lags.items())))
# the peak allocated over the recording, and what was live then (by op), blocks allocated before it excluded
live, cur, peak, at = {}, 0, 0, None
for i, r in enumerate(rows):
    if r["a"] == "alloc":
        live[r["addr"]] = r; cur += r["size"]
        if cur > peak:
            peak, at, snapshot_live = cur, i, dict(live)
    elif r["a"] == "free_requested" and r["addr"] in live:
        cur -= live.pop(r["addr"])["size"]
print(f"peak over the recording (allocations made in it): {peak / 1e6:.1f} MB at event {at} ({rows[at]['op']})")
by_op = collections.Counter()
for r in snapshot_live.values():
    by_op[(r["op"], r["stream"])] += r["size"]
for (name, stream), n in by_op.most_common(25):
    print(f"  {n / 1e6:9.2f} MB  stream {stream}  {name}")
seg = collections.Counter()
for s in snap["segments"]:
    seg[s["stream"]] += s["total_size"]
print("segments at the end, MiB per stream:", {k: v >> 20 for k, v in seg.items()})
PY
}

run() { local name=$1 recipe=$2; shift 2
        case ",${ONLY:-$name}," in *",$name,"*) ;; *) return ;; esac
        log "start $name: $recipe $*"
        python3 "recipes/$recipe.py" "$@" "${QUICK[@]}" --results-dir "$R/$name" --tag "$name" > "$R/$name.log" 2>&1
        log "end $name: exit $?"
        for p in "$R/$name"/*snapshot.pickle; do
          [ -f "$p" ] || continue
          reduce "$p" > "$R/$name-summary.txt" 2>&1; log "$(cat "$R/$name-summary.txt")"; rm -f "$p"
        done
        python3 -c "import json,glob; [print(f, json.load(open(f))['memory']['peak_allocated_gb'], json.load(open(f))['memory']['peak_reserved_gb']) for f in glob.glob('$R/$name/*.json')]" | tee -a "$R/log.txt"; }
run r16-b24   16_weights_on_cpu --max-steps 6 --snapshot
run r16-b16   16_weights_on_cpu --max-steps 6 --snapshot --batch-size 16
run r04-b16   04_lower_batch_size --max-steps 4 --snapshot --mode eager
run r16-plain 16_weights_on_cpu --max-steps 20
log done
