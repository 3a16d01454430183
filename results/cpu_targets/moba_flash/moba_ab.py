"""MoBA's CPU kernel on torch's flash-attention op (``moba_kernel_flash``) against the products kernel
(``moba_kernel.MobaAttention``, what the CPU ran before and other devices run), in one process, interleaved
round by round: fwd + bwd of the core (gate included), B = 1, H = 8, D = 64, block 128, top-k 4, float32, one
thread. Minor page faults per step from getrusage.

    python results/cpu_targets/moba_flash/moba_ab.py 4096 causal
"""

import resource
import sys
import time

import torch

import attention_zoo as az
from attention_zoo.moba import tiled as moba_kernel

torch.set_num_threads(1)
n, causal = int(sys.argv[1]), sys.argv[2] == "causal"
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)
variants = {"flash op": ("cpu",), "products": ()}

times = {label: [] for label in variants}
faults = {label: [] for label in variants}
outputs = {}
for round_ in range(9):
    for label, devices in variants.items():
        moba_kernel._FLASH_DEVICES = devices
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        out = core(q, k, v, causal=causal)
        out.backward(grad)
        elapsed = time.perf_counter() - start
        outputs[label] = (out.detach(), q.grad, k.grad, v.grad)
        q.grad = k.grad = v.grad = None
        if round_:  # the first round warms up
            times[label].append(elapsed)
            faults[label].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
gap = max((a - b).abs().max().item() for a, b in zip(*outputs.values(), strict=True))
parts = [
    f"{label} min {min(t) * 1e3:.1f} median {sorted(t)[4] * 1e3:.1f} ms, faults median {sorted(faults[label])[4]}"
    for label, t in times.items()
]
print(f"n={n} {'causal' if causal else 'not causal'}: " + "; ".join(parts) + f"; largest difference {gap:.1e}")
