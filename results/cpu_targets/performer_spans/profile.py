"""Causal Performer (m = 256, spans) under torch.profiler at n = 4096: fwd + bwd, B = 1, H = 8, D = 64, float32, one
thread, after two warm-up steps; the matrix products' share, FLOPs and rate, and the top operators.

    python -m results.cpu_targets.performer_spans.profile
"""

import torch
from torch.profiler import ProfilerActivity, profile

import attention_zoo as az
from results.ab_timing import inputs

MATMULS = ("aten::bmm", "aten::mm", "aten::baddbmm", "aten::addmm", "aten::matmul")

torch.set_num_threads(1)
n = 4096
q, k, v, grad = inputs(n)
core = az.create_attention("performer", dim_head=64, heads=8, nb_features=256)
for _ in range(2):
    core(q, k, v, causal=True).backward(grad)
with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
    core(q, k, v, causal=True).backward(grad)
events = prof.key_averages()
total = sum(e.self_cpu_time_total for e in events)
matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
flops = sum(e.flops for e in events if e.flops)
print(
    f"total self {total / 1e3:.1f} ms, matmul {matmul / 1e3:.1f} ms ({matmul / total:.0%}), "
    f"flops {flops / 1e9:.2f} G, matmul rate {flops / matmul / 1e3:.1f} GFLOP/s"
)
print(events.table(sort_by="self_cpu_time_total", row_limit=12))
