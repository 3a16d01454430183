"""Causal linear's n-sized elementwise passes (fwd + bwd, n = 4096, B = 1, H = 8, D = 64, one thread) at chunk 32
and 64 in one process: their time per call under ``torch.profiler`` (3 steps after 3 warm-ups).

    python -m results.cpu_targets.sweep_chunk32.causal_linear_pages
"""

import torch
from torch.profiler import ProfilerActivity, profile

import attention_zoo as az
from results.ab_timing import fwd_bwd, inputs

torch.set_num_threads(1)
for chunk in (32, 64):
    core = az.create_attention("linear", dim_head=64, heads=8, chunk_size=chunk)
    q, k, v, grad = inputs(4096)
    step = fwd_bwd(lambda core=core, q=q, k=k, v=v: core(q, k, v, causal=True), grad, q, k, v)
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            step()
    print("chunk", chunk)
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in ("aten::mul", "aten::div", "aten::fill_") and event.self_cpu_time_total > 1000:
            per_call = event.self_cpu_time_total / event.count / 1e3
            print(f"  {event.key} {event.input_shapes} {event.count} calls, {per_call:.2f} ms a call")
