"""Causal MoBA (n = 4096, block 128, top-k 4, fwd + bwd, one thread): its kernel constants, interleaved, 6 rounds.

python results/cpu_targets/sweep_2026-11-27/moba_knobs.py     (from the repository root)
"""

import torch

import attention_zoo as az
from attention_zoo.moba import tiled as moba_kernel
from experiments.bench.paired_ratio import interleaved_seconds

torch.set_num_threads(1)
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=4096, block_size=128, top_k=4)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, 4096, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, 4096, 64, generator=generator)
variants = [{}, {"_CHUNK_ELEMENTS": 1 << 18}, {"_CHUNK_ELEMENTS": 1 << 20}, {"_CAUSAL_SLABS": 2},
            {"_CAUSAL_SLABS": 8}, {"_BATCH_FILL": 0.7}, {"_BATCH_FILL": 0.95}]  # fmt: skip
defaults = {name: getattr(moba_kernel, name) for name in ("_CHUNK_ELEMENTS", "_CAUSAL_SLABS", "_BATCH_FILL")}


def step(variant: dict):
    def call() -> None:
        for name, value in (defaults | variant).items():
            setattr(moba_kernel, name, value)
        core(q, k, v, causal=True).backward(grad)
        q.grad = k.grad = v.grad = None

    return call


seconds = interleaved_seconds([step(variant) for variant in variants], 6)
for variant, times in zip(variants, seconds, strict=True):
    print(variant, round(min(times) * 1e3, 1))
