"""Short causal depthwise convolution over positions, added to the embeddings before the first layer.

H3 (Fu, Dao et al. 2022, "Hungry Hungry Hippos", arXiv:2212.14052) adds a shift SSM so that a token can
see its predecessors before a sequence mixer compares it with the rest of the sequence; Zoology (Arora, Eyuboglu et
al. 2023, arXiv:2312.04927) builds its BaseConv and hybrids from short convolutions for the same role. Here,
for a stream x (B, N, d) and kernel size K:

    y_i = x_i + Σ_{j=0}^{K-1} w_j ⊙ x_{i-j} + b          (x_{i-j} = 0 for i - j < 0; w_j, b ∈ R^d)

Why it is here: multi-query associative recall needs each value to carry the key before it. Without a
convolution, a Transformer has to learn that as a previous-token head in one layer and then look the key up in the
next (the induction circuit of Olsson et al. 2022, arXiv:2209.11895), which takes thousands of steps; with it, the
lookup is one attention over content. The convolution is applied to every model alike, whatever its attention,
so comparisons stay about the attention: it reaches K - 1 tokens back and no further.

Causal (position i reads only i - K + 1 .. i), so it keeps a causal encoder causal; in packed rows it does not read
across a document's start. Positions a key padding mask
marks False are zeroed before the convolution, so padding never reaches a real token, on either side.
The weights keep PyTorch's ``Conv1d`` initialisation (:mod:`attention_zoo.init` leaves them).
"""

from __future__ import annotations

import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attention_zoo import packing


class ShortConvolution(nn.Module):
    """``forward(x (B, N, d), mask (B, N) bool | None) -> (B, N, d)``: ``x`` plus its causal depthwise convolution
    with kernel size ``kernel_size`` (module docstring)."""

    def __init__(self, dim: int, kernel_size: int) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.kernel_size = kernel_size
        # padding K - 1 on both ends; keeping the first N outputs makes output i read inputs i - K + 1 .. i
        self.conv = nn.Conv1d(dim, dim, kernel_size, groups=dim, padding=kernel_size - 1)

    def forward(self, x: Tensor, mask: Tensor | None = None, segments: Tensor | None = None) -> Tensor:
        """``segments``: packed rows' document boundaries (:mod:`attention_zoo.packing`); the convolution then reads
        no position of an earlier document (x_{i-j} = 0 when i - j lies before the start of i's document)."""
        n = x.shape[1]
        source = x if mask is None else x.masked_fill(~mask[..., None], 0.0)
        if segments is None:
            mixed = self.conv(rearrange(source, "b n d -> b d n"))[..., :n]
            return x + rearrange(mixed, "b d n -> b n d")
        # tap j of the kernel (weight index K - 1 - j) reads x_{i-j}, kept where i - j is in i's document
        offsets = packing.positions_in_documents(segments, n)
        mixed = x.new_zeros(x.shape) + self.conv.bias
        weight = rearrange(self.conv.weight, "d 1 k -> k d")
        for j in range(self.kernel_size):
            shifted = F.pad(source, (0, 0, j, 0))[:, :n]
            mixed = mixed + weight[self.kernel_size - 1 - j] * shifted * (offsets >= j)[..., None]
        return x + mixed
