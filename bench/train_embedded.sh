#!/usr/bin/env bash
# Reproduce the embedded default model and its drafters (CPU).
# Usage: bash bench/train_embedded.sh [MODEL_MINUTES] [DRAFTER_MINUTES] [WORK_DIR]
#   MODEL_MINUTES=0 keeps the shipped model and retrains only the drafters.
# Drafters (bench/results/HISTORY.md, "Drafters, reference recipe"): a self-distilled corpus (the target's own greedy
# and T=0.8 continuations of prompts drawn from its training text), then dspark from scratch with the reference
# recipe (corpus, then the training text) while mtp and then eagle continue from the shipped weights with their new
# training depths (mtp: 7 chained steps, eagle: 7 training-time-test steps), half of DRAFTER_MINUTES each. Every run keeps its best
# validation checkpoint (per-position teacher-forced acceptance -> tau) and a resumable state in WORK_DIR; rerun
# the script to resume. The results land in WORK_DIR/drafters/*; bench/accept_rate.py decides what ships.
# The shipped mtp and dspark were then continued on a corpus of long prompts: bench/train_drafters_longprompt.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
model_minutes=${1:-55}
drafter_minutes=${2:-55}
work=${3:-/tmp/specdec_drafters}
out=specdec/embedded
mkdir -p "$work/drafters"
if [ "$model_minutes" != 0 ]; then
    python -m specdec train-embedded --out "$out" --prompts bench/data/prompts.jsonl --minutes "$model_minutes" \
        --batch-size 8 --threads 2 --val-every 200
fi
[ -f "$work/text.txt" ] || python -m specdec train-embedded --dump-corpus "$work/text.txt" --corpus-mb 4
# the corpus: stopped after 40 minutes (it resumes where it stopped when rerun); 2 greedy prompts per sampled one
timeout 40m env OMP_NUM_THREADS=1 python -m specdec draft-data --target "$out" --text "$work/text.txt" \
    --out "$work/corpus.jsonl" --num-prompts 3000 --prompt-len 32 --new-tokens 224 --temperatures 0,0,0.8 \
    --batch-size 16 --drafter mtp --threads 1 || true
common=(--target "$out" --data "$work/corpus.jsonl" --seq-len 128 --batch-size 8 --val-every 50 --val-batches 4
        --cache-batches 60 --cache "$work/target_cache.pt" --threads 1)
# dspark: the reference recipe from scratch on the corpus, then continued on the training text itself (the target's
# distributions over real code contexts, which is what the benchmark prompts are: on the corpus alone validation rose
# but accept_rate's tau fell, bench/results/HISTORY.md)
(OMP_NUM_THREADS=1 python -m specdec draft-train "${common[@]}" --drafter dspark --out "$work/drafters/dspark1" \
    --steps 800 --lr 2e-3 --patience 6 --max-minutes "$drafter_minutes" --checkpoint "$work/dspark1.ckpt" \
    > "$work/dspark1.log" 2>&1
 OMP_NUM_THREADS=1 python -m specdec draft-train --target "$out" --data "$work/text.txt" --seq-len 128 --batch-size 8 \
    --val-every 50 --val-batches 4 --cache-batches 150 --cache "$work/target_cache_text.pt" --threads 1 \
    --drafter dspark --init "$work/drafters/dspark1" --out "$work/drafters/dspark" --steps 1200 --lr 1e-3 \
    --patience 8 --max-minutes "$drafter_minutes" --checkpoint "$work/dspark.ckpt" > "$work/dspark.log" 2>&1) &
while [ ! -f "$work/target_cache.pt" ]; do sleep 10; done  # one cache of target batches serves every kind
half=$((drafter_minutes / 2))
OMP_NUM_THREADS=1 python -m specdec draft-train "${common[@]}" --drafter mtp --out "$work/drafters/mtp" \
    --init "$out/drafters/mtp" --config train_depth=7 --config eval_depth=7 --steps 400 --lr 1e-3 --patience 4 \
    --max-minutes "$half" --checkpoint "$work/mtp.ckpt" > "$work/mtp.log" 2>&1
OMP_NUM_THREADS=1 python -m specdec draft-train "${common[@]}" --drafter eagle --out "$work/drafters/eagle" \
    --init "$out/drafters/eagle" --config ttt_steps=6 --steps 400 --lr 1e-3 --patience 4 \
    --max-minutes "$half" --checkpoint "$work/eagle.ckpt" > "$work/eagle.log" 2>&1
wait
# the shipped dspark's validation on the same windows (its step-0 entry), for the before/after table
python -m specdec draft-train "${common[@]}" --drafter dspark --init "$out/drafters/dspark" --steps 0 \
    --out "$work/drafters/dspark_shipped_val" > "$work/dspark_shipped_val.log" 2>&1
grep -h '"tau_best"' "$work"/*.log
# ship a drafter only when it beats the shipped one on validation and on
#   python bench/accept_rate.py --model embedded --kinds code --threads 1   (greedy, gamma 7)
