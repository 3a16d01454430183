#!/usr/bin/env bash
# The rows run.sh left inconclusive, with twice the rounds and blocks (experiments/bench/paired_ratio.py).
set -euo pipefail
cd "$(dirname "$0")"
export PYTHONPATH="$(git rev-parse --show-toplevel)${PYTHONPATH:+:$PYTHONPATH}"
run() { python -m experiments.bench.paired_ratio "$@"; }
run --causal --rounds 24 --blocks 8 --attentions moba:block_size=128,top_k=4 --out longer_speed_causal.csv | tee longer_speed_causal.txt
run --rounds 24 --blocks 8 --attentions performer:nb_features=256 --out longer_speed.csv | tee longer_speed.txt
run --scaling --rounds 24 --blocks 8 --attentions local:window=256,linear --out longer_scaling.csv | tee longer_scaling.txt
run --scaling --causal --rounds 24 --blocks 8 --attentions linear --out longer_scaling_causal.csv | tee longer_scaling_causal.txt
