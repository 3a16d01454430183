"""Nystromformer (Xiong et al. 2021, arXiv:2102.03902): softmax attention through landmarks."""

from attention_zoo.nystrom.attention import NystromAttention

__all__ = ["NystromAttention"]
