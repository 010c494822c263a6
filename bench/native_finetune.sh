#!/usr/bin/env bash
# A tiny trained Qwen3.5 text model with its native MTP layer, fine-tuned (CPU); what tests/data/qwen35_native ships.
# Usage: bash bench/native_finetune.sh [MODEL_MINUTES] [FINETUNE_MINUTES] [WORK_DIR]
#   1. python -m specdec train-embedded --family qwen3_5: the embedded model's corpus (CPython stdlib) and tokenizer,
#      ~1.4M parameters (hidden 128, 3 Gated DeltaNet + 1 gated attention layer, tied embeddings), saved in bf16 with
#      one freshly initialized MTP layer under the published names (mtp.*);
#   2. python -m specdec draft-train --drafter native: distils the MTP layer from the target on the training text
#      (best checkpoint by validation tau), then python -m specdec native-export writes it back into the checkpoint;
#   3. bench/accept_rate.py --drafters native (greedy, gamma 7, checked lossless) before and after.
# Every step keeps a resumable state in WORK_DIR and is skipped when its output exists: rerun the script to resume.
set -euo pipefail
cd "$(dirname "$0")/.."
model_minutes=${1:-30}
finetune_minutes=${2:-18}
work=${3:-/tmp/specdec_native}
ship=tests/data/qwen35_native
export OMP_NUM_THREADS=1
mkdir -p "$work"
if [ ! -f "$work/model/model.safetensors" ]; then
    python -m specdec train-embedded --family qwen3_5 --tokenizer specdec/embedded --out "$work/model" --prompts "" \
        --minutes "$model_minutes" --batch-size 8 --lr 3e-3 --val-every 100 --threads 1 \
        --checkpoint "$work/model.ckpt" 2>&1 | tee -a "$work/model.log"
fi
[ -f "$work/text.txt" ] || python -m specdec train-embedded --dump-corpus "$work/text.txt" --corpus-mb 4
accept=(--drafters native --kinds code,prose --threads 1 --max-new-tokens 64)
[ -f "$work/accept_before.json" ] || python bench/accept_rate.py --model "$work/model" "${accept[@]}" \
    --json "$work/accept_before.json" | tee "$work/accept_before.txt"
if [ ! -f "$work/model_ft/model.safetensors" ]; then
    python -m specdec draft-train --target "$work/model" --drafter native --data "$work/text.txt" --out "$work/native" \
        --config train_depth=3 --config eval_depth=7 --seq-len 128 --batch-size 8 --steps 1000 --lr 3e-3 \
        --val-every 100 --val-batches 4 --cache-batches 150 --cache "$work/target_cache.pt" --patience 6 \
        --max-minutes "$finetune_minutes" --checkpoint "$work/native.ckpt" --threads 1 2>&1 | tee -a "$work/native.log"
    python -m specdec native-export --target "$work/model" --drafter "$work/native" --out "$work/model_ft"
fi
[ -f "$work/accept_after.json" ] || python bench/accept_rate.py --model "$work/model_ft" "${accept[@]}" \
    --json "$work/accept_after.json" | tee "$work/accept_after.txt"
mkdir -p "$ship"
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json training.json; do
    cp "$work/model_ft/$f" "$ship/$f"
done
echo "shipped $ship ($(du -sh "$ship" | cut -f1)); tau before/after: $work/accept_before.txt, $work/accept_after.txt"
