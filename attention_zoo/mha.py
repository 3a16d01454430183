"""Multi-head attention block: projections and head split/merge around any registered core.

MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with head_i = core(Q W_i^Q, K W_i^K, V W_i^V)
(Vaswani et al. 2017, eq. in section 3.2.2). The block owns every projection; the core owns only the
mechanism, so swapping cores leaves the projections' ``state_dict`` keys alone.

Step-by-step decoding: causal self-attention feeds the new positions to the core's
:meth:`~attention_zoo.core.AttentionCore.decode` with the state from :meth:`MultiHeadAttention.start_decoding`
(the core's cache, or its recompute fallback). Cross-attention projects the memory once
(:meth:`MultiHeadAttention.project_memory`) and attends to that at every step (:meth:`attend_memory`);
several hypotheses of one source (beam search) share its projected memory: their queries are stacked
along the query axis of the source's row. That is exact because a cross-attention query never sees
another query (every core with ``supports_cross_attention`` computes each query from the keys alone;
``tests/attention_zoo/test_decoding.py`` checks it over the registry). What is cached is the W^K, W^V projection of the
memory; a core that transforms the keys itself (Linformer's E K, F V) still does so at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from einops import rearrange
from torch import Tensor, nn

from attention_zoo.core import AttentionCore, BuildContext, DecodingState
from attention_zoo.registry import create_attention, get_attention_class


@dataclass
class ProjectedMemory:
    """The keys and values of a cross-attention block for one batch of sources, projected once:
    ``keys``, ``values`` (S, H, M, D); ``mask`` (S, M) bool, True = real token, or None."""

    keys: Tensor
    values: Tensor
    mask: Tensor | None

    @property
    def sources(self) -> int:
        return self.keys.shape[0]


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
        if not causal and cls.causal_only:
            raise ValueError(
                f"attention {attention!r} is causal only: use it where attention is causal (a decoder, a causal "
                "language model, an encoder built causal: zoo fit --model.causal true); bidirectional cores: "
                + ", ".join(_bidirectional_cores())
            )
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

    @property
    def residual_projection(self) -> nn.Linear:
        """W^O, which writes this block's output into the residual stream (scaled down at init)."""
        return self.to_out

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        segments: Tensor | None = None,
        memory_segments: Tensor | None = None,
    ) -> Tensor:
        """``x``: (B, N, dim) queries; ``memory``: (B, M, dim) keys/values for cross-attention (else x);
        ``mask``: (B, M) or (B, N) bool, True = real key token; ``segments``: packed rows' document boundaries
        (B, S + 1) of ``x`` and ``memory_segments`` those of ``memory`` (:mod:`attention_zoo.packing`)."""
        # b: batch, n: positions, h: heads, d: head dim
        if (memory is not None) != self.cross_attention:
            raise ValueError(
                "this block was built for "
                + ("cross-attention: pass memory" if self.cross_attention else "self-attention: do not pass memory")
            )
        if memory is not None and segments is not None:
            if memory_segments is None:
                raise ValueError("packed cross-attention needs memory_segments (the memory's document boundaries)")
            q = self._split(self.to_q(x))
            k, v = self._split(self.to_k(memory)), self._split(self.to_v(memory))
            out = self.core(q, k, v, mask=mask, segments=segments, key_segments=memory_segments)
            return self._merge(out)
        if memory is not None:
            return self.attend_memory(x, self.project_memory(memory, mask))
        q, k, v = self._project(x)
        out = self.core(q, k, v, mask=mask, causal=self.causal, segments=segments)
        return self._merge(out)

    def start_decoding(self) -> DecodingState:
        """A fresh state for :meth:`decode` (causal self-attention blocks only)."""
        if self.cross_attention or not self.causal:
            raise ValueError("step-by-step decoding needs a causal self-attention block (built with causal=True)")
        return self.core.start_decoding()

    def decode(self, x: Tensor, state: DecodingState, *, mask: Tensor | None = None) -> Tensor:
        """The causal self-attention of the next T positions ``x`` (B, T, dim) given every position fed
        before (kept in ``state``); equal to :meth:`forward` over the whole sequence at those positions."""
        q, k, v = self._project(x)
        return self._merge(self.core.decode(q, k, v, state, mask=mask))

    def project_memory(self, memory: Tensor, mask: Tensor | None = None) -> ProjectedMemory:
        """Keys and values of ``memory`` (S, M, dim) for :meth:`attend_memory` (cross-attention blocks)."""
        if not self.cross_attention:
            raise ValueError("project_memory needs a cross-attention block (built with cross_attention=True)")
        return ProjectedMemory(self._split(self.to_k(memory)), self._split(self.to_v(memory)), mask)

    def attend_memory(self, x: Tensor, memory: ProjectedMemory) -> Tensor:
        """Cross-attention of queries ``x`` (S * G, N, dim) to projected memory of S sources: rows
        ``s * G .. s * G + G - 1`` (G hypotheses of source s, e.g. its beams) all read source s."""
        # s: source, g: hypothesis of a source, n: query positions, h: heads, d: head dim
        rows, sources = x.shape[0], memory.sources
        if sources == 0 or rows % sources:
            raise ValueError(f"{rows} query rows do not split into hypotheses of {sources} sources")
        q = rearrange(self.to_q(x), "(s g) n (h d) -> s h (g n) d", s=sources, h=self.heads)
        out = self.core(q, memory.keys, memory.values, mask=memory.mask, causal=False)
        return self._merge(rearrange(out, "s h (g n) d -> (s g) h n d", n=x.shape[1]))

    def _split(self, t: Tensor) -> Tensor:
        return rearrange(t, "b n (h d) -> b h n d", h=self.heads)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.shared_qk:
            q = k = self._split(self.to_qk(x))
        else:
            q, k = self._split(self.to_q(x)), self._split(self.to_k(x))
        return q, k, self._split(self.to_v(x))

    def _merge(self, out: Tensor) -> Tensor:
        return self.dropout(self.to_out(rearrange(out, "b h n d -> b n (h d)")))


def _bidirectional_cores() -> list[str]:
    from attention_zoo.registry import list_attentions

    return list_attentions(causal_only=False)


def _cross_cores() -> list[str]:
    from attention_zoo.registry import list_attentions

    return list_attentions(cross=True)
