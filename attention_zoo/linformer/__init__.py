"""Linformer (Wang et al. 2020, arXiv:2006.04768): keys and values projected along the sequence axis.

``attention`` holds the bidirectional core, ``causal`` the blockwise causal variant, ``projections`` the
E, F projections both use."""

from attention_zoo.linformer.attention import LinformerAttention
from attention_zoo.linformer.causal import CausalLinformerAttention

__all__ = ["CausalLinformerAttention", "LinformerAttention"]
