"""cosFormer's non-causal form as the paper decomposes it, O_i ~ Q_i^cos (sum_j K_j^cos^T V_j) + Q_i^sin (...), with the
re-weighting applied to V so that no (n, 2d) feature map exists, written with plain autograd, against the
library's core (one (n, 2d) feature map per side), interleaved in one process: fwd + bwd, B = 1, H = 8, D = 64,
M = n, one thread, best and median of 8 rounds. The two outputs are checked equal first.

    python results/cpu_targets/sweep_2026-11-27_scan/cosformer_decomposed.py 8192
"""

import math
import sys
import time

import torch
import torch.nn.functional as F

import attention_zoo as az
from attention_zoo.kernel.products import flat

torch.set_num_threads(1)
n = int(sys.argv[1])
core = az.create_attention("cosformer", dim_head=64, heads=8, max_seq_len=n)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=g).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=g)
M = n


def proto(q, k, v):
    nq, nk = q.shape[-2], k.shape[-2]
    aq = torch.arange(nq, dtype=q.dtype) * (math.pi / (2 * M))
    ak = torch.arange(nk, dtype=q.dtype) * (math.pi / (2 * M))
    cq, sq, ck, sk = aq.cos()[:, None], aq.sin()[:, None], ak.cos()[:, None], ak.sin()[:, None]
    rq, rk = flat(F.relu(q)), flat(F.relu(k))
    vv = flat(v)
    s_cos = rk.transpose(1, 2) @ (vv * ck)
    s_sin = rk.transpose(1, 2) @ (vv * sk)
    z_cos = rk.transpose(1, 2) @ ck
    z_sin = rk.transpose(1, 2) @ sk
    num = (rq @ s_cos) * cq + (rq @ s_sin) * sq
    den = (rq @ z_cos) * cq + (rq @ z_sin) * sq
    none = den <= 0
    out = num / den.masked_fill(none, 1.0)
    return out.masked_fill(none, 0.0).view(q.shape[:-1] + v.shape[-1:])


with torch.no_grad():
    torch.testing.assert_close(proto(q, k, v), core(q, k, v), rtol=1e-4, atol=1e-5)


def step_core():
    core(q, k, v).backward(grad)
    q.grad = k.grad = v.grad = None


def step_proto():
    proto(q, k, v).backward(grad)
    q.grad = k.grad = v.grad = None


times = {"core": [], "proto": []}
for r in range(8):
    for label, f in (("core", step_core), ("proto", step_proto)):
        if r == 0:
            f()
        t = time.perf_counter()
        f()
        times[label].append(time.perf_counter() - t)
print(n, *(f"{label} min {min(t) * 1e3:.1f} med {sorted(t)[4] * 1e3:.1f}" for label, t in times.items()))
