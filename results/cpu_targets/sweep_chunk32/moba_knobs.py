"""Causal MoBA's products kernel (n = 4096, block 128, top-k 4, fwd + bwd, one thread; the kernel the CPU ran
when this was measured, ``attention_zoo.moba.tiled.MobaAttention``): its constants, interleaved, 6 rounds. The
batch fill (``_BATCH_FILL``, 0.7 and 0.95 in ``moba_knobs.txt``) is gone from the kernel (the layout's one sort
has no fill), so its two variants are not run.

    python -m results.cpu_targets.sweep_chunk32.moba_knobs
"""

import torch

import attention_zoo as az
from attention_zoo.moba import tiled as moba_kernel
from experiments.bench.paired_ratio import interleaved_seconds
from results.ab_timing import inputs

torch.set_num_threads(1)
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=4096, block_size=128, top_k=4)
q, k, v, grad = inputs(4096)
moba_kernel._FLASH_DEVICES = ()
variants = [{}, {"_CHUNK_ELEMENTS": 1 << 18}, {"_CHUNK_ELEMENTS": 1 << 20}, {"_CAUSAL_SLABS": 2}, {"_CAUSAL_SLABS": 8}]
defaults = {name: getattr(moba_kernel, name) for name in ("_CHUNK_ELEMENTS", "_CAUSAL_SLABS")}


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
