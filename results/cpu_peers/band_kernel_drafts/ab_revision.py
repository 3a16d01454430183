"""A/B of the band kernel against its version at a git revision, in one process, interleaved rounds.

    python -m results.cpu_peers.band_kernel_drafts.ab_revision 8cf3cd2 \
        > results/cpu_peers/band_kernel_drafts/ab_softmax.jsonl

B = 1, H = 8, D = 64, float32, one thread, forward + backward, non-causal, the tile the `local` core picks;
minimum over the rounds of each. The revision must hold the kernel as ``attention_zoo/band_attention.py``, its
file before it moved to ``attention_zoo/sparse/band.py``.
"""

import json
import sys

import torch

from attention_zoo.sparse import band as band_attention
from attention_zoo.sparse.patterns import LocalPattern
from experiments.bench.paired_ratio import interleaved_seconds
from results.ab_timing import at_commit

revision = sys.argv[1]
then = at_commit(revision, "attention_zoo/band_attention.py", "band_attention_then")
torch.set_num_threads(1)
for n in (2048, 4096):
    for window in (192, 384, 768):
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
        picked = LocalPattern(window=window).band(causal=False)

        def step(module, band, q=q, k=k, v=v):
            def call():
                module.band_attention(q, k, v, band, None, 0.125).sum().backward()
                q.grad = k.grad = v.grad = None

            return call

        bands = (then.Band(picked.before, picked.after, picked.tile), picked)
        seconds = interleaved_seconds([step(then, bands[0]), step(band_attention, bands[1])], 7)
        then_ms, now_ms = (min(times) * 1e3 for times in seconds)
        case = {"n": n, "window": window, "tile": picked.tile, "revision": revision, "then_ms": round(then_ms, 2)}
        print(json.dumps(case | {"now_ms": round(now_ms, 2), "then_over_now": round(then_ms / now_ms, 3)}), flush=True)
