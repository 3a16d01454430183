"""Causal MoBA's CPU kernel at a given commit (default abedbc0: a running (O, L) merge, each batch's rows of O
gathered and written back; q, dO and O gathered a batch at a time) against the working tree's (a merge against
a reference raised only past exp(30); every batch's queries gathered at once in the forward and kept; dO and O
gathered a group of batches at a time). Interleaved, one process, one thread, fwd + bwd of the core (gate
included), n = 4096, block 128, top-k 4, B = 1, H = 8, D = 64, float32, after one call of each; outputs and
gradients compared first.
    python experiments/results/cpu_targets/moba_flash/reference_merge_ab.py [--commit C] [--rounds R] [--n N]
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
from attention_zoo import moba_kernel

parser = argparse.ArgumentParser()
parser.add_argument("--commit", default="abedbc0")
parser.add_argument("--rounds", type=int, default=16)
parser.add_argument("--n", type=int, default=4096)
parser.add_argument("--causal", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(1)

source = subprocess.run(["git", "show", f"{args.commit}:attention_zoo/moba_kernel_flash.py"], capture_output=True,
                        text=True, check=True).stdout  # fmt: skip
path = Path(tempfile.mkdtemp()) / "moba_kernel_flash_at_commit.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("moba_kernel_flash_at_commit", path)
old = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = old
spec.loader.exec_module(old)

kernels = {args.commit: old.FlashMobaAttention, "working tree": moba_kernel.FlashMobaAttention}
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=args.n, block_size=128, top_k=4)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, args.n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, args.n, 64, generator=generator)


def step() -> list[torch.Tensor]:
    out = core(q, k, v, causal=bool(args.causal))
    out.backward(grad)
    results = [out.detach()] + [t.grad for t in (q, k, v)]
    q.grad = k.grad = v.grad = None
    return results


results = {}
for name, kernel in kernels.items():
    moba_kernel.FlashMobaAttention = kernel
    results[name] = step()
difference = max((a - b).abs().max().item() for a, b in zip(*results.values(), strict=True))
print(f"n = {args.n}, causal = {bool(args.causal)}; largest difference of output and gradients: {difference:.3g}")
seconds: dict[str, list[float]] = {name: [] for name in kernels}
for _ in range(args.rounds):
    for name, kernel in kernels.items():
        moba_kernel.FlashMobaAttention = kernel
        start = time.perf_counter()
        step()
        seconds[name].append(time.perf_counter() - start)
base = seconds[args.commit]
for name, times in seconds.items():
    ratios = [t / b for t, b in zip(times, base, strict=True)]
    low, middle, high = statistics.quantiles(ratios, n=4)
    print(f"{name}: min {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms; "
          f"per round / {args.commit}: median {middle:.3f}, quartiles {low:.3f}-{high:.3f}")  # fmt: skip
