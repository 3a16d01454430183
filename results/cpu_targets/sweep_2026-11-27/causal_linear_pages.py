"""Causal linear's n-sized elementwise passes (fwd + bwd, n = 4096, B = 1, H = 8, D = 64, one thread) at chunk 32
and 64 in one process: their time per call under ``torch.profiler`` (3 steps after 3 warm-ups).

    python results/cpu_targets/sweep_2026-11-27/causal_linear_pages.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

import attention_zoo as az

torch.set_num_threads(1)
for chunk in (32, 64):
    core = az.create_attention("linear", dim_head=64, heads=8, chunk_size=chunk)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4096, 64, generator=generator).requires_grad_() for _ in range(3))
    grad = torch.randn(1, 8, 4096, 64, generator=generator)

    def step(core=core, q=q, k=k, v=v, grad=grad) -> None:
        core(q, k, v, causal=True).backward(grad)
        q.grad = k.grad = v.grad = None

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
