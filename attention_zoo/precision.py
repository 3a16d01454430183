"""The compute dtype of a core's numerically sensitive parts: the input dtype, raised to at least float32.

Rule: a part that accumulates or inverts (the online softmax's running sums of exponentials and the cached
keys' softmax of the sparse family, MoBA's block sums of keys, Nystromformer's landmark means and the
pseudo-inverse of its ill-conditioned landmark matrix, the kernel cores' sums of n positive features, LSH's
bucketed softmax) of inputs in ``dtype`` runs in ``torch.promote_types(dtype, torch.float32)``: float16 and
bfloat16 in float32, float32 and float64 unchanged; the result is cast back to the input dtype.

Why: float16 overflows at 65504, so a sum of a few thousand exponentials or positive features does too,
and bfloat16's 8-bit mantissa stops counting at 256 equal terms; float32 has the range and enough digits
for every such sum here. float64 is not lowered, so the float64 references of the tests stay exact.

Autocast: the rule reads the input dtype alone, never the autocast dtype. Inside a model under autocast the
projections hand a core q, k, v in the autocast dtype already, which the rule raises like any half input.
Autocast would still lower the matmuls of the raised part back to half precision; the cores whose parts
must stay exact under autocast (the kernel cores, Nystromformer: their tests compare the output under
autocast with the output without it) run those parts inside :func:`full_precision`, which turns autocast
off. The sparse family's tiled kernel and decoding cache, MoBA and LSH raise the dtype but leave autocast
on, so under autocast their matmuls run in the autocast dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["compute_dtype", "full_precision"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` raised to at least float32: float16, bfloat16 -> float32; float32, float64 unchanged."""
    return torch.promote_types(dtype, torch.float32)


@contextmanager
def full_precision(like: Tensor) -> Iterator[torch.dtype]:
    """Autocast off on ``like``'s device for the block; yields :func:`compute_dtype` of ``like``'s dtype."""
    with torch.autocast(like.device.type, enabled=False):
        yield compute_dtype(like.dtype)
