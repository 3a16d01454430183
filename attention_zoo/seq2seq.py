"""Encoder-decoder Transformer for sequence-to-sequence tasks (translation), any registered core in each of
its three attention slots, with step-by-step decoding.

Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762: an encoder over the source, a decoder
with causal self-attention and cross-attention to the encoder output, and (section 3.4) one weight matrix
shared by the target embedding and the pre-softmax projection, logits = h E^T; with a shared (joint BPE)
vocabulary the source embedding is that matrix too. Pre-norm layers (see :mod:`attention_zoo.transformer`).

The model is built from one :class:`~attention_zoo.config.ModelConfig`; its three attention slots, each an
:class:`~attention_zoo.spec.AttentionSpec` (a registry name plus options):

- ``attention``: encoder self-attention (any core).
- ``decoder_attention``: decoder causal self-attention. When it is None, the *decoder rule*
  (:func:`resolve_decoder_attention`) picks it from ``attention``: the mechanism itself if it supports causal
  attention (with the encoder's options); else the registered core it declares as ``causal_counterpart``
  (``linformer`` -> ``linformer_causal``, ``nystrom`` -> ``full``), with that core's defaults; else an error
  listing the causal cores. A non-causal core named explicitly is an error listing them. The config's
  ``decoder_attention_options`` apply to whichever core the rule picks.
- ``cross_attention``: decoder-to-encoder attention, default ``full``; any core with
  ``supports_cross_attention`` (``linformer`` projects the memory with E, F sized by ``max_seq_len``, the
  longest source, and slices them for shorter sources).

Decoding: :meth:`Seq2SeqTransformer.start_decoding` encodes a batch of sources once and returns a session
for :mod:`attention_zoo.decoding.search`'s greedy and beam search, either cached (each layer's self-attention
state from the core's ``decode``, the cross-attention memory projected once per source) or recomputing
the decoder over the whole prefix at every step (``use_cache=False``, the reference).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from attention_zoo.config import DecoderRule, ModelConfig, causal_cores, resolve_decoder_attention
from attention_zoo.precision import compute_dtype
from attention_zoo.transformer import DecoderState, TransformerDecoder, TransformerEncoder

# the decoder rule is defined beside the config it reads, and is imported from here as well
__all__ = [
    "CachedDecoding",
    "DecoderRule",
    "RecomputedDecoding",
    "Seq2SeqTransformer",
    "causal_cores",
    "resolve_decoder_attention",
]


class Seq2SeqTransformer(nn.Module):
    """``forward(source (B, S), source_mask (B, S), target_in (B, T), target_mask (B, T)) -> logits (B, T, V)``.

    Built from one :class:`~attention_zoo.config.ModelConfig`: ``vocab_size`` is the source vocabulary, also the
    target's when ``target_vocab_size`` is None (one shared vocabulary, e.g. a joint BPE: encoder input, decoder
    input and output projection share one matrix); ``max_seq_len`` the longest source (encoder positions; the
    cross-attention core's ``max_seq_len``); ``max_target_len`` the longest decoder input (BOS y_1 .. y_{T-1}),
    so at most this many tokens are generated; ``depth`` layers each in the encoder and the decoder unless
    ``decoder_depth`` is given; ``attention``, ``decoder_attention``, ``cross_attention``: the three slots
    (module doc). ``decoder_rule`` records the decoder's self-attention and why.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # the rule first: a config without a usable decoder is refused before any weight is drawn
        self.decoder_rule: DecoderRule = config.decoder_rule()
        self.shared_vocabulary = config.target_vocab_size is None
        self.max_source_len = config.max_seq_len
        self.max_target_len = config.max_seq_len if config.max_target_len is None else config.max_target_len
        self.encoder = TransformerEncoder(config)
        self.decoder = TransformerDecoder(config)
        if self.shared_vocabulary:
            self.decoder.token_embedding = self.encoder.token_embedding

    def encode(
        self, source: Tensor, source_mask: Tensor | None = None, source_segments: Tensor | None = None
    ) -> Tensor:
        """Encoder output (B, S, dim); ``source_segments``: packed rows' boundaries (:mod:`attention_zoo.packing`)."""
        return self.encoder(source, source_mask, source_segments)

    def output_logits(self, hidden: Tensor) -> Tensor:
        """Tied output projection: logits = h E^T with E the target embedding, stored at N(0, 1/d) and multiplied
        by √d at the input only (Vaswani et al., section 3.4), so the logits have unit variance at initialisation."""
        return F.linear(hidden, self.decoder.token_embedding.weight)

    def forward(
        self,
        source: Tensor,
        source_mask: Tensor | None,
        target_in: Tensor,
        target_mask: Tensor | None = None,
        *,
        source_segments: Tensor | None = None,
        target_segments: Tensor | None = None,
    ) -> Tensor:
        """Packed rows: ``source_segments`` and ``target_segments`` (B, S + 1), the same S: example s of a row is
        source document s and target document s (:mod:`attention_zoo.packing`)."""
        # b: batch, s: source positions, t: target positions, v: target vocabulary
        memory = self.encode(source, source_mask, source_segments)
        hidden = self.decoder(target_in, memory, target_mask, source_mask, target_segments, source_segments)
        return self.output_logits(hidden)

    def start_decoding(
        self, source: Tensor, source_mask: Tensor | None, *, hypotheses_per_source: int = 1, use_cache: bool = True
    ) -> CachedDecoding | RecomputedDecoding:
        """Encode ``source`` once; the session :mod:`attention_zoo.decoding.search` drives for ``hypotheses_per_source``
        hypotheses per source (rows grouped by source). ``use_cache=False`` recomputes the decoder over the
        whole prefix at every step (cross-attention memory included), the reference for the cached path."""
        memory = self.encode(source, source_mask)
        if use_cache:
            return CachedDecoding(self, memory, source_mask, hypotheses_per_source)
        return RecomputedDecoding(self, memory, source_mask, hypotheses_per_source)


def _log_probs(logits: Tensor) -> Tensor:
    """Log-softmax in at least float32 (half-precision log-probabilities would tie beams that differ)."""
    return F.log_softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)


