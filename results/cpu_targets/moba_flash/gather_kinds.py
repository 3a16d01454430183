"""The row gather that MoBA's CPU kernel makes per batch (1,470 sorted rows of 64 floats from a (32768, 64)
tensor, as at n = 4096, block 128, top-k 4, causal), by five kinds of gather, one thread: microseconds per gather,
each after a pass over 32 MiB that evicts the caches (the kernel's own work does between its gathers), and from
cache.

    python results/cpu_targets/moba_flash/gather_kinds.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
generator = torch.Generator().manual_seed(0)
source = torch.randn(32768, 64)
evict = torch.randn(8 * 2**20)
row_sets = [torch.randperm(32768, generator=generator)[:1470].sort().values for _ in range(20)]
buffer = torch.empty(1470, 64)
kinds = {
    "index_select": lambda rows: source.index_select(0, rows),
    "index_select out=": lambda rows: torch.index_select(source, 0, rows, out=buffer),
    "source[rows]": lambda rows: source[rows],
    "F.embedding": lambda rows: F.embedding(rows, source),
    "gather": lambda rows: torch.gather(source, 0, rows[:, None].expand(-1, 64)),
}
for name, gather in kinds.items():
    passes = []
    for _ in range(3):
        seconds = 0.0
        for rows in row_sets:
            evict.add_(1.0)
            start = time.perf_counter()
            gather(rows)
            seconds += time.perf_counter() - start
        passes.append(seconds / len(row_sets))
    cached = []
    for rows in row_sets:
        gather(rows)
        start = time.perf_counter()
        gather(rows)
        cached.append(time.perf_counter() - start)
    print(f"{name:18s} {min(passes) * 1e6:6.1f} us after eviction, {min(cached) * 1e6:5.1f} us from cache")
