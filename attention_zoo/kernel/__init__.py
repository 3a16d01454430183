"""Kernelized (feature-map) attention: Performer, linear attention, cosFormer.

``attention`` holds what they share (feature map, causal and non-causal products); ``products``,
``bidirectional`` and ``causal_favor`` the products with their backward; one module per mechanism."""

from attention_zoo.kernel.cosformer import CosFormerAttention
from attention_zoo.kernel.linear import LinearAttention
from attention_zoo.kernel.performer import PerformerAttention

__all__ = ["CosFormerAttention", "LinearAttention", "PerformerAttention"]
