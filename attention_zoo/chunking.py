"""Chunk sizes by device, for the cores that loop over blocks of their work in Python.

Nystrom's softmax products (:mod:`attention_zoo.nystrom.attention`), Reformer's LSH kernel
(:mod:`attention_zoo.lsh.chunked`), MoBA's gate (:mod:`attention_zoo.moba.attention`) and the tiled block-sparse kernel
(:mod:`attention_zoo.sparse.tiled`, which MoBA and the sparse family's ``impl="blocked"`` share) cut their
work into chunks of a fixed number of elements. Those numbers were chosen for a CPU: a chunk's temporaries
(about 1-2 MB) stay in its L2 cache and the allocator reuses them instead of faulting fresh pages. On a GPU
the same chunks turn the loop into thousands of tiny kernel launches, and the time goes to launching, not
computing. :func:`chunk_elements` keeps each site's CPU value on the CPU, unchanged, and gives every other
device (CUDA, and the other accelerators alike) one much larger budget, :data:`ACCELERATOR_ELEMENTS`.

The choice of ``1 << 26`` elements (256 MiB per float32 temporary): large enough that one chunk holds
every (batch, head) of the benchmark shapes (B = 8, H = 8, d = 64) in Nystrom's products up to n = 16384
with 64 landmarks, that the LSH kernel needs only a few blocks per hash round there (its rounds are
separate blocks by construction), and that MoBA's gate and the tiled kernel need one or a few chunks per
tile group; small enough that a chunk's handful of temporaries stays at a few GB, well below the memory
of an 80 GB GPU at those shapes, next to the O(n) tensors the cores keep anyway. A site's chunk is a
budget for its largest temporary; each site's comment says what it counts.

The budget is a constant, not a fraction of the free memory: the chunk plan (and with it which kernels
run, hence the last bits of a result) then depends only on the shapes and the device type, not on what
else holds memory on the GPU at the time, and asking for the free memory costs a device synchronisation
per call. A card too small for a few GB of temporaries is not a target of these cores.
"""

from __future__ import annotations

import torch

#: elements per chunk on any device that is not the CPU (see the module docstring)
ACCELERATOR_ELEMENTS = 1 << 26


def chunk_elements(device: torch.device, cpu: int) -> int:
    """The chunk budget, in elements, for work on ``device``: ``cpu`` (the site's cache-sized value) on the
    CPU, else :data:`ACCELERATOR_ELEMENTS` (or ``cpu`` if that is larger)."""
    return cpu if torch.device(device).type == "cpu" else max(cpu, ACCELERATOR_ELEMENTS)
