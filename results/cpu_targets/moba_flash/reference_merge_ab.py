"""A try on causal MoBA's CPU kernel, measured and dropped: the kernel at ff54884 (each gated piece merged
against a per-row reference raised only past exp(30), so no row of O is gathered back in the forward; q, dO
and O gathered for a group of consecutive batches at once, ``_GROUP_ROWS`` rows) against the working tree's
(a running (O, L) merge by log-add-exp, every row gathered a batch at a time). ``--group-rows`` runs the try
once per value (1: every batch its own group). Interleaved, one process, one thread, fwd + bwd of the core (gate
included), n = 4096, block 128, top-k 4, B = 1, H = 8, D = 64, float32, after one call of each; outputs and
gradients compared first; each round's time of a variant divided by the working tree's in that round, on the
wall clock and on the process's CPU clock.
    python results/cpu_targets/moba_flash/reference_merge_ab.py [--rounds R] [--group-rows 16384 8192 1]
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import attention_zoo as az
from attention_zoo.moba import tiled as moba_kernel

parser = argparse.ArgumentParser()
parser.add_argument("--commit", default="ff54884")
parser.add_argument("--rounds", type=int, default=30)
parser.add_argument("--group-rows", type=int, nargs="+", default=[16384, 8192, 1])
args = parser.parse_args()
torch.set_num_threads(1)
source = subprocess.run(["git", "show", f"{args.commit}:attention_zoo/moba/flash.py"], capture_output=True,
                        text=True, check=True).stdout  # fmt: skip
folder = Path(tempfile.mkdtemp())
kernels = {"working tree": moba_kernel.FlashMobaAttention}
for rows in args.group_rows:
    name = f"try_{rows}"
    (folder / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module._GROUP_ROWS = rows
    kernels[f"{args.commit}, groups of {rows} rows"] = module.FlashMobaAttention

n = 4096
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)


def step() -> list[torch.Tensor]:
    out = core(q, k, v, causal=True)
    out.backward(grad)
    results = [out.detach()] + [t.grad for t in (q, k, v)]
    q.grad = k.grad = v.grad = None
    return results


results = {}
for name, kernel in kernels.items():
    moba_kernel.FlashMobaAttention = kernel
    results[name] = step()
for name, result in results.items():
    difference = max((a - b).abs().max().item() for a, b in zip(result, results["working tree"], strict=True))
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
