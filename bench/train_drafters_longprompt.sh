#!/usr/bin/env bash
# MTP and DSpark continued on a self-distilled corpus of long prompts (CPU, two jobs at a time).
# Usage: bash bench/train_drafters_longprompt.sh [WORK_DIR] [INIT_MODEL_DIR]   (CORPUS_ONLY=1: build the corpus, stop)
#   INIT_MODEL_DIR: where the drafters to continue live (default specdec/embedded; the run recorded in
#   bench/results/HISTORY.md, "Self-distilled corpus of long prompts", started from the drafters of commit 610d492:
#   `git archive 610d492 specdec/embedded | tar -x -C DIR` gives them in DIR/specdec/embedded).
# The corpus: the embedded target's greedy continuations (128 new tokens) of 128-token prompts drawn from its
# training text, as the benchmark's code prompts are continued (bench/accept_rate.py: a few hundred tokens of real
# code, then the target's own greedy text). Plain decoding writes it (`--drafter none`: at batch 32 on a CPU a verify
# is compute-bound, so plain decoding is the faster way to the same tokens). Training uses two parts of 768
# prompts (MTP was stopped at step 900 there, to free a core; run to patience it may keep a later checkpoint than the
# shipped step 800). Every run keeps its best validation checkpoint; the results land in WORK_DIR/{mtp,dspark}, and
# bench/accept_rate.py --model ... --kinds code decides what ships. (A second phase on twice the corpus, from these
# checkpoints, did not improve validation or the benchmark: bench/results/HISTORY.md.)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/specdec_longprompt}
init=${2:-specdec/embedded}
mkdir -p "$work"
[ -f "$work/text.txt" ] || python -m specdec train-embedded --dump-corpus "$work/text.txt" --corpus-mb 4

part() {  # one corpus part of 768 prompts (seed $1); resumes when rerun
    OMP_NUM_THREADS=1 python -m specdec draft-data --target specdec/embedded --text "$work/text.txt" \
        --out "$work/corpus_$1.jsonl" --num-prompts 768 --prompt-len 128 --new-tokens 128 --temperatures 0 \
        --batch-size 32 --drafter none --seed "$1" --threads 1 > "$work/corpus_$1.log" 2>&1
}
merge() {  # parts -> one corpus, ids kept distinct (part k: +100000 k)
    python - "$@" <<'PY'
import json, sys
out, parts = sys.argv[1], sys.argv[2:]
with open(out, "w") as f:
    for k, p in enumerate(parts):
        for line in open(p):
            if line.strip():
                r = json.loads(line); r["id"] += 100000 * k; f.write(json.dumps(r) + "\n")
PY
}
train() {  # kind, init dir, out dir, corpus, cache, seed, cached batches, steps
    OMP_NUM_THREADS=1 python -m specdec draft-train --target specdec/embedded --data "$4" --seq-len 128 --batch-size 8 \
        --val-every 50 --val-batches 4 --cache-batches "$7" --cache "$5" --threads 1 --seed "$6" --drafter "$1" \
        --init "$2" --out "$3" --steps "$8" --lr 5e-4 --patience 8 --max-minutes 50 --checkpoint "$3.ckpt" \
        > "$3.log" 2>&1
}
# parts 21 and 22; one cache of target batches (seed 0) serves both kinds
part 21 & part 22 & wait
merge "$work/corpus2.jsonl" "$work/corpus_21.jsonl" "$work/corpus_22.jsonl"
[ "${CORPUS_ONLY:-0}" = 1 ] && exit 0  # the corpus alone (bench/train_drafters_grown.sh trains on it)
train mtp "$init/drafters/mtp" "$work/mtp" "$work/corpus2.jsonl" "$work/cache2.pt" 0 250 1500 &
while [ ! -f "$work/cache2.pt" ]; do sleep 10; done
train dspark "$init/drafters/dspark" "$work/dspark" "$work/corpus2.jsonl" "$work/cache2.pt" 0 250 1500 &
wait
grep -h '"tau_best"' "$work"/*.log
