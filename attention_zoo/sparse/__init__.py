"""Sparse attention, exact on a pattern: local, strided/fixed, blockwise, Longformer, BigBird.

``patterns`` and ``mask_mods`` define the patterns; ``attention`` holds the cores and the dense reference
path; ``tiled``, ``band``, ``band_and_tiles`` and ``flex`` are the fast paths."""

from attention_zoo.sparse.attention import (
    BigBirdAttention,
    LocalAttention,
    LongformerAttention,
    PatternAttention,
    SparseAttention,
)

__all__ = ["BigBirdAttention", "LocalAttention", "LongformerAttention", "PatternAttention", "SparseAttention"]
