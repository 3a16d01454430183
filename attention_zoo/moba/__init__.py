"""MoBA, Mixture of Block Attention (Lu et al. 2025, arXiv:2502.13189).

``attention`` holds the core, its gate and its dense reference path; ``layout`` groups the gated pairs by key
block; ``tiled`` and ``flash`` compute attention over them (other devices; the CPU through torch's flash op)."""

from attention_zoo.moba.attention import MixtureOfBlockAttention

__all__ = ["MixtureOfBlockAttention"]
