"""Time of MoBA's gate alone (``select_blocks``: the scores of every query against every block mean, masked, and
their top-k), causal, block 128, top-k 4, B = 1, H = 8, D = 64, float32, one thread, minimum of 7 calls.

    python results/cpu_targets/moba_flash/gate.py
"""

import time

import torch
from einops import reduce

import attention_zoo as az

torch.set_num_threads(1)
for n in (2048, 4096, 8192):
    core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 8, n, 64, generator=generator) for _ in range(2))
    sums = reduce(k, "b h (g j) d -> b h g d", "sum", j=128)
    counts = torch.full((1, n // 128), 128.0)
    seconds = []
    for _ in range(7):
        start = time.perf_counter()
        core.select_blocks(q, sums, counts, offset=0, causal=True)
        seconds.append(time.perf_counter() - start)
    print(f"n={n}: gate {min(seconds) * 1e3:.1f} ms")
