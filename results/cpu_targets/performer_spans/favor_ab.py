"""Causal Performer (m = 256) with its feature maps made one span at a time (``attention_zoo.kernel.causal_favor``)
against the previous path (the whole (n, m) maps, then ``CausalProduct``), and full attention, in one process,
interleaved round by round (8 rounds after a warm-up): fwd + bwd, B = 1, H = 8, D = 64, float32, one thread. Minor
page faults per step from getrusage.

    python -m results.cpu_targets.performer_spans.favor_ab 4096
"""

import sys

import torch

import attention_zoo as az
from attention_zoo.kernel.attention import KernelAttention
from results.ab_timing import fwd_bwd, inputs, interleaved

torch.set_num_threads(1)
n = int(sys.argv[1])
performer = az.create_attention("performer", dim_head=64, heads=8, nb_features=256, max_seq_len=n)
full = az.create_attention("full", dim_head=64, heads=8, max_seq_len=n)
q, k, v, grad = inputs(n)
variants = {
    "spans": lambda: performer(q, k, v, causal=True),
    "whole maps": lambda: KernelAttention.attend(performer, q, k, v, mask=None, causal=True),
    "full": lambda: full(q, k, v, causal=True),
}
timings = interleaved({label: fwd_bwd(forward, grad, q, k, v) for label, forward in variants.items()}, 8)
speed = {label: min(timings["full"].seconds) / min(timings[label].seconds) for label in ("spans", "whole maps")}
print(
    f"n={n}: "
    + "; ".join(f"{label} {timing.text()}" for label, timing in timings.items())
    + f"; speed vs full: spans {speed['spans']:.2f}x, whole maps {speed['whole maps']:.2f}x"
)
