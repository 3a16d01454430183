#!/usr/bin/env bash
# Every arm of messages.yaml, seed by seed (seed 0 of every arm, then seed 1, ...), so an interrupted study has
# whole seed pairs; rerun to resume (finished runs are kept, an interrupted one continues from its checkpoint).
#   bash experiments/studies/translation/run_messages.sh [SEEDS, default 3]
set -euo pipefail
cd "$(dirname "$0")/../../.."
config=experiments/studies/translation/messages.yaml
seeds=${1:-3}
for n in $(seq 1 "$seeds"); do
  zoo compare --config "$config" --seeds "$n" --attentions full --experiment tr-msg-full
  zoo compare --config "$config" --seeds "$n" --attentions linformer:k=4 --experiment tr-msg-linformer-k4 \
    -- --model.decoder_attention_options '{block_size: 4, block_k: 1}'
  zoo compare --config "$config" --seeds "$n" --attentions linformer:k=4 --experiment tr-msg-linformer-k4-encoder \
    -- --model.decoder_attention full
done
