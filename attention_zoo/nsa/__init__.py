"""NSA, native sparse attention (Yuan et al. 2025, arXiv:2502.11089)."""

from attention_zoo.nsa.attention import NativeSparseAttention

__all__ = ["NativeSparseAttention"]
