"""Longformer (window 256, 1 global token) and strided (stride 128) on the CPU: the band on the band kernel and
the rest on the tiled kernel (``band_and_tiles``, what the blocked path runs now) against the whole pattern on
the tiled kernel (the pattern's ``tiles`` layout, what it ran before), in one process, interleaved round by
round: fwd + bwd, B = 1, H = 8, D = 64, float32, one thread. Longformer's window of 256 sees 257 keys a query,
the setting of ``zoo targets``' local row.

    python results/cpu_targets/band_and_tiles/sparse_ab.py longformer 4096
"""

import sys
import time

import torch

import attention_zoo as az
from attention_zoo.sparse.tiled import tiled_attention

torch.set_num_threads(1)
name, n = sys.argv[1], int(sys.argv[2])
options = {"longformer": {"window": 256, "global_tokens": 1}, "strided": {"stride": 128}}[name]
registered = "longformer" if name == "longformer" else "sparse"
extra = {} if name == "longformer" else {"pattern": "strided"}
core = az.create_attention(registered, dim_head=64, heads=8, max_seq_len=n, **extra, **options)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)
pattern, device = core.pattern, q.device
whole = pattern.tiles(pattern.mask_mod(n, False, device), n, False, device)
variants = {
    "band + tiles": lambda: core(q, k, v),
    "tiles": lambda: tiled_attention(q, k, v, whole, None, core.scale),
}
times, outputs = {label: [] for label in variants}, {}
for round_ in range(7):
    for label, forward in variants.items():
        start = time.perf_counter()
        out = forward()
        out.backward(grad)
        elapsed = time.perf_counter() - start
        outputs[label] = (out.detach(), q.grad, k.grad, v.grad)
        q.grad = k.grad = v.grad = None
        if round_:
            times[label].append(elapsed)
gap = max((a - b).abs().max().item() for a, b in zip(*outputs.values(), strict=True))
parts = [f"{label} min {min(t) * 1e3:.1f} median {sorted(t)[3] * 1e3:.1f} ms" for label, t in times.items()]
print(f"{name} {options} n={n}: " + "; ".join(parts) + f"; largest difference {gap:.1e}")
