"""Pre-norm Transformer encoder and decoder that take any registered attention core by name.

Pre-norm residual blocks (Xiong et al. 2020, arXiv:2002.04745): x + Attn(LN(x)), x + FF(LN(x)), and a
final LayerNorm, initialised by the convention of :mod:`attention_zoo.init`. The encoder, the decoder and their
layers take one :class:`~attention_zoo.config.ModelConfig`. Every layer builds its own core from the config's
attention spec; cores that share state across layers (Linformer's layerwise projection) keep it in
``shared_attention_state``, owned here.

Incremental decoding (:meth:`TransformerDecoder.start_decoding`, :meth:`TransformerDecoder.decode`): a
:class:`DecoderState` holds, per layer, the self-attention core's decoding state and the cross-attention's
keys and values of the encoder output, projected once per source. Feeding a sequence in pieces gives the
hidden states of :meth:`TransformerDecoder.forward` over the whole sequence (up to summation order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attention_zoo import packing
from attention_zoo.config import ModelConfig, Positional
from attention_zoo.core import BuildContext, DecodingState
from attention_zoo.init import init_transformer_
from attention_zoo.mha import MultiHeadAttention, ProjectedMemory
from attention_zoo.registry import get_attention_class, list_attentions
from attention_zoo.short_convolution import ShortConvolution
from attention_zoo.spec import AttentionSpec


class PositionalEmbedding(nn.Module):
    """Learned absolute positions, or the fixed sinusoids of Vaswani et al. 2017 (section 3.5)."""

    def __init__(self, dim: int, max_seq_len: int, kind: Positional = "learned") -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.kind = kind
        if kind == "learned":
            self.table = nn.Embedding(max_seq_len, dim)
        elif kind == "sinusoidal":
            position = torch.arange(max_seq_len, dtype=torch.float32)[:, None]
            inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
            table = torch.zeros(max_seq_len, dim)
            table[:, 0::2] = torch.sin(position * inv_freq)
            table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
            self.register_buffer("sinusoids", table, persistent=False)
        else:
            raise ValueError(f"positional must be 'learned' or 'sinusoidal', got {kind!r}")

    def forward(self, n: int, start: int = 0) -> Tensor:
        """The embeddings of positions ``start .. start + n - 1``: (n, dim); a learned table times √dim (stored
        at N(0, 1/dim), :mod:`attention_zoo.init`), sinusoids as they are (unit amplitude)."""
        if start + n > self.max_seq_len:
            raise ValueError(
                f"sequence length {start + n} exceeds max_seq_len={self.max_seq_len} of the position embedding"
            )
        if self.kind == "learned":
            return self.table.weight[start : start + n] * math.sqrt(self.table.embedding_dim)
        return self.sinusoids[start : start + n]

    def at(self, positions: Tensor) -> Tensor:
        """The embeddings of the positions ``positions`` (B, N) (each a document's own count in packed rows):
        (B, N, dim), as :meth:`forward` gives them."""
        if positions.numel() and int(positions.max()) >= self.max_seq_len:
            raise ValueError(
                f"position {int(positions.max())} exceeds max_seq_len={self.max_seq_len} of the position embedding"
            )
        table = self.table.weight * math.sqrt(self.table.embedding_dim) if self.kind == "learned" else self.sinusoids
        return F.embedding(positions, table)


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__(
            nn.Linear(dim, dim * mult), nn.GELU(), nn.Dropout(dropout), nn.Linear(dim * mult, dim), nn.Dropout(dropout)
        )

    @property
    def residual_projection(self) -> nn.Linear:
        """The second Linear, which writes into the residual stream (scaled down at init)."""
        return self[3]


def attention_block(
    config: ModelConfig, spec: AttentionSpec, max_seq_len: int, context: BuildContext | None, **role: bool
) -> MultiHeadAttention:
    """A layer's multi-head attention: ``spec``'s core at the config's width, heads and dropout; ``role``:
    ``causal`` or ``cross_attention``."""
    return MultiHeadAttention(
        config.dim,
        config.heads,
        attention=spec.name,
        attention_options=dict(spec.options),
        dim_head=config.dim_head,
        max_seq_len=max_seq_len,
        dropout=config.dropout,
        context=context,
        **role,
    )


class _Backbone(nn.Module):
    """Token + position embedding, then the layers, then LayerNorm; shared by encoder and decoder, which give
    their own vocabulary and length (a decoder's may differ from the config's source side)."""

    def __init__(self, config: ModelConfig, vocab_size: int, max_seq_len: int) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(vocab_size, config.dim)
        self.position_embedding = PositionalEmbedding(config.dim, max_seq_len, config.positional)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.norm = nn.LayerNorm(config.dim)
        #: state cores share across layers (e.g. one Linformer projection for the whole model)
        self.shared_attention_state = nn.ModuleDict()

    def context(self, layer_index: int, depth: int, shared: nn.ModuleDict | None = None) -> BuildContext:
        """Layer ``layer_index`` of ``depth``, sharing ``shared`` (default: ``shared_attention_state``)."""
        shared = self.shared_attention_state if shared is None else shared
        return BuildContext(layer_index=layer_index, num_layers=depth, shared=shared)

    def embed(self, tokens: Tensor, start: int = 0, segments: Tensor | None = None) -> Tensor:
        """Token + position embeddings of ``tokens`` (B, N) at positions ``start .. start + N - 1`` (with packed
        rows' ``segments``: each document's positions counted from its start); the token embedding is multiplied
        by √dim (Vaswani et al., section 3.4)."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (B, N) integer ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.long, torch.int):
            raise ValueError(f"tokens must be integer ids (torch.long or torch.int), got {tokens.dtype}")
        vocab_size = self.token_embedding.num_embeddings
        if tokens.numel() and not torch.compiler.is_compiling():  # one min/max per batch; no graph break
            low, high = (int(v) for v in torch.aminmax(tokens))
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"token id {bad} is out of range for vocab_size={vocab_size}: ids must be in [0, {vocab_size - 1}]"
                )
        if segments is None:
            positions = self.position_embedding(tokens.shape[1], start)
        else:
            positions = self.position_embedding.at(packing.positions_in_documents(segments, tokens.shape[1]))
        scale = math.sqrt(self.token_embedding.embedding_dim)
        return self.embedding_dropout(self.token_embedding(tokens) * scale + positions)


