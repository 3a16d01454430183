"""Linear attention ("Transformers are RNNs"): softmax replaced by the kernel phi(x)^T phi(y), phi = elu + 1.

Katharopoulos, Vyas, Pappas, Fleuret 2020, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention", ICML 2020, arXiv:2006.16236 (https://arxiv.org/abs/2006.16236), Sec. 3.2-3.4:

    V'_i = phi(Q_i)^T (sum_j phi(K_j) V_j^T) / phi(Q_i)^T (sum_j phi(K_j)),   phi(x) = elu(x) + 1
    causal (Sec. 3.3):  V'_i = phi(Q_i)^T S_i / phi(Q_i)^T Z_i,
                        S_i = S_{i-1} + phi(K_i) V_i^T,  Z_i = Z_{i-1} + phi(K_i)

phi is applied to q and k as they come (no 1/sqrt(d) scaling, as in the paper and the authors'
fast-transformers code); it is positive, so every denominator with a real key is > 0. m = d features.
The causal form is exact (chunked prefix sums, ``chunk_size`` c) and decoding is the paper's RNN (Sec. 3.4):
the state (S_i, Z_i) is d x (d + 1) per head, O(d^2) per token whatever the position. Machinery, padding,
precision and the backward of Sec. 3.3.1: :mod:`attention_zoo.kernel.attention`.

Complexity: O(n d^2) time non-causal, O(n c d + n d^2) causal; memory O(n (d + c) + d^2) per head.

Limits: a different attention, not an approximation of softmax. phi(q)^T phi(k) grows at most
quadratically in the scale of q and k where exp(q^T k) grows exponentially, so for the same q, k its
weights are much less peaked; learned projections have to compensate. Not ``exact`` (it is not softmax),
but its causal and decoding forms compute its own kernel exactly.
"""

from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from attention_zoo.kernel.attention import KernelAttention
from attention_zoo.registry import register_attention


@register_attention("linear")
class LinearAttention(KernelAttention):
    """Packed rows (``segments``): the sums phi(K)^T [V 1] (and the causal prefix state) restart at each document
    boundary; non-causal in one pass over the packed rows (:meth:`KernelAttention.attend_segments`), causal by
    unpacking the documents (:func:`~attention_zoo.packing.unpacked_attention`)."""

    example_configs = ({"chunk_size": 8}, {"chunk_size": 5})
    notes: ClassVar[str] = (
        "kernel elu(x)+1 instead of softmax (not an approximation of it); causal by exact chunked prefix sums; "
        "decoding keeps a d x (d+1) state per head (RNN form)"
    )

    def features(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        return F.elu(x).add_(1.0)  # in place: elu's backward reads its input, not its output
