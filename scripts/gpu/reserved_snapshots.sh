#!/usr/bin/env bash
# Where your model's peak reserved goes, against the estimate's allocator replay: the causal LMs' fused-loss
# set (checkpointing, fused loss, 8 x 1024 tokens, bf16-mixed AdamW) run with `--snapshot` (the caching
# allocator's own record of its first steps, torch.cuda.memory._record_memory_history), in fast and eager
# mode, on the whole card and on an emulated 8 GB card. Each snapshot is written without its stack frames
# (gzip'd, small enough to come back) and read on any machine by `python -m devtools.your_model.reserved_trace`.
# One H100, about 4 minutes, from the repository root; carried (ignored path): .whl (liger-kernel).
#
#   bash scripts/gpu/reserved_snapshots.sh            # ONLY=name,name runs some of: llama-fast llama-fast-8gb
#                                                     # llama-eager neox-fast
set -u
: "${OUT:?set OUT}"
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # the functions the GPU scripts share
export_run_env
T0=$(date +%s); R=/tmp/reserved-snapshots; mkdir -p "$R"
log() { echo "[reserved_snapshots $(( $(date +%s) - T0 )) s] $*" | tee -a "$R/log.txt"; }
finish() { record_machine "$R"; tar czf "$OUT/reserved-snapshots.tgz" -C /tmp reserved-snapshots; }
trap finish EXIT
install_wheels .whl/liger*.whl
LM=(--seq-len 1024 --batch-size 8 --precision bf16-mixed --optimizer adamw --data synthetic --max-steps 6
    --eval-batches 1 --checkpoint-blocks --fused-loss --snapshot)
run() { local name=$1; shift
        case ",${ONLY:-$name}," in *",$name,"*) ;; *) return ;; esac
        log "start $name: $*"
        python3 recipes/your_model.py "$@" "${LM[@]}" --results-dir "$R/$name" --tag "$name" > "$R/$name.log" 2>&1
        log "end $name: exit $?"
        for p in "$R/$name"/*snapshot.pickle; do [ -f "$p" ] && python3 -m devtools.your_model.reserved_trace --strip "$p" && rm -f "$p"; done
        log "$(ls -la "$R/$name" | tr '\n' ' ')"; }
run llama-fast     --model hf:examples/configs/llama-0.36b --mode fast
run llama-fast-8gb --model hf:examples/configs/llama-0.36b --mode fast --memory-budget-gb 8
run llama-eager    --model hf:examples/configs/llama-0.36b --mode eager
run neox-fast      --model hf:examples/configs/gpt-neox-0.4b --mode fast
log done
