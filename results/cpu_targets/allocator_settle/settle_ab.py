"""A sweep worker's case, timed as the worker times it (fresh process, 1 warm-up, minimum of 5 calls), with and
without first allocating and freeing one 31 MiB tensor ("settle"): that raises glibc's dynamic mmap threshold to
its 32 MiB ceiling, as in a process that has once freed a large tensor. Prints the minimum, the median and each
timed call's minor page faults.

    OMP_NUM_THREADS=1 python results/cpu_targets/allocator_settle/settle_ab.py \
        plain|settle NAME causal|not N
"""

import resource
import sys
import time

import torch

from experiments.bench import targets
from experiments.bench.measure import build_step

torch.set_num_threads(1)
mode, name, causal, n = sys.argv[1], sys.argv[2], sys.argv[3] == "causal", int(sys.argv[4])
if mode == "settle":
    torch.empty(31 * 2**20 // 4).fill_(0)
options = {c.attention: c.options for c in targets.target_cases(None, 1)}
step = build_step(targets.protocol_case(name, options.get(name, {}), n, 1, causal))
step()
milliseconds, faults = [], []
for _ in range(5):
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    step()
    milliseconds.append((time.perf_counter() - start) * 1e3)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
label = f"{mode:6s} {name:9s} {sys.argv[3]:6s} {n}"
print(f"{label}: min {min(milliseconds):.1f} ms  median {sorted(milliseconds)[2]:.1f}  faults {faults}", flush=True)
