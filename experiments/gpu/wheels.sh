#!/usr/bin/env bash
# Download, on a machine with network access, the wheels that a GPU machine without network access lacks, into
# the git-ignored folder .whl/, to be copied there with the checkout. The GPU machines of results/gpu-h100/
# and gpu-h200/ had Python 3.12, torch 2.11 + CUDA 13, lightning, einops, tensorboard, torchmetrics, rich, sacrebleu,
# tokenizers, matplotlib, scipy, transformers, pytest and hypothesis (env.json there records torch's, triton's and
# lightning's versions); they lacked jsonargparse (LightningCLI, zoo compare) with its signature extras. `datasets`
# is not fetched: nothing in the GPU suite reads Hugging Face datasets.
# No xformers: on PyPI, 0.0.35 is the newest (it declares torch >= 2.10), but its C++/CUDA extensions were
# built for torch 2.10.0+cu128 and Python 3.10; on the H200's torch 2.11.0+cu130 / Python 3.12 they do not
# load, and memory_efficient_attention finds no operator (results/gpu-h200/cuda_marked.log).
# 0.0.34 pins torch 2.10.0.
#
#   bash experiments/gpu/wheels.sh
#
# On the GPU machine, never replacing its torch:
#   SITE=$(mktemp -d)
#   python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
#   export PYTHONPATH="$SITE:$PWD"
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(
    "jsonargparse==4.53.0"
    "docstring-parser==0.18.0"
    "typeshed-client==2.15.0"
)
mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$wheel"
done
ls -l .whl
du -sh .whl
