"""Non-causal cosFormer with its (n, 2d) feature maps made one chunk of positions at a time
(``attention_zoo.kernel.cosformer.ChunkedCosformer``) against the whole maps (``KernelAttention``'s path), in one
process, interleaved round by round (8 rounds after a warm-up): fwd + bwd, B = 1, H = 8, D = 64, float32, one
thread. Minor page faults per step from getrusage.

    python -m results.cpu_targets.cosformer_chunks.cosformer_ab 8192
"""

import sys

import torch

import attention_zoo as az
from attention_zoo.kernel.attention import KernelAttention
from results.ab_timing import fwd_bwd, inputs, interleaved

torch.set_num_threads(1)
n = int(sys.argv[1])
core = az.create_attention("cosformer", dim_head=64, heads=8, max_seq_len=n)
q, k, v, grad = inputs(n)
variants = {
    "chunks": lambda: core(q, k, v),
    "whole maps": lambda: KernelAttention.attend(core, q, k, v, mask=None, causal=False),
}
timings = interleaved({label: fwd_bwd(forward, grad, q, k, v) for label, forward in variants.items()}, 8)
print(f"n={n}: " + "; ".join(f"{label} {timing.text()}" for label, timing in timings.items()))
