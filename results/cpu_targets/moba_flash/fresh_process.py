"""Causal MoBA's `zoo targets` case (n = 4096, block 128, top-k 4, fwd + bwd, one thread) called 8 times in a
fresh process, as a sweep's worker calls it (1 warm-up, then the timed calls): time and minor page faults of each
call, for the CPU's flash-op kernel or (``products``) the products kernel.

    OMP_NUM_THREADS=1 python results/cpu_targets/moba_flash/fresh_process.py [products]
"""

import resource
import sys
import time

import torch

from attention_zoo.moba import tiled as moba_kernel
from experiments.bench import targets
from experiments.bench.measure import build_step

torch.set_num_threads(1)
kernel = sys.argv[1] if len(sys.argv) > 1 else "flash op"
if kernel == "products":
    moba_kernel._FLASH_DEVICES = ()
case = next(c for c in targets.target_cases(None, 1) if c.attention == "moba" and c.causal and c.seq_len == 4096)
step = build_step(case)
for call in range(8):
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    step()
    elapsed = (time.perf_counter() - start) * 1e3
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"{kernel}: call {call}: {elapsed:.1f} ms, {faults} minor faults")
