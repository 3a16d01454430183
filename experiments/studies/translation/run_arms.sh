#!/usr/bin/env bash
# Every arm of a translation design (documents.yaml or messages.yaml), seed by seed (seed 0 of every arm, then
# seed 1, ...), so an interrupted study has whole seed pairs; rerun to resume (finished runs are kept, an
# interrupted one continues from its checkpoint). Arms: full; Linformer in the encoder with the decoder rule
# (linformer_causal with the design's blocks); Linformer in the encoder only (decoder full).
#   bash experiments/studies/translation/run_arms.sh documents|messages [SEEDS, default 3]
set -euo pipefail
cd "$(dirname "$0")/../../.."
design=${1:-}
seeds=${2:-3}
case "$design" in
  documents) prefix=tr-doc k=32 blocks='{block_size: 32, block_k: 8}' ;;
  messages) prefix=tr-msg k=4 blocks='{block_size: 4, block_k: 1}' ;;
  *) echo "run_arms.sh: design must be 'documents' or 'messages', got '$design'" >&2; exit 2 ;;
esac
config=configs/studies/translation/$design.yaml
for n in $(seq 1 "$seeds"); do
  zoo compare --config "$config" --seeds "$n" --attentions full --experiment "$prefix-full"
  zoo compare --config "$config" --seeds "$n" --attentions "linformer:k=$k" --experiment "$prefix-linformer-k$k" \
    -- --model.decoder_attention_options "$blocks"
  zoo compare --config "$config" --seeds "$n" --attentions "linformer:k=$k" --experiment "$prefix-linformer-k$k-encoder" \
    -- --model.decoder_attention full
done
