"""cosFormer: ReLU linear attention with a cos-based re-weighting that favours nearby tokens.

Qin et al. 2022, "cosFormer: Rethinking Softmax in Attention", ICLR 2022, arXiv:2202.08791
(https://arxiv.org/abs/2202.08791), Sec. 3. With Q' = ReLU(Q), K' = ReLU(K) and M >= every position:

    s(Q'_i, K'_j) = Q'_i K'_j^T cos(pi/2 * (i - j) / M)
                  = Q_i^cos (K_j^cos)^T + Q_i^sin (K_j^sin)^T,   (cos(a - b) = cos a cos b + sin a sin b)
    Q_i^cos = Q'_i cos(pi i / 2M),  Q_i^sin = Q'_i sin(pi i / 2M),  K_j^cos, K_j^sin likewise
    O_i = sum_j s(Q'_i, K'_j) V_j / sum_j s(Q'_i, K'_j)

so phi(x_i) = [ReLU(x_i) cos(pi i / 2M), ReLU(x_i) sin(pi i / 2M)] (m = 2d features) and the attention is
linear: O_i = (Q_i^cos sum_j K_j^cos^T V_j + Q_i^sin sum_j K_j^sin^T V_j) / (the same with V_j = 1); causal:
sums over j <= i (the paper's causal form, by exact chunked prefix sums here, ``kernel_attention``).
Every pair a query can see has |i - j| < M, so the re-weighting is in (0, 1] and every term is >= 0.

M and positions (the paper leaves M to the implementation; the authors' code takes M = max(Nq, Nk) of
the call, positions 1..N from the start of both sequences):
- M = ``max_seq_len`` (required), in both modes. A causal output must not depend on how long the whole
  sequence is (the prefix property, and decoding), so M cannot be the current length; taking the same
  M non-causally keeps the two modes' weights identical and makes a sequence's outputs independent of
  how far its batch is padded. Only differences i - j enter, so positions may start anywhere. Cost of
  the choice: for sequences much shorter than max_seq_len the re-weighting is close to 1 (weak locality
  bias); set max_seq_len near the lengths trained on.
- Cross-attention (Nq != Nk): keys at 0..Nk-1; causal queries at i + Nk - Nq (the contract's end alignment,
  as in decoding: query i sees keys j <= i + Nk - Nq); non-causal queries at 0..Nq-1 (from the start of
  both sequences, as the authors' code). Nk <= max_seq_len is checked by the base class; non-causal
  Nq > max_seq_len is refused (the re-weighting would turn negative).
- Padding keeps positions (a hole between two tokens counts as distance); left or right padding changes
  nothing, since only differences count.

A query with no positive feature (all of q <= 0), or no real key with an overlapping positive support,
has a zero denominator and gives zeros; the authors' code clamps the denominator at 1e-6 instead.

Complexity: O(n d^2) time non-causal, O(n c d + n d^2) causal (c = ``chunk_size``); memory O(n (d + c) +
d^2) per head; decoding keeps a 2d x (d + 1) state per head.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attention_zoo.core import Approximation
from attention_zoo.kernel_attention import KernelAttention
from attention_zoo.registry import register_attention


@register_attention("cosformer")
class CosFormerAttention(KernelAttention):
    approximation: ClassVar[Approximation] = "kernel"
    requires_max_seq_len: ClassVar[bool] = True
    #: the re-weighting reads each query's index in the call, which a decoder's step-by-step cross-attention
    #: cannot give (its one query sits at index 0): cross-attention is for whole-sequence use only
    position_free_queries: ClassVar[bool] = False
    example_configs = ({"chunk_size": 8}, {"chunk_size": 6})
    notes: ClassVar[str] = (
        "ReLU kernel times cos(pi/2 (i-j)/M) with M = max_seq_len (not the call's length, so causal outputs and "
        "decoding do not depend on the total length); causal by exact chunked prefix sums"
    )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        if not causal and q.shape[-2] > self.max_seq_len:
            raise ValueError(
                f"cosformer: query length {q.shape[-2]} exceeds max_seq_len={self.max_seq_len} (= M of the "
                "re-weighting, which needs every position < M); rebuild it with a larger max_seq_len"
            )
        return super().attend(q, k, v, mask=mask, causal=causal)

    def features(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        # b: batch, h: heads, n: positions, d: head dim
        angle = positions.to(x.dtype) * (math.pi / (2 * self.max_seq_len))
        weights = rearrange([torch.cos(angle), torch.sin(angle)], "t n -> n t 1")
        # one broadcast product writes [ReLU(x) cos, ReLU(x) sin] (the order of the docstring's phi) in one pass
        return rearrange(F.relu(x).unsqueeze(-2) * weights, "b h n t d -> b h n (t d)")
