#!/usr/bin/env bash
# Every speedup and scaling target of zoo targets, interleaved, with paired intervals (experiments/bench/paired_ratio.py);
# the causal speedups twice, a few minutes apart.
set -euo pipefail
cd "$(dirname "$0")"
export PYTHONPATH="$(git rev-parse --show-toplevel)${PYTHONPATH:+:$PYTHONPATH}"
run() { python -m experiments.bench.paired_ratio "$@"; }
MOBA=moba:block_size=128,top_k=4
CAUSAL=$MOBA,performer:nb_features=256,linear
run --causal --rounds 20 --blocks 4 --attentions $CAUSAL --out speed_causal.csv | tee speed_causal.txt
run --rounds 12 --blocks 4 --attentions linformer:k=256,nystrom:num_landmarks=64,local:window=256,lsh:n_hashes=4,bucket_size=64,$MOBA,performer:nb_features=256,linear,cosformer --out speed.csv | tee speed.txt
run --scaling --causal --rounds 12 --blocks 4 --attentions $CAUSAL --out scaling_causal.csv | tee scaling_causal.txt
run --scaling --rounds 12 --blocks 4 --attentions linformer:k=256,nystrom:num_landmarks=64,local:window=256,$MOBA,performer:nb_features=256,linear,cosformer --out scaling.csv | tee scaling.txt
run --causal --rounds 20 --blocks 4 --attentions $CAUSAL --out speed_causal_again.csv | tee speed_causal_again.txt
