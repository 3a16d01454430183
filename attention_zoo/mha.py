"""Multi-head attention block: projections and head split/merge around any registered core.

MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with head_i = core(Q W_i^Q, K W_i^K, V W_i^V)
(Vaswani et al. 2017, eq. in section 3.2.2). The block owns every projection; the core owns only the
mechanism, so swapping cores leaves the projections' ``state_dict`` keys alone.
"""

from __future__ import annotations

from typing import Any

from einops import rearrange
from torch import Tensor, nn

from attention_zoo.core import AttentionCore, BuildContext
from attention_zoo.registry import create_attention, get_attention_class


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with ``heads`` heads of width ``dim_head`` (default ``dim // heads``).

    With a core whose ``needs_shared_qk`` is set (Reformer's LSH), queries and keys come from one
    projection, as that mechanism requires.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        attention: str = "full",
        attention_options: dict[str, Any] | None = None,
        dim_head: int | None = None,
        max_seq_len: int | None = None,
        causal: bool = False,
        cross_attention: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        context: BuildContext | None = None,
    ) -> None:
        super().__init__()
        if dim_head is None:
            if dim % heads:
                raise ValueError(f"dim={dim} is not divisible by heads={heads}; pass dim_head explicitly")
            dim_head = dim // heads
        cls = get_attention_class(attention)
        if causal and not cls.supports_causal:
            raise ValueError(f"attention {attention!r} does not support causal attention. {cls.causal_alternative()}")
        if cross_attention and not cls.supports_cross_attention:
            raise ValueError(
                f"attention {attention!r} does not support cross-attention; cores that do: " + ", ".join(_cross_cores())
            )
        self.heads = heads
        self.causal = causal
        self.cross_attention = cross_attention
        self.shared_qk = cls.needs_shared_qk
        inner = heads * dim_head
        if self.shared_qk:
            self.to_qk = nn.Linear(dim, inner, bias=bias)
        else:
            self.to_q = nn.Linear(dim, inner, bias=bias)
            self.to_k = nn.Linear(dim, inner, bias=bias)
        self.to_v = nn.Linear(dim, inner, bias=bias)
        self.to_out = nn.Linear(inner, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.core: AttentionCore = create_attention(
            attention,
            dim_head=dim_head,
            heads=heads,
            max_seq_len=max_seq_len,
            context=context,
            **(attention_options or {}),
        )

    def forward(self, x: Tensor, memory: Tensor | None = None, *, mask: Tensor | None = None) -> Tensor:
        """``x``: (B, N, dim) queries; ``memory``: (B, M, dim) keys/values for cross-attention (else x);
        ``mask``: (B, M) or (B, N) bool, True = real key token."""
        # b: batch, n: positions, h: heads, d: head dim
        if (memory is not None) != self.cross_attention:
            raise ValueError(
                "this block was built for "
                + ("cross-attention: pass memory" if self.cross_attention else "self-attention: do not pass memory")
            )
        source = x if memory is None else memory
        split = lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads)
        if self.shared_qk:
            q = k = split(self.to_qk(x))
        else:
            q, k = split(self.to_q(x)), split(self.to_k(source))
        v = split(self.to_v(source))
        out = self.core(q, k, v, mask=mask, causal=self.causal)
        return self.dropout(self.to_out(rearrange(out, "b h n d -> b n (h d)")))


def _cross_cores() -> list[str]:
    from attention_zoo.registry import list_attentions

    return [n for n in list_attentions() if get_attention_class(n).supports_cross_attention]
