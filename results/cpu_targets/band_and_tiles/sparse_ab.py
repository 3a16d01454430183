"""Longformer (window 256, 1 global token) and strided (stride 128) on the CPU: the band on the band kernel and
the rest on the tiled kernel (``attention_zoo.sparse.band_and_tiles``, what the blocked path runs now) against the
whole pattern on the tiled kernel (the pattern's ``tiles`` layout, what it ran before), in one process,
interleaved round by round (6 rounds after a warm-up): fwd + bwd, B = 1, H = 8, D = 64, float32, one thread.
Longformer's window of 256 sees 257 keys a query, the setting of ``zoo targets``' local row.

    python -m results.cpu_targets.band_and_tiles.sparse_ab longformer 4096
"""

import sys

import torch

import attention_zoo as az
from attention_zoo.sparse.tiled import tiled_attention
from results.ab_timing import fwd_bwd, inputs, interleaved, largest_difference

torch.set_num_threads(1)
name, n = sys.argv[1], int(sys.argv[2])
options = {"longformer": {"window": 256, "global_tokens": 1}, "strided": {"stride": 128}}[name]
registered = "longformer" if name == "longformer" else "sparse"
extra = {} if name == "longformer" else {"pattern": "strided"}
core = az.create_attention(registered, dim_head=64, heads=8, max_seq_len=n, **extra, **options)
q, k, v, grad = inputs(n)
pattern = core.pattern
whole = pattern.tiles(pattern.mask_mod(n, False, q.device), n, False, q.device)
variants = {
    "band + tiles": fwd_bwd(lambda: core(q, k, v), grad, q, k, v),
    "tiles": fwd_bwd(lambda: tiled_attention(q, k, v, whole, None, core.scale), grad, q, k, v),
}
gap = largest_difference(*(step() for step in variants.values()))
timings = interleaved(variants, 6)
parts = [f"{label} {timing.text(faults=False)}" for label, timing in timings.items()]
print(f"{name} {options} n={n}: " + "; ".join(parts) + f"; largest difference {gap:.1e}")
