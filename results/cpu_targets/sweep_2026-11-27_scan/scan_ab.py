"""The kernel family's causal product before (508bbc6: three backward scans, each with its own blocks and
state) and after (the two anti-causal scans share one state and their blocks; the forward's blocks kept), in
one process, interleaved round by round: fwd + bwd, B = 1, H = 8, D = 64, float32, one thread.

    python results/cpu_targets/sweep_2026-11-27_scan/scan_ab.py linear 4096
"""

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import attention_zoo as az
import attention_zoo.kernel.attention as kernel_attention

BEFORE = "508bbc6"
source = subprocess.run(
    ["git", "show", f"{BEFORE}:attention_zoo/kernel/products.py"], capture_output=True, text=True, check=True
).stdout
path = Path(tempfile.mkdtemp()) / "kernel_products_before.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("kernel_products_before", path)
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

torch.set_num_threads(1)
name, n = sys.argv[1], int(sys.argv[2])
core = az.create_attention(name, dim_head=64, heads=8, max_seq_len=n)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)
variants = {"before": before.CausalProduct, "after": kernel_attention.CausalProduct}


def step() -> None:
    core(q, k, v, causal=True).backward(grad)
    q.grad = k.grad = v.grad = None


times = {label: [] for label in variants}
for round_ in range(9):
    for label, product in variants.items():
        kernel_attention.CausalProduct = product
        start = time.perf_counter()
        step()
        if round_:  # the first round warms up
            times[label].append(time.perf_counter() - start)
summary = ", ".join(f"{label} min {min(t) * 1e3:.1f} median {sorted(t)[4] * 1e3:.1f} ms" for label, t in times.items())
print(f"{name} n={n}: {summary}")
