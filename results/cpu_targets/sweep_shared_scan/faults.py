"""Minor page faults (first touches of freshly mapped memory) and time of each fwd + bwd step, causal or not,
B = 1, H = 8, D = 64, float32, one thread, after one warm-up step.

    python -m results.cpu_targets.sweep_shared_scan.faults cosformer 8192 [causal]
"""

import sys
import time

import torch

import attention_zoo as az
from results.ab_timing import fwd_bwd, inputs, minor_faults

torch.set_num_threads(1)
name, n, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["causal"]
options = {"block_size": 128, "top_k": 4} if name == "moba" else {}
core = az.create_attention(name, dim_head=64, heads=8, max_seq_len=n, **options)
q, k, v, grad = inputs(n)
step = fwd_bwd(lambda: core(q, k, v, causal=causal), grad, q, k, v)

step()
steps = []
for _ in range(6):
    faults, start = minor_faults(), time.perf_counter()
    step()
    seconds, faults = time.perf_counter() - start, minor_faults() - faults
    steps.append(f"{seconds * 1e3:.0f} ms / {faults} faults")
print(f"{name} n={n}{' causal' if causal else ''}: " + ", ".join(steps))
