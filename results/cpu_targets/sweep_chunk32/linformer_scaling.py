"""Where Linformer's (k = 256) time goes from n = 2048 to 8192 (fwd + bwd, B = 1, H = 8, D = 64, one thread).

    python results/cpu_targets/sweep_chunk32/linformer_scaling.py > linformer_scaling.txt

1. Self time per operator at both n under ``torch.profiler`` (5 steps after 3 warm-ups; the parameters' gradients
   set to None after each step, as an optimizer's ``zero_grad`` does), with the ratio 8192 / 2048.
2. The same core fed two layouts of q, k, v leaves, interleaved (6 rounds): contiguous (B, H, N, D), as
   ``zoo targets`` builds them, and (B, N, H, D) viewed as (B, H, N, D), as a model's projection hands them over.
"""

import torch
from torch.profiler import ProfilerActivity, profile

import attention_zoo as az
from experiments.bench.paired_ratio import interleaved_seconds

torch.set_num_threads(1)
LENGTHS = (2048, 8192)


def inputs(n: int, layout: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (1, 8, n, 64) if layout == "bhnd" else (1, n, 8, 64)
    leaves = [torch.randn(*shape, generator=generator).requires_grad_() for _ in range(3)]
    return leaves, torch.randn(1, 8, n, 64, generator=generator)


def step(core: az.AttentionCore, leaves: list[torch.Tensor], grad: torch.Tensor, layout: str):
    def call() -> None:
        views = leaves if layout == "bhnd" else [x.transpose(1, 2) for x in leaves]
        core(*views).backward(grad)
        for x in [*leaves, *core.parameters()]:
            x.grad = None

    return call


profiles = {}
for n in LENGTHS:
    core = az.create_attention("linformer", dim_head=64, heads=8, max_seq_len=n, k=256)
    call = step(core, *inputs(n, "bhnd"), "bhnd")
    for _ in range(3):
        call()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            call()
    profiles[n] = {event.key: event.self_cpu_time_total / 5e3 for event in prof.key_averages()}
totals = {n: sum(times.values()) for n, times in profiles.items()}
print(f"profile, ms per step: {totals[2048]:.1f} -> {totals[8192]:.1f} ({totals[8192] / totals[2048]:.2f}x)")
for key in sorted(profiles[8192], key=lambda key: -profiles[8192][key])[:8]:
    before, after = profiles[2048].get(key, 0.0), profiles[8192][key]
    print(f"  {key[:60]:60s} {before:8.1f} {after:8.1f}  x{after / max(before, 1e-9):.2f}")
for n in LENGTHS:
    core = az.create_attention("linformer", dim_head=64, heads=8, max_seq_len=n, k=256)
    calls = [step(core, *inputs(n, layout), layout) for layout in ("bhnd", "bnhd")]
    bhnd, bnhd = (min(times) * 1e3 for times in interleaved_seconds(calls, 6))
    print(f"n = {n}: leaves (B, H, N, D) {bhnd:.1f} ms, leaves (B, N, H, D) as from a projection {bnhd:.1f} ms")