class EncoderLayer(nn.Module):
    """Self-attention (the config's ``attention``, over up to ``max_seq_len`` positions) and feed-forward;
    ``causal`` restricts each position to itself and the ones before it."""

    def __init__(self, config: ModelConfig, *, causal: bool = False, context: BuildContext | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.dim)
        self.attn = attention_block(config, config.attention, config.max_seq_len, context, causal=causal)
        self.ff_norm = nn.LayerNorm(config.dim)
        self.ff = FeedForward(config.dim, config.ff_mult, config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None, segments: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), mask=mask, segments=segments)
        return x + self.ff(self.ff_norm(x))


class TransformerEncoder(_Backbone):
    """``forward(tokens (B, N), mask (B, N) bool | None) -> hidden states (B, N, dim)``: ``config.depth`` layers
    of ``config.attention`` over ``config.vocab_size`` tokens and up to ``config.max_seq_len`` positions, after
    the config's ``short_convolution`` if any. ``causal``: every layer attends causally (a decoder-only model).
    """

    def __init__(self, config: ModelConfig, *, causal: bool = False) -> None:
        super().__init__(config, config.vocab_size, config.max_seq_len)
        kernel = config.short_convolution
        self.short_convolution = ShortConvolution(config.dim, kernel) if kernel else None
        self.layers = nn.ModuleList(
            EncoderLayer(config, causal=causal, context=self.context(i, config.depth)) for i in range(config.depth)
        )
        init_transformer_(self, residual_branches=2 * config.depth)

    def forward(self, tokens: Tensor, mask: Tensor | None = None, segments: Tensor | None = None) -> Tensor:
        """``segments`` (B, S + 1): packed rows' document boundaries (:mod:`attention_zoo.packing`): positions count
        from each document's start, and neither the short convolution nor attention crosses a boundary, so each
        document's hidden states equal those of the document alone."""
        # b: batch, n: positions
        x = self.embed(tokens, segments=segments)
        if self.short_convolution is not None:
            x = self.short_convolution(x, mask, segments)
        for layer in self.layers:
            x = layer(x, mask, segments)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """Causal self-attention (``self_attention``, over up to ``max_seq_len`` positions), cross-attention (the
    config's ``cross_attention``, over up to ``config.max_seq_len`` memory positions) and feed-forward; each
    attention built in its own ``BuildContext``."""

    def __init__(
        self,
        config: ModelConfig,
        self_attention: AttentionSpec,
        max_seq_len: int,
        *,
        self_context: BuildContext,
        cross_context: BuildContext,
    ) -> None:
        super().__init__()
        self.self_norm = nn.LayerNorm(config.dim)
        self.self_attn = attention_block(config, self_attention, max_seq_len, self_context, causal=True)
        self.cross_norm = nn.LayerNorm(config.dim)
        self.cross_attn = attention_block(
            config, config.cross_attention, config.max_seq_len, cross_context, cross_attention=True
        )
        self.ff_norm = nn.LayerNorm(config.dim)
        self.ff = FeedForward(config.dim, config.ff_mult, config.dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        mask: Tensor | None,
        memory_mask: Tensor | None,
        segments: Tensor | None = None,
        memory_segments: Tensor | None = None,
    ) -> Tensor:
        x = x + self.self_attn(self.self_norm(x), mask=mask, segments=segments)
        x = x + self.cross_attn(
            self.cross_norm(x), memory, mask=memory_mask, segments=segments, memory_segments=memory_segments
        )
        return x + self.ff(self.ff_norm(x))

    def decode(self, x: Tensor, state: LayerDecodingState) -> Tensor:
        x = x + self.self_attn.decode(self.self_norm(x), state.self_attention)
        x = x + self.cross_attn.attend_memory(self.cross_norm(x), state.memory)
        return x + self.ff(self.ff_norm(x))


