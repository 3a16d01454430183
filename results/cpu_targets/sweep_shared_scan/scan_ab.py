"""The kernel family's causal product before (508bbc6: three backward scans, each with its own blocks and
state) and after (the two anti-causal scans share one state and their blocks; the forward's blocks kept), in
one process, interleaved round by round (8 rounds after a warm-up): fwd + bwd, B = 1, H = 8, D = 64, float32,
one thread.

    python -m results.cpu_targets.sweep_shared_scan.scan_ab linear 4096
"""

import sys

import torch

import attention_zoo as az
import attention_zoo.kernel.attention as kernel_attention
from results.ab_timing import at_commit, fwd_bwd, inputs, interleaved

BEFORE = "508bbc6"
before = at_commit(BEFORE, "attention_zoo/kernel_products.py", "kernel_products_before")
torch.set_num_threads(1)
name, n = sys.argv[1], int(sys.argv[2])
core = az.create_attention(name, dim_head=64, heads=8, max_seq_len=n)
q, k, v, grad = inputs(n)
step = fwd_bwd(lambda: core(q, k, v, causal=True), grad, q, k, v)


def with_product(product: type):
    def call():
        kernel_attention.CausalProduct = product
        return step()

    return call


timings = interleaved(
    {"before": with_product(before.CausalProduct), "after": with_product(kernel_attention.CausalProduct)}, 8
)
summary = ", ".join(f"{label} {timing.text(faults=False)}" for label, timing in timings.items())
print(f"{name} n={n}: {summary}")
