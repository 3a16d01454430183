"""One model configuration (:class:`ModelConfig`), passed from the task to the encoder, the decoder and every
layer, as litgpt passes its ``Config``; and the decoder rule (:func:`resolve_decoder_attention`), which picks a
decoder's self-attention from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from attention_zoo.core import AttentionCore
from attention_zoo.registry import get_attention_class, list_attentions
from attention_zoo.spec import AttentionSpec

Positional = Literal["learned", "sinusoidal"]


@dataclass(frozen=True)
class ModelConfig:
    """The sizes, the layers and the attention of a model, each field with a default:

    Sizes (a task sets them from its data):
        vocab_size (256): token vocabulary; in an encoder-decoder the source's, and the target's too unless
            ``target_vocab_size`` is given (one shared embedding matrix).
        max_seq_len (512): longest sequence the encoder takes; in an encoder-decoder the longest source, which
            is also the ``max_seq_len`` of the cross-attention cores.

    Layers:
        dim (64): model width.
        depth (2): number of layers (of the encoder, and of the decoder unless ``decoder_depth`` is given).
        heads (4): attention heads per layer.
        dim_head (None): width of one head; None: ``dim // heads``, and then ``heads`` must divide ``dim``.
        ff_mult (4): feed-forward hidden width as a multiple of ``dim``.
        dropout (0.0): dropout on the embeddings, the attention output and the feed-forward, in [0, 1).
        positional ("learned"): ``learned`` or ``sinusoidal`` absolute positions.
        short_convolution (0): kernel size of a causal depthwise convolution over the encoder's embeddings
            before its first layer (:mod:`attention_zoo.short_convolution`); 0 adds none. The decoder has none.

    Attention, each an :class:`AttentionSpec`; a string in the flag syntax (``"linformer:k=32"``) or a mapping
    ``{name, options}`` is turned into one, and every spec is checked against the registry here:
        attention ("full"): the encoder's self-attention.

    Encoder-decoder (:class:`attention_zoo.Seq2SeqTransformer`, and a lone :class:`attention_zoo.TransformerDecoder`):
        target_vocab_size (None): a separate target vocabulary; None: the shared ``vocab_size``.
        max_target_len (None): longest decoder input, BOS included; None: ``max_seq_len``.
        decoder_depth (None): decoder layers; None: ``depth``.
        decoder_attention (None): the decoder's causal self-attention; None: the decoder rule
            (:func:`resolve_decoder_attention`) picks it from ``attention``.
        decoder_attention_options (None): options for the core the decoder rule picks when
            ``decoder_attention`` is None (with ``decoder_attention`` set, its spec holds its options).
        cross_attention ("full"): decoder-to-encoder attention.

    On the command line the config is flattened: the task's flags are the config's fields
    (``--model.dim 128``, ``--model.attention linformer --model.attention_options.k 32``), declared once by
    :class:`tasks.base.ZooTask` (the translation task adds the encoder-decoder ones), so a run's
    ``hparams.yaml`` and checkpoint hold flat keys and old ones keep loading.
    """

    vocab_size: int = 256
    max_seq_len: int = 512
    dim: int = 64
    depth: int = 2
    heads: int = 4
    dim_head: int | None = None
    ff_mult: int = 4
    dropout: float = 0.0
    positional: Positional = "learned"
    short_convolution: int = 0
    attention: AttentionSpec | str = "full"
    target_vocab_size: int | None = None
    max_target_len: int | None = None
    decoder_depth: int | None = None
    decoder_attention: AttentionSpec | str | None = None
    decoder_attention_options: Mapping[str, Any] | None = None
    cross_attention: AttentionSpec | str = "full"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "dim", "depth", "heads", "ff_mult"):
            _check_int(name, getattr(self, name), least=1)
        for name in ("dim_head", "target_vocab_size", "max_target_len", "decoder_depth"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), least=1, note=", or None")
        _check_int("short_convolution", self.short_convolution, least=0, note="; 0: none")
        if self.dim_head is None and self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}; pass dim_head explicitly")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.positional not in get_args(Positional):
            raise ValueError(f"positional must be 'learned' or 'sinusoidal', got {self.positional!r}")
        for name in ("attention", "decoder_attention", "cross_attention"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, AttentionSpec.of(value).checked())
        options = self.decoder_attention_options
        if options is not None:
            if not isinstance(options, Mapping):
                raise ValueError(f"decoder_attention_options must be a mapping of options or None, got {options!r}")
            if self.decoder_attention is not None:
                raise ValueError(
                    f"decoder_attention_options {dict(options)} beside decoder_attention "
                    f"{self.decoder_attention.label!r}: give the options in its spec (name:option=value)"
                )
            object.__setattr__(self, "decoder_attention_options", dict(options))

    def decoder_rule(self) -> DecoderRule:
        """The decoder's self-attention: ``decoder_attention``, or the decoder rule's pick from ``attention``."""
        chosen = self.decoder_attention
        return resolve_decoder_attention(
            self.attention.name,
            self.attention.options,
            None if chosen is None else chosen.name,
            self.decoder_attention_options if chosen is None else chosen.options,
        )


def _check_int(name: str, value: Any, *, least: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be >= {least} (an int{note}), got {value!r}")


@dataclass(frozen=True)
class DecoderRule:
    """The decoder's self-attention as resolved from the model's slots, and why (for logs and run records)."""

    attention: str
    options: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def causal_cores() -> list[str]:
    return list_attentions(causal=True)


def resolve_decoder_attention(
    attention: str,
    attention_options: Mapping[str, Any] | None = None,
    decoder_attention: str | None = None,
    decoder_attention_options: Mapping[str, Any] | None = None,
) -> DecoderRule:
    """The decoder self-attention for encoder ``attention`` (see :mod:`attention_zoo.seq2seq`): ``decoder_attention``
    if given (it must be causal); else ``attention`` itself if causal (with ``decoder_attention_options``, or the
    encoder's options when those are None); else its declared ``causal_counterpart`` (with
    ``decoder_attention_options`` or its defaults). Raises ``ValueError`` naming the causal cores when there is none."""
    allowed = "causal cores: " + ", ".join(causal_cores())
    if decoder_attention is not None:
        if not get_attention_class(decoder_attention).supports_causal:
            raise ValueError(f"decoder_attention {decoder_attention!r} is not causal; {allowed}")
        return DecoderRule(decoder_attention, dict(decoder_attention_options or {}), "set by decoder_attention")
    cls: type[AttentionCore] = get_attention_class(attention)
    if cls.supports_causal:
        if decoder_attention_options is None:
            options, source = dict(attention_options or {}), "the encoder's options"
        else:
            options, source = dict(decoder_attention_options), "decoder_attention_options"
        return DecoderRule(attention, options, f"{attention} supports causal attention: used with {source}")
    counterpart = cls.causal_counterpart
    if counterpart is None:
        raise ValueError(
            f"attention {attention!r} is not causal and declares no causal_counterpart, so the decoder needs "
            f"--model.decoder_attention; {allowed}"
        )
    options = dict(decoder_attention_options or {})
    source = "decoder_attention_options" if decoder_attention_options else "its default options"
    return DecoderRule(
        counterpart, options, f"{attention} is not causal: its declared causal_counterpart {counterpart}, with {source}"
    )
