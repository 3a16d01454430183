"""Minor page faults and time of each timed call, in ``experiments.bench.paired_ratio``'s scaling order (each
mechanism at n = 2048 then 8192, each timed call after an untimed one of the same case), one thread.
``--keep-freed``: glibc told first to keep freed memory (``mallopt``: no trimming of the heap's top, no mmap
below 1 GiB), so that no call's memory comes fresh from the kernel.

    python results/cpu_targets/page_faults/faults_per_call.py linear [--causal] [--rounds 12] [--keep-freed]
"""

import argparse
import ctypes
import resource
import time

import torch

import attention_zoo as az
from experiments.bench.paired_ratio import _inputs, _step

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("attention")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--keep-freed", action="store_true")
    args = parser.parse_args()
    if args.keep_freed:
        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and libc.mallopt(M_MMAP_THRESHOLD, 2**30) == 1
    torch.set_num_threads(1)
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    steps = {}
    for n in (2048, 8192):
        core = az.create_attention(args.attention, dim_head=64, heads=8, max_seq_len=n)
        steps[n] = _step(core, _inputs(n, 8, 64), args.causal)
    for step in steps.values():
        step()
    mib, ms = {n: [] for n in steps}, {n: [] for n in steps}
    for _ in range(args.rounds):
        for n, step in steps.items():
            step()
            before, start = faults(), time.perf_counter()
            step()
            ms[n].append((time.perf_counter() - start) * 1e3)
            mib[n].append((faults() - before) * 4 / 1024)
    label = f"{args.attention}{' causal' if args.causal else ''}{' keep-freed' if args.keep_freed else ''}"
    for n in steps:
        print(f"{label:28s} n={n}: MiB faulted {[round(x) for x in mib[n]]}")
        print(f"{label:28s} n={n}: ms          {[round(x, 1) for x in ms[n]]}")
    ratios = [b / a for a, b in zip(ms[2048], ms[8192], strict=True)]
    print(f"{label:28s} t(8192)/t(2048): min/min {min(ms[8192]) / min(ms[2048]):.2f}, "
          f"geometric mean of rounds {torch.tensor(ratios).log().mean().exp():.2f}")


if __name__ == "__main__":
    main()
