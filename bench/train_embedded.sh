#!/usr/bin/env bash
# Reproduce the embedded default model and its drafters (CPU). Usage: bash bench/train_embedded.sh [MINUTES] [DRAFTER_STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-55}
drafter_steps=${2:-600}
out=specdec/embedded
python -m specdec.train_embedded --out "$out" --prompts bench/data/prompts.jsonl --minutes "$minutes" \
    --batch-size 8 --threads 2 --val-every 200
mkdir -p "$out/drafters"
corpus=$(mktemp --suffix=.txt)
python -m specdec.train_embedded --dump-corpus "$corpus" --corpus-mb 4
for d in mtp eagle dspark; do
    OMP_NUM_THREADS=1 python -m specdec.draft.train --target "$out" --drafter "$d" --data "$corpus" --out "$out/drafters/$d" \
        --steps "$drafter_steps" --lr 3e-3 --seq-len 128 --batch-size 8 --val-every 100 > "$out/drafters/$d.log" 2>&1 &
done
wait
# mtp and dspark were still improving: continue them from their weights on other windows (--seed 1)
for d in mtp dspark; do
    OMP_NUM_THREADS=1 python -m specdec.draft.train --target "$out" --drafter "$d" --data "$corpus" --out "$out/drafters/$d" \
        --init "$out/drafters/$d" --steps 800 --lr 2e-3 --seq-len 128 --batch-size 8 --val-every 200 --seed 1 \
        > "$out/drafters/$d.2.log" 2>&1 &
done
wait
tail -n 1 "$out"/drafters/*.log
