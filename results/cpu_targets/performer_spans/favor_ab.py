"""Causal Performer (m = 256) with its feature maps made one span at a time (``kernel_causal_favor``) against the
previous path (the whole (n, m) maps, then ``CausalProduct``), and full attention, in one process, interleaved
round by round: fwd + bwd, B = 1, H = 8, D = 64, float32, one thread. Minor page faults per step from getrusage.

    python results/cpu_targets/performer_spans/favor_ab.py 4096
"""

import resource
import sys
import time

import torch

import attention_zoo as az
from attention_zoo.kernel.attention import KernelAttention

torch.set_num_threads(1)
n = int(sys.argv[1])
performer = az.create_attention("performer", dim_head=64, heads=8, nb_features=256, max_seq_len=n)
full = az.create_attention("full", dim_head=64, heads=8, max_seq_len=n)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)
variants = {
    "spans": lambda: performer(q, k, v, causal=True),
    "whole maps": lambda: KernelAttention.attend(performer, q, k, v, mask=None, causal=True),
    "full": lambda: full(q, k, v, causal=True),
}


def step(forward) -> None:
    forward().backward(grad)
    q.grad = k.grad = v.grad = None


times = {label: [] for label in variants}
faults = {label: [] for label in variants}
for round_ in range(9):
    for label, forward in variants.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step(forward)
        elapsed = time.perf_counter() - start
        if round_:  # the first round warms up
            times[label].append(elapsed)
            faults[label].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
parts = [
    f"{label} min {min(t) * 1e3:.1f} median {sorted(t)[4] * 1e3:.1f} ms, faults median {sorted(faults[label])[4]}"
    for label, t in times.items()
]
ratio = lambda label: min(times["full"]) / min(times[label])
print(
    f"n={n}: "
    + "; ".join(parts)
    + f"; speed vs full: spans {ratio('spans'):.2f}x, whole maps {ratio('whole maps'):.2f}x"
)
