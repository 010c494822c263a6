#!/usr/bin/env bash
# Drafters grown from the shipped ones and continued on the self-distilled corpus of long prompts (CPU, two jobs at
# a time). `--init DIR --config ...` grows a drafter (new blocks start as identity blocks, wider MLPs with zero
# output weights: `specdec.draft.registry.grown_state_dict`), so training starts from the shipped drafter's function.
#   blocks (default): DSpark from 2 to 4 target-sized blocks (the reference recipe uses 5 for a 36-layer target);
#           MTP from one block with a 256-wide MLP to 2 blocks of the target's MLP width (768). Not shipped: the
#           deeper MTP is slower end to end, DSpark barely gained (bench/results/HISTORY.md, "The grown drafters run
#           to a longer patience").
#   wide:   MTP as one block with its MLP grown from 256 to 768 units; DSpark the same net trained at 64 blocks per
#           128-token window instead of 16 (`anchor_density=0.5`: four times the first-slot examples a step). The
#           shipped mtp and dspark (bench/results/HISTORY.md, "2026-12-02"), started from the drafters of commit
#           b3b4bfc: `git archive b3b4bfc specdec/embedded | tar -x -C DIR` gives them in DIR/specdec/embedded.
#   long:   DSpark on longer windows, in two phases (one job): 256-token windows with a 248-key context window
#           (`context_window`), lr 5e-4, stopped at step 1250; from those weights, 512-token windows with a 504-key
#           window, lr 3e-4, stopped at step 815. Trained on 128-token windows, DSpark never saw a target feature
#           past position 127 nor a context key farther back than 121, while the benchmark drafts at positions up to
#           ~500. The shipped dspark (bench/results/HISTORY.md, "2026-12-02, later"), started from the dspark of
#           commit 652ae10 (`git archive 652ae10 specdec/embedded | tar -x -C DIR`); the end weights of each phase
#           land in WORK_DIR/ds256_1250 and WORK_DIR/ds512_815 (`--stop-at`, `--last`).
#   eagle-long: EAGLE on 512-token windows (one phase, one job), lr 3e-4, stopped at step 3000: trained on 128-token
#           windows, its own KV cache never held a position past 127. The shipped eagle (bench/results/HISTORY.md,
#           "2026-12-02, night"), started from the eagle of commit 592b263; end weights in WORK_DIR/eagle512_3000.
#           MTP the same way (lr 3e-4 or 1e-4) lost benchmark tau and was stopped (same section).
# Usage: bash bench/train_drafters_grown.sh [WORK_DIR] [INIT_MODEL_DIR] [blocks|wide|long|eagle-long]
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
    OMP_NUM_THREADS=1 python -m specdec draft-train --target specdec/embedded --data "$work/corpus2.jsonl" \
        --seq-len 128 --batch-size 8 --val-every 50 --val-batches 4 --cache-batches 250 --cache "$work/cache2.pt" \
        --threads 1 --seed 0 --drafter "$kind" --init "$init/drafters/$kind" --out "$out" --steps 4000 \
        --lr 5e-4 --patience "$patience" --max-minutes "$minutes" --checkpoint "$out.ckpt" "$@" > "$out.log" 2>&1
}
if [ "$mode" = long ]; then
    train dspark "$work/ds256" 600 1000 --seq-len 256 --batch-size 4 --val-batches 8 --cache "$work/cache256.pt" \
        --config context_window=248 --stop-at 1250 --last "$work/ds256_1250"
    train dspark "$work/ds512" 600 1000 --init "$work/ds256_1250" --seq-len 512 --batch-size 2 --val-batches 16 \
        --cache "$work/cache512.pt" --config context_window=504 --lr 3e-4 --stop-at 815 --last "$work/ds512_815"
    grep -h '"stopped"' "$work"/ds256.log "$work"/ds512.log
    exit 0
fi
if [ "$mode" = eagle-long ]; then
    train eagle "$work/eagle512" 600 1000 --seq-len 512 --batch-size 2 --val-batches 16 --cache "$work/cache512.pt" \
        --lr 3e-4 --stop-at 3000 --last "$work/eagle512_3000"
    grep -h '"stopped"' "$work"/eagle512.log
    exit 0
fi
# patience and time as in the runs recorded in bench/results/HISTORY.md
case $mode in
    blocks) runs=("dspark dspark4 100 30 --config num_layers=4"
                  "mtp mtp2 130 20 --config num_layers=2 --config intermediate_size=768") ;;
    wide)   runs=("dspark dspark_d50 77 30 --config anchor_density=0.5"
                  "mtp mtpw 70 20 --config intermediate_size=768") ;;
    *) echo "mode: expected blocks, wide, long or eagle-long, got $mode" >&2; exit 2 ;;
esac
read -r kind out rest <<< "${runs[0]}"
train "$kind" "$work/$out" $rest &
while [ ! -f "$work/cache2.pt" ]; do sleep 10; done  # the first run makes the shared cache
read -r kind out rest <<< "${runs[1]}"
train "$kind" "$work/$out" $rest &
wait
grep -h '"stopped"' "$work"/*.log || true