class CachedDecoding:
    """Feeds only the tokens the decoder has not seen (normally one per step) through
    :meth:`TransformerDecoder.decode`; :meth:`reorder` follows beam search's choice of hypotheses."""

    def __init__(self, model: Seq2SeqTransformer, memory: Tensor, memory_mask: Tensor | None, group: int) -> None:
        self.model = model
        self.state: DecoderState = model.decoder.start_decoding(memory, memory_mask, hypotheses_per_source=group)

    def next_log_probs(self, prefix: Tensor) -> Tensor:
        """Log-probabilities (R, V) of the token after each row's ``prefix`` (R, t), BOS first."""
        hidden = self.model.decoder.decode(prefix[:, self.state.length :], self.state)
        return _log_probs(self.model.output_logits(hidden[:, -1]))

    def reorder(self, index: Tensor) -> None:
        self.state.reorder(index)


class RecomputedDecoding:
    """Runs the whole decoder over the whole prefix at every step: no state, nothing to reorder."""

    def __init__(self, model: Seq2SeqTransformer, memory: Tensor, memory_mask: Tensor | None, group: int) -> None:
        self.model = model
        self.memory = memory.repeat_interleave(group, dim=0)
        self.memory_mask = None if memory_mask is None else memory_mask.repeat_interleave(group, dim=0)

    def next_log_probs(self, prefix: Tensor) -> Tensor:
        hidden = self.model.decoder(prefix, self.memory, None, self.memory_mask)
        return _log_probs(self.model.output_logits(hidden[:, -1]))

    def reorder(self, index: Tensor) -> None:
        """Nothing to do: the search reorders the prefixes it passes."""
