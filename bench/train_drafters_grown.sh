#!/usr/bin/env bash
# DSpark and MTP grown from the shipped drafters and continued on the self-distilled corpus of long prompts
# (CPU, two jobs at a time). `--init DIR --config num_layers=N` grows a drafter (new blocks start as identity
# blocks, wider MLPs with zero output weights: `specdec.draft.registry.grown_state_dict`), so training starts from
# the shipped drafter's function. DSpark goes from 2 to 4 target-sized blocks (the reference recipe uses 5 for a
# 36-layer target); MTP from one block with a 256-wide MLP to 2 blocks of the target's MLP width (768).
# Usage: bash bench/train_drafters_grown.sh [WORK_DIR] [INIT_MODEL_DIR]
#   WORK_DIR holds (or gets) the corpus of bench/train_drafters_longprompt.sh (corpus2.jsonl; cache2.pt shared).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/specdec_longprompt}
init=${2:-specdec/embedded}
# the corpus of bench/train_drafters_longprompt.sh (resumed or reused when WORK_DIR already holds it)
CORPUS_ONLY=1 bash bench/train_drafters_longprompt.sh "$work"
train() {  # kind, out dir, config overrides...
    local kind=$1 out=$2; shift 2
    OMP_NUM_THREADS=1 python -m specdec.draft.train --target specdec/embedded --data "$work/corpus2.jsonl" \
        --seq-len 128 --batch-size 8 --val-every 50 --val-batches 4 --cache-batches 250 --cache "$work/cache2.pt" \
        --threads 1 --seed 0 --drafter "$kind" --init "$init/drafters/$kind" "$@" --out "$out" --steps 4000 \
        --lr 5e-4 --checkpoint "$out.ckpt" > "$out.log" 2>&1
}
# patience and time as in the runs recorded in bench/RESULTS.md ("The grown drafters run to a longer patience");
# the benchmark, not validation, decides what ships (bench/accept_rate.py --model COPY --kinds code)
train dspark "$work/dspark4" --config num_layers=4 --patience 30 --max-minutes 100 &
while [ ! -f "$work/cache2.pt" ]; do sleep 10; done
train mtp "$work/mtp2" --config num_layers=2 --config intermediate_size=768 --patience 20 --max-minutes 130 &
wait
grep -h '"tau_best"' "$work"/dspark4.log "$work"/mtp2.log
