"""Minor page faults (first touches of freshly mapped memory) and time of each fwd + bwd step, causal or not,
B = 1, H = 8, D = 64, float32, one thread, after one warm-up step.

    python results/cpu_targets/sweep_2026-11-27_scan/faults.py cosformer 8192 [causal]
"""

import resource
import sys
import time

import torch

import attention_zoo as az

torch.set_num_threads(1)
name, n, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["causal"]
options = {"block_size": 128, "top_k": 4} if name == "moba" else {}
core = az.create_attention(name, dim_head=64, heads=8, max_seq_len=n, **options)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)


def step() -> None:
    core(q, k, v, causal=causal).backward(grad)
    q.grad = k.grad = v.grad = None


step()
steps = []
for _ in range(6):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    step()
    seconds, faults = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    steps.append(f"{seconds * 1e3:.0f} ms / {faults} faults")
print(f"{name} n={n}{' causal' if causal else ''}: " + ", ".join(steps))