@dataclass
class LayerDecodingState:
    """One decoder layer's state: its self-attention core's :class:`DecodingState` (one row per
    hypothesis) and its cross-attention's projected memory (one row per source)."""

    self_attention: DecodingState
    memory: ProjectedMemory


class DecoderState:
    """What :meth:`TransformerDecoder.decode` keeps between steps for a batch of S sources with
    ``hypotheses_per_source`` = G hypotheses each (G = 1 for greedy decoding, the beam size for beam search).

    Hypothesis rows are grouped by source: rows ``s * G .. s * G + G - 1`` belong to source s.
    ``length`` is the number of positions fed so far.
    """

    def __init__(self, layers: list[LayerDecodingState], hypotheses_per_source: int) -> None:
        self.layers = layers
        self.hypotheses_per_source = hypotheses_per_source
        self.length = 0

    def reorder(self, index: Tensor) -> None:
        """Hypothesis row r continues as old row ``index[r]`` (beam search keeps, repeats or drops
        hypotheses). Each row must stay with its own source: ``index[r] // G == r // G``, so the memory,
        projected once per source, needs no reordering."""
        group = self.hypotheses_per_source
        rows = torch.arange(index.numel(), device=index.device)
        if index.ndim != 1 or not bool(torch.equal(index // group, rows // group)):
            raise ValueError(
                f"reorder: index {index.tolist()} moves a hypothesis to another source "
                f"(rows s*{group} .. s*{group}+{group - 1} belong to source s)"
            )
        for layer in self.layers:
            layer.self_attention.reorder(index)


class TransformerDecoder(_Backbone):
    """The decoder side of a :class:`~attention_zoo.config.ModelConfig`: causal self-attention (the config's
    :meth:`~attention_zoo.config.ModelConfig.decoder_rule`, kept as ``decoder_rule``) + cross-attention to an
    encoder's output (``cross_attention``) + feed-forward, per layer; ``decoder_depth`` (default ``depth``)
    layers over ``target_vocab_size`` (default ``vocab_size``) tokens and up to ``max_target_len`` (default
    ``max_seq_len``) positions, attending to up to ``max_seq_len`` memory positions. Cross-attention cores are
    built like the self-attention ones (layer index, number of layers: a per-layer option, a different Performer
    draw per layer), sharing state across layers in ``shared_cross_attention_state``.

    ``forward(tokens (B, N), memory (B, M, dim), mask (B, N) | None, memory_mask (B, M) | None)``
    returns hidden states (B, N, dim).
    """

    def __init__(self, config: ModelConfig) -> None:
        vocab_size = config.vocab_size if config.target_vocab_size is None else config.target_vocab_size
        max_seq_len = config.max_seq_len if config.max_target_len is None else config.max_target_len
        super().__init__(config, vocab_size, max_seq_len)
        cross_attention = config.cross_attention.name
        if not get_attention_class(cross_attention).position_free_queries:
            usable = list_attentions(cross=True, position_free_queries=True)
            raise ValueError(
                f"cross_attention={cross_attention!r} weights a query by its position in the call, which step-by-step "
                f"decoding (one query at a time, or beams stacked) does not reproduce; use one of {', '.join(usable)}"
            )
        self.decoder_rule = config.decoder_rule()
        depth = config.depth if config.decoder_depth is None else config.decoder_depth
        own = AttentionSpec(self.decoder_rule.attention, self.decoder_rule.options)
        #: what the cross-attention cores share across layers: apart from the self-attention's, so that no key
        #: of one (e.g. a layerwise projection of another length) can meet the other's
        self.shared_cross_attention_state = nn.ModuleDict()
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                own,
                max_seq_len,
                self_context=self.context(i, depth),
                cross_context=self.context(i, depth, self.shared_cross_attention_state),
            )
            for i in range(depth)
        )
        init_transformer_(self, residual_branches=3 * depth)

    def forward(
        self,
        tokens: Tensor,
        memory: Tensor,
        mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        segments: Tensor | None = None,
        memory_segments: Tensor | None = None,
    ) -> Tensor:
        """Packed rows: ``segments`` (B, S + 1) are the targets' document boundaries and ``memory_segments`` the
        sources' (:mod:`attention_zoo.packing`), with the same S: target document s attends causally to itself
        and crosses to source document s only."""
        # b: batch, n: target positions, m: source positions
        if (segments is None) != (memory_segments is None):
            raise ValueError("packed decoding rows need both segments (targets) and memory_segments (sources)")
        x = self.embed(tokens, segments=segments)
        for layer in self.layers:
            x = layer(x, memory, mask, memory_mask, segments, memory_segments)
        return self.norm(x)

    def start_decoding(
        self, memory: Tensor, memory_mask: Tensor | None = None, *, hypotheses_per_source: int = 1
    ) -> DecoderState:
        """A fresh :class:`DecoderState` for ``memory`` (S, M, dim) of S sources; every layer projects the
        memory into its cross-attention keys and values here, once."""
        if hypotheses_per_source < 1:
            raise ValueError(f"hypotheses_per_source must be >= 1, got {hypotheses_per_source}")
        layers = [
            LayerDecodingState(layer.self_attn.start_decoding(), layer.cross_attn.project_memory(memory, memory_mask))
            for layer in self.layers
        ]
        return DecoderState(layers, hypotheses_per_source)

    def decode(self, tokens: Tensor, state: DecoderState) -> Tensor:
        """Hidden states (S * G, T, dim) of the next T tokens (S * G, T) of every hypothesis, given the
        tokens fed before; equal to :meth:`forward` over the whole prefix at those positions."""
        # r: hypothesis rows (source-major), t: new positions
        x = self.embed(tokens, start=state.length)
        for layer, layer_state in zip(self.layers, state.layers, strict=True):
            x = layer.decode(x, layer_state)
        state.length += tokens.shape[1]
        return self.norm(x)
