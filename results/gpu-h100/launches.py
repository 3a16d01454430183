"""Where a GPU call's time goes: kernels launched, host synchronisations, and the share of the call's wall
time the GPU spends in kernels, for the GPU targets' misses and the slowest cores of the registry grid.

One fwd+bwd of each core (the step ``zoo bench`` and the GPU suite time: ``build_step``), bf16, B = 8, H = 8,
d = 64, n = 8192, after 3 untimed calls; one call under ``torch.profiler`` for the counts, and the median of
5 calls timed with ``torch.cuda.synchronize`` on either side for the wall time. A call whose kernels add up to
a small share of its wall time is bound by the host (launches and synchronisations), not by the GPU.

    python3 results/gpu-h100/launches.py [--out FILE] [--seq-len 8192]

Runs on the CPU too (counts of ATen operations only; no kernels, no synchronisations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.bench.cases import Case
from experiments.bench.measure import build_step

CORES = (
    ("full", {}),
    ("nystrom", {"num_landmarks": 64}),
    ("lsh", {"n_hashes": 4, "bucket_size": 64}),
    ("moba", {"block_size": 128, "top_k": 4}),
    ("performer", {"nb_features": 256}),
    ("linformer", {"k": 256}),
)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _inside_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def profile_core(attention: str, options: dict, seq_len: int, device: str) -> dict:
    dtype = "bfloat16" if device == "cuda" else "float32"
    case = Case(attention, options, "core", "fwd+bwd", dtype, device, seq_len, 8, 8, 64, threads=1, causal=False)
    step = build_step(case)
    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    walls = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        step()
        sync()
        walls.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync()
    events = prof.events()
    count = {name: 0 for name in LAUNCH_CALLS + SYNC_CALLS + ("cudaMemcpyAsync",)}
    aten_ops = kernels = 0
    kernel_us = 0.0
    for event in events:
        if event.name in count:
            count[event.name] += 1
        if event.name.startswith("aten::") and not _inside_aten(event):
            aten_ops += 1
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            kernel_us += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    wall_ms = statistics.median(walls) * 1e3
    return {
        "attention": attention, "options": options, "seq_len": seq_len, "device": device,
        "wall_ms": round(wall_ms, 3), "outermost_aten_ops": aten_ops,
        "launches": sum(count[name] for name in LAUNCH_CALLS), "gpu_kernels": kernels,
        "kernel_ms": round(kernel_us / 1e3, 3),
        "gpu_busy": round(kernel_us / 1e3 / wall_ms, 3) if device == "cuda" else None,
        "syncs": sum(count[name] for name in SYNC_CALLS), "memcpy": count["cudaMemcpyAsync"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="a JSON-lines file for the rows (default: stdout only)")
    parser.add_argument("--seq-len", type=int, default=8192, help="n (default 8192)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for attention, options in CORES:
        row = profile_core(attention, options, args.seq_len, device)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
