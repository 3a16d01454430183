"""Causal and non-causal MoBA (block 128, top-k 4), B = 1, H = 8, D = 64: the matrix-product FLOPs of one
fwd + bwd (``FlopCounterMode``) at n = 2048 / 4096 / 8192, and, at one thread, the best of 4 steps of its
parts: the gate (``select_blocks``), the layout of the gated pairs, the kernel's forward and the backward. The
kernel is the products kernel (``attention_zoo.moba.tiled.MobaAttention``), which the CPU ran when this was
measured.

    python -m results.cpu_targets.sweep_shared_scan.moba_work
"""

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import attention_zoo as az
import attention_zoo.moba.tiled as moba_kernel
from results.ab_timing import inputs

torch.set_num_threads(1)
moba_kernel._FLASH_DEVICES = ()
parts: dict[str, float] = {}


def timed(owner, name: str, label: str) -> None:
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        parts[label] = parts.get(label, 0.0) + time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


core_class = type(az.create_attention("moba", dim_head=64, heads=8, block_size=8, top_k=2))
timed(core_class, "select_blocks", "gate")
timed(moba_kernel, "gated_layout", "layout")
timed(moba_kernel.MobaAttention, "apply", "kernel forward")
for causal in (True, False):
    flops = {}
    for n in (2048, 4096, 8192):
        core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
        q, k, v, grad = inputs(n)
        with FlopCounterMode(display=False) as counter:
            core(q, k, v, causal=causal).backward(grad)
        flops[n] = counter.get_total_flops()
        q.grad = k.grad = v.grad = None
        best: dict[str, float] = {}
        for step in range(5):
            parts.clear()
            start = time.perf_counter()
            out = core(q, k, v, causal=causal)
            parts["forward"] = time.perf_counter() - start
            start = time.perf_counter()
            out.backward(grad)
            parts["backward"] = time.perf_counter() - start
            q.grad = k.grad = v.grad = None
            if step:
                best = {label: min(best.get(label, 1e9), t) for label, t in parts.items()}
        times = ", ".join(f"{label} {t * 1e3:.1f}" for label, t in best.items())
        print(f"{'causal' if causal else 'non-causal'} n={n}: {flops[n] / 1e9:.2f} GFLOP; ms: {times}")
    print(f"  FLOPs t(8192)/t(2048) = {flops[8192] / flops[2048]:.3f}")
