"""Minor page faults and time of each timed call, in ``experiments.bench.paired_ratio``'s scaling order (each
mechanism at n = 2048 then 8192, each timed call after an untimed one of the same case), one thread.
``--keep-freed``: glibc told first to keep freed memory (``experiments.bench.allocator.keep_freed_memory``: no
trimming of the heap's top, no mmap below 1 GiB), so that no call's memory comes fresh from the kernel.

    python -m results.cpu_targets.page_faults.faults_per_call linear [--causal] [--rounds 12] [--keep-freed]
"""

import argparse
import time

import torch

import attention_zoo as az
from experiments.bench.allocator import keep_freed_memory
from results.ab_timing import fwd_bwd, inputs, minor_faults


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("attention")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--keep-freed", action="store_true")
    args = parser.parse_args()
    if args.keep_freed:
        keep_freed_memory()
    torch.set_num_threads(1)
    steps = {}
    for n in (2048, 8192):
        core = az.create_attention(args.attention, dim_head=64, heads=8, max_seq_len=n)
        q, k, v, grad = inputs(n)
        steps[n] = fwd_bwd(lambda core=core, q=q, k=k, v=v: core(q, k, v, causal=args.causal), grad, q, k, v)
    for step in steps.values():
        step()
    mib, ms = {n: [] for n in steps}, {n: [] for n in steps}
    for _ in range(args.rounds):
        for n, step in steps.items():
            step()
            before, start = minor_faults(), time.perf_counter()
            step()
            ms[n].append((time.perf_counter() - start) * 1e3)
            mib[n].append((minor_faults() - before) * 4 / 1024)
    label = f"{args.attention}{' causal' if args.causal else ''}{' keep-freed' if args.keep_freed else ''}"
    for n in steps:
        print(f"{label:28s} n={n}: MiB faulted {[round(x) for x in mib[n]]}")
        print(f"{label:28s} n={n}: ms          {[round(x, 1) for x in ms[n]]}")
    ratios = [b / a for a, b in zip(ms[2048], ms[8192], strict=True)]
    print(
        f"{label:28s} t(8192)/t(2048): min/min {min(ms[8192]) / min(ms[2048]):.2f}, "
        f"geometric mean of rounds {torch.tensor(ratios).log().mean().exp():.2f}"
    )


if __name__ == "__main__":
    main()
