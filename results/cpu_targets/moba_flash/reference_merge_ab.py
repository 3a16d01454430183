"""A try on causal MoBA's CPU kernel, measured and dropped: the kernel at ff54884 (each gated piece merged
against a per-row reference raised only past exp(30), so no row of O is gathered back in the forward; q, dO
and O gathered for a group of consecutive batches at once, ``_GROUP_ROWS`` rows) against the working tree's
(a running (O, L) merge by log-add-exp, every row gathered a batch at a time). ``--group-rows`` runs the try
once per value (1: every batch its own group). Interleaved, one process, one thread, fwd + bwd of the core (gate
included), n = 4096, block 128, top-k 4, B = 1, H = 8, D = 64, float32, after one call of each; outputs and
gradients compared first; each round's time of a variant divided by the working tree's in that round, on the
wall clock and on the process's CPU clock.

    python -m results.cpu_targets.moba_flash.reference_merge_ab [--rounds R] [--group-rows 16384 8192 1]
"""

import argparse
import statistics
import time

import torch

import attention_zoo as az
from attention_zoo.moba import tiled as moba_kernel
from results.ab_timing import at_commit, fwd_bwd, inputs, largest_difference

parser = argparse.ArgumentParser()
parser.add_argument("--commit", default="ff54884")
parser.add_argument("--rounds", type=int, default=30)
parser.add_argument("--group-rows", type=int, nargs="+", default=[16384, 8192, 1])
args = parser.parse_args()
torch.set_num_threads(1)
kernels = {"working tree": moba_kernel.FlashMobaAttention}
for rows in args.group_rows:
    module = at_commit(args.commit, "attention_zoo/moba_kernel_flash.py", f"try_{rows}")
    module._GROUP_ROWS = rows
    kernels[f"{args.commit}, groups of {rows} rows"] = module.FlashMobaAttention

n = 4096
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
q, k, v, grad = inputs(n)
step = fwd_bwd(lambda: core(q, k, v, causal=True), grad, q, k, v)


results = {}
for name, kernel in kernels.items():
    moba_kernel.FlashMobaAttention = kernel
    results[name] = step()
for name, result in results.items():
    difference = largest_difference(result, results["working tree"])
    print(f"{name}: largest difference of output and gradients from the working tree's {difference:.3g}")
wall: dict[str, list[float]] = {name: [] for name in kernels}
cpu: dict[str, list[float]] = {name: [] for name in kernels}
for _ in range(args.rounds):
    for name, kernel in kernels.items():
        moba_kernel.FlashMobaAttention = kernel
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall[name].append(time.perf_counter() - start)
        cpu[name].append(time.process_time() - start_cpu)
for clock, seconds in (("wall", wall), ("cpu", cpu)):
    for name, times in seconds.items():
        ratios = [t / b for t, b in zip(times, seconds["working tree"], strict=True)]
        low, middle, high = statistics.quantiles(ratios, n=4)
        print(f"{clock} {name}: min {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms; "
              f"per round / working tree: median {middle:.3f}, quartiles {low:.3f}-{high:.3f}")  # fmt: skip
