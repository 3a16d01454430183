"""Where causal MoBA's fwd + bwd goes on the CPU (n = 4096, block 128, top-k 4, B = 1, H = 8, D = 64, float32,
one thread): torch.profiler over two warm steps, ms per step; the gathers, scatters and fills by input shape.

    python -m results.cpu_targets.moba_flash.moba_profile
"""

from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import attention_zoo as az
from results.ab_timing import fwd_bwd, inputs

torch.set_num_threads(1)
n, steps = 4096, 2
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
q, k, v, grad = inputs(n)
step = fwd_bwd(lambda: core(q, k, v, causal=True), grad, q, k, v)

for _ in range(2):
    step()
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for _ in range(steps):
        step()
by_shape = defaultdict(lambda: [0.0, 0])
for event in prof.key_averages(group_by_input_shape=True):
    if event.key in ("aten::index_select", "aten::index_add_", "aten::scatter_add_", "aten::fill_", "aten::topk"):
        key = (event.key, str(event.input_shapes[0] if event.input_shapes else ""))
        by_shape[key][0] += event.self_cpu_time_total / 1e3 / steps
        by_shape[key][1] += event.count // steps
for (name, shape), (ms, calls) in sorted(by_shape.items(), key=lambda item: -item[1][0])[:10]:
    print(f"{ms:7.2f} ms a step, {calls:4d} calls: {name} {shape}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=48))
