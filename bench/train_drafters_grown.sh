#!/usr/bin/env bash
# Drafters grown from the shipped ones and continued on the self-distilled corpus of long prompts (CPU, two jobs at
# a time). `--init DIR --config ...` grows a drafter (new blocks start as identity blocks, wider MLPs with zero
# output weights: `specdec.draft.registry.grown_state_dict`), so training starts from the shipped drafter's function.
#   blocks (default): DSpark from 2 to 4 target-sized blocks (the reference recipe uses 5 for a 36-layer target);
#           MTP from one block with a 256-wide MLP to 2 blocks of the target's MLP width (768). Not shipped: the
#           deeper MTP is slower end to end, DSpark barely gained (bench/RESULTS.md, "The grown drafters run to a
#           longer patience").
#   wide:   MTP as one block with its MLP grown from 256 to 768 units; DSpark the same net trained at 64 blocks per
#           128-token window instead of 16 (`anchor_density=0.5`: four times the first-slot examples a step). The
#           shipped mtp and dspark (bench/RESULTS.md, "2026-12-02"), started from the drafters of commit b3b4bfc:
#           `git archive b3b4bfc specdec/embedded | tar -x -C DIR` gives them in DIR/specdec/embedded.
# Usage: bash bench/train_drafters_grown.sh [WORK_DIR] [INIT_MODEL_DIR] [blocks|wide]
#   WORK_DIR holds (or gets) the corpus of bench/train_drafters_longprompt.sh (corpus2.jsonl; cache2.pt shared).
# Every run keeps its best validation checkpoint in WORK_DIR/<run>; bench/accept_rate.py --model COPY --kinds code
# (COPY: the embedded model with a candidate under drafters/) decides what ships.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/specdec_longprompt}
init=${2:-specdec/embedded}
mode=${3:-blocks}
# the corpus of bench/train_drafters_longprompt.sh (resumed or reused when WORK_DIR already holds it)
CORPUS_ONLY=1 bash bench/train_drafters_longprompt.sh "$work"
train() {  # kind, out dir, minutes, patience, config overrides...
    local kind=$1 out=$2 minutes=$3 patience=$4; shift 4
    OMP_NUM_THREADS=1 python -m specdec.draft.train --target specdec/embedded --data "$work/corpus2.jsonl" \
        --seq-len 128 --batch-size 8 --val-every 50 --val-batches 4 --cache-batches 250 --cache "$work/cache2.pt" \
        --threads 1 --seed 0 --drafter "$kind" --init "$init/drafters/$kind" "$@" --out "$out" --steps 4000 \
        --lr 5e-4 --patience "$patience" --max-minutes "$minutes" --checkpoint "$out.ckpt" > "$out.log" 2>&1
}
# patience and time as in the runs recorded in bench/RESULTS.md
case $mode in
    blocks) runs=("dspark dspark4 100 30 --config num_layers=4"
                  "mtp mtp2 130 20 --config num_layers=2 --config intermediate_size=768") ;;
    wide)   runs=("dspark dspark_d50 77 30 --config anchor_density=0.5"
                  "mtp mtpw 70 20 --config intermediate_size=768") ;;
    *) echo "mode: expected blocks or wide, got $mode" >&2; exit 2 ;;
esac
read -r kind out rest <<< "${runs[0]}"
train "$kind" "$work/$out" $rest &
while [ ! -f "$work/cache2.pt" ]; do sleep 10; done  # the first run makes the shared cache
read -r kind out rest <<< "${runs[1]}"
train "$kind" "$work/$out" $rest &
wait
grep -h '"stopped"' "$work"/*.log || true
