"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, arXiv:2412.06464).

``attention`` holds the registered core, its gates and its decoding state; ``chunked`` the chunkwise (WY / UT
transform) form and the recurrent form it computes with; ``reference`` the float64 loop over positions that the
tests compare them to."""

from attention_zoo.gated_deltanet.attention import DeltaState, GatedDeltaNet

__all__ = ["DeltaState", "GatedDeltaNet"]
