"""Sparse attention, exact on a pattern: local, strided/fixed, blockwise, Longformer, BigBird, StreamingLLM.

``patterns`` and ``mask_mods`` define the patterns; ``attention`` holds the cores and the dense reference
path, ``streaming_llm`` Longformer's causal form with StreamingLLM's defaults; ``tiled``, ``band``,
``band_and_tiles`` and ``flex`` are the fast paths."""

from attention_zoo.sparse.attention import (
    BigBirdAttention,
    LocalAttention,
    LongformerAttention,
    PatternAttention,
    SparseAttention,
)
from attention_zoo.sparse.streaming_llm import StreamingLLMAttention

__all__ = [
    "BigBirdAttention",
    "LocalAttention",
    "LongformerAttention",
    "PatternAttention",
    "SparseAttention",
    "StreamingLLMAttention",
]
