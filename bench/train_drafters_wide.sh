#!/usr/bin/env bash
# MTP with a wider MLP and DSpark at four times the anchors, continued on the self-distilled corpus of long prompts
# (CPU, two jobs at a time; bench/RESULTS.md, "2026-12-02").
#   mtp:    one block as before, its MLP grown from 256 to 768 units (`--config intermediate_size=768`: the old units
#           first, zero output weights for the new ones, so training starts from the shipped head's function);
#   dspark: the same net, 64 training blocks per 128-token window instead of 16 (`--config anchor_density=0.5`):
#           four times the first-slot examples a step.
# Usage: bash bench/train_drafters_wide.sh [WORK_DIR] [INIT_MODEL_DIR]
#   INIT_MODEL_DIR: where the drafters to continue live. The recorded run started from those of commit b3b4bfc:
#   `git archive b3b4bfc specdec/embedded | tar -x -C DIR` gives them in DIR/specdec/embedded.
#   WORK_DIR holds (or gets) the corpus of bench/train_drafters_longprompt.sh (corpus2.jsonl; cache2.pt shared).
# Every run keeps its best validation checkpoint in WORK_DIR/{mtpw,dspark_d50}; bench/accept_rate.py --model COPY
# --kinds code (COPY: the embedded model with a candidate under drafters/) decides what ships.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/specdec_longprompt}
init=${2:-specdec/embedded}
CORPUS_ONLY=1 bash bench/train_drafters_longprompt.sh "$work"
train() {  # kind, out dir, minutes, patience, config overrides...
    local kind=$1 out=$2 minutes=$3 patience=$4; shift 4
    OMP_NUM_THREADS=1 python -m specdec.draft.train --target specdec/embedded --data "$work/corpus2.jsonl" \
        --seq-len 128 --batch-size 8 --val-every 50 --val-batches 4 --cache-batches 250 --cache "$work/cache2.pt" \
        --threads 1 --seed 0 --drafter "$kind" --init "$init/drafters/$kind" "$@" --out "$out" --steps 4000 \
        --lr 5e-4 --patience "$patience" --max-minutes "$minutes" --checkpoint "$out.ckpt" > "$out.log" 2>&1
}
train dspark "$work/dspark_d50" 77 30 --config anchor_density=0.5 &
while [ ! -f "$work/cache2.pt" ]; do sleep 10; done
train mtp "$work/mtpw" 70 20 --config intermediate_size=768 &
wait
grep -h '"stopped"' "$work"/dspark_d50.log "$work"/mtpw.log || true
