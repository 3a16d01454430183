"""NSA's compression φ: a learned map of a block of l consecutive keys (or values) to one, with an intra-block
position encoding (Yuan et al. 2025, arXiv:2502.11089, Sec. 3.3.1, eq. 7):

    K̃_t^cmp = { φ(k_{id+1 : id+l}) | 0 <= i <= floor((t - l) / d) }

Here φ(x) = mean_j x_j + W_2 GELU(W_1 vec(x + E) + b_1), with E (l, D) the learned position encoding and a hidden
width of D. W_2 starts small (N(0, 0.02²), GPT-2's scale): a compressed key starts close to its block's mean key
(the block summary that MoBA and fla's NSA score blocks by), so the selection means something from the first
step, and every parameter has a gradient from the first step. W_2 has no bias: a bias added to every compressed
key cancels in the softmax. The paper gives φ as "a learnable MLP with intra-block position encoding" and no more;
the mean path is this implementation's choice. One φ for keys and one for values, shared by the heads of a core
(a core is one GQA group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn


class BlockCompressor(nn.Module):
    """φ of the module docstring for blocks of ``block`` vectors of width ``dim``."""

    def __init__(self, dim: int, block: int) -> None:
        super().__init__()
        self.block = block
        self.position = nn.Parameter(torch.randn(block, dim) * dim**-0.5)
        self.hidden = nn.Linear(block * dim, dim)
        self.out = nn.Linear(dim, dim, bias=False)
        nn.init.xavier_uniform_(self.hidden.weight)
        nn.init.zeros_(self.hidden.bias)
        nn.init.normal_(self.out.weight, std=0.02)  # φ starts near the block mean

    def forward(self, blocks: Tensor) -> Tensor:
        """(..., M, l, D) blocks -> (..., M, D) compressed vectors."""
        # m: block, j: position in a block, d: head dim
        # cast: a core built in half precision computes in float32 (:mod:`attention_zoo.nsa.attention`)
        dtype = blocks.dtype
        flat = rearrange(blocks + self.position.to(dtype), "... m j d -> ... m (j d)")
        hidden = F.gelu(F.linear(flat, self.hidden.weight.to(dtype), self.hidden.bias.to(dtype)))
        return blocks.mean(dim=-2) + F.linear(hidden, self.out.weight.to(dtype))

    def compress(self, x: Tensor, stride: int) -> Tensor:
        """(B, H, N, D) -> (B, H, M, D): every complete block x[i d : i d + l], M = floor((N - l) / d) + 1
        (0 when N < l)."""
        if x.shape[-2] < self.block:
            return self(x.new_zeros(*x.shape[:2], 0, self.block, x.shape[-1]))
        windows = x.unfold(2, self.block, stride)  # (B, H, M, D, l), a view
        return self(rearrange(windows, "b h m d j -> b h m j d"))
