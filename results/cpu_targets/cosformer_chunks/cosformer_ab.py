"""Non-causal cosFormer with its (n, 2d) feature maps made one chunk of positions at a time
(``cosformer.ChunkedCosformer``) against the whole maps (``KernelAttention``'s path), in one process, interleaved
round by round: fwd + bwd, B = 1, H = 8, D = 64, float32, one thread. Minor page faults per step from getrusage.

    python results/cpu_targets/cosformer_chunks/cosformer_ab.py 8192
"""

import resource
import sys
import time

import torch

import attention_zoo as az
from attention_zoo.kernel.attention import KernelAttention

torch.set_num_threads(1)
n = int(sys.argv[1])
core = az.create_attention("cosformer", dim_head=64, heads=8, max_seq_len=n)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)
variants = {
    "chunks": lambda: core(q, k, v),
    "whole maps": lambda: KernelAttention.attend(core, q, k, v, mask=None, causal=False),
}

times = {label: [] for label in variants}
faults = {label: [] for label in variants}
for round_ in range(9):
    for label, forward in variants.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        forward().backward(grad)
        elapsed = time.perf_counter() - start
        q.grad = k.grad = v.grad = None
        if round_:  # the first round warms up
            times[label].append(elapsed)
            faults[label].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
parts = [
    f"{label} min {min(t) * 1e3:.1f} median {sorted(t)[4] * 1e3:.1f} ms, faults median {sorted(faults[label])[4]}"
    for label, t in times.items()
]
print(f"n={n}: " + "; ".join(parts))
