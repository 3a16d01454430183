"""MoBA's CPU kernel on torch's flash-attention op (``attention_zoo.moba.flash``) against the products kernel
(``attention_zoo.moba.tiled.MobaAttention``, what the CPU ran before and other devices run), in one process,
interleaved round by round (8 rounds after a warm-up): fwd + bwd of the core (gate included), B = 1, H = 8,
D = 64, block 128, top-k 4, float32, one thread. Minor page faults per step from getrusage.

    python -m results.cpu_targets.moba_flash.moba_ab 4096 causal
"""

import sys

import torch

import attention_zoo as az
from attention_zoo.moba import tiled
from results.ab_timing import fwd_bwd, inputs, interleaved, largest_difference

torch.set_num_threads(1)
n, causal = int(sys.argv[1]), sys.argv[2] == "causal"
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
q, k, v, grad = inputs(n)
step = fwd_bwd(lambda: core(q, k, v, causal=causal), grad, q, k, v)


def on(devices: tuple[str, ...]):
    """The step with the flash op used on ``devices`` (none: the products kernel everywhere)."""

    def call():
        tiled._FLASH_DEVICES = devices
        return step()

    return call


variants = {"flash op": on(("cpu",)), "products": on(())}
gap = largest_difference(*(call() for call in variants.values()))
timings = interleaved(variants, 8)
parts = "; ".join(f"{label} {timing.text()}" for label, timing in timings.items())
print(f"n={n} {'causal' if causal else 'not causal'}: {parts}; largest difference {gap:.1e}")
