"""cosFormer's non-causal form as the paper decomposes it, O_i ~ Q_i^cos (sum_j K_j^cos^T V_j) + Q_i^sin (...), with the
re-weighting applied to V so that no (n, 2d) feature map exists, written with plain autograd, against the
library's core (one (n, 2d) feature map per side), interleaved in one process: fwd + bwd, B = 1, H = 8, D = 64,
M = n, one thread, best and median of 8 rounds. The two outputs are checked equal first.

    python -m results.cpu_targets.sweep_shared_scan.cosformer_decomposed 8192
"""

import math
import sys

import torch
import torch.nn.functional as F

import attention_zoo as az
from attention_zoo.kernel.products import flat
from results.ab_timing import fwd_bwd, inputs, interleaved

torch.set_num_threads(1)
n = int(sys.argv[1])
core = az.create_attention("cosformer", dim_head=64, heads=8, max_seq_len=n)
q, k, v, grad = inputs(n)
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

variants = {"core": lambda: core(q, k, v), "proto": lambda: proto(q, k, v)}
timings = interleaved({label: fwd_bwd(forward, grad, q, k, v) for label, forward in variants.items()}, 8)
print(
    n, *(f"{label} min {min(t.seconds) * 1e3:.1f} med {sorted(t.seconds)[4] * 1e3:.1f}" for label, t in timings.items())
)
