"""The no-attention control: each position attends only to itself.

Not a mechanism from a paper but the control arm every comparison needs: the attention of Vaswani et al. 2017
(arXiv:1706.03762) restricted to the diagonal pattern {i}. Softmax over one key is 1, so

    head_i = softmax(q_i k_i^T / sqrt(d_k)) v_i = v_i

(zero where position i is padding). The model keeps its parameters, FFNs and position embeddings; only the mixing
across positions is taken away. What a task gains from full attention over this arm is the task's own scale of
"how much attention matters", against which an equivalence margin can be read.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from einops import einsum, rearrange
from torch import Tensor

from attention_zoo.core import AttentionCore, DecodingState
from attention_zoo.masks import MaskMod
from attention_zoo.registry import register_attention


def self_only_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Query i sees key i only."""
    return q_idx == kv_idx


@register_attention("self_only")
class SelfOnlyAttention(
    AttentionCore, approximation="fixed sparsity", supports_cross_attention=False, supports_double_backward=True,
    has_decoding_cache=True, position_free_queries=False, mixes_positions=False,
    supports_segments=True,
):  # fmt: skip
    """Packed rows (``segments``): each position still reads its own value only, so packing changes nothing."""

    # not position-free: query i's output is value i, so it depends on the query's index
    notes: ClassVar[str] = "control arm: no mixing across positions (output = own value vector)"

    def mask_mod(self, n: int, causal: bool, device: torch.device | str | None = None) -> MaskMod:
        """The diagonal pattern (causal or not: a position always sees itself)."""
        return self_only_mask

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        return self.attend_to_own_key(q, k, v)

    def attend_to_own_key(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax over the one key i, written out so that q and k stay in the graph with their exact, zero,
        gradients; padded values are already zero (the contract zeroes them), so a padded position gives 0."""
        score = einsum(q, k, "b h n d, b h n d -> b h n") * self.scale
        weight = torch.exp(score - score)
        return rearrange(weight, "b h n -> b h n 1") * v

    def start_decoding(self) -> DecodingState:
        self.check_decodable()
        return DecodingState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        return self.attend_to_own_key(q, k, v)
