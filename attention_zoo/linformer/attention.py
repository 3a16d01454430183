"""Linformer: self-attention over keys and values projected along the sequence axis.

Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity", arXiv:2006.04768, eq. (7):

    head_i = Attention(Q W_i^Q, E_i K W_i^K, F_i V W_i^V)
           = softmax(Q W_i^Q (E_i K W_i^K)^T / sqrt(d_k)) . F_i V W_i^V,   E_i, F_i in R^{k x n}

with the context mapping matrix P_bar (n x k): O(n k) time and memory instead of O(n^2). The core sees
the already projected heads (q, k, v of :class:`~attention_zoo.core.AttentionCore`) and applies E_i, F_i.

Options (section 4, "Additional Efficiency Techniques"):
- ``sharing``: ``none`` one E_i, F_i per head and layer (eq. 7 as written); ``headwise`` one E, F per
  layer; ``kv`` one E = F per layer; ``layerwise`` one E = F for the whole model (the same parameter,
  kept in the model's ``Geometry.shared``). A 12-layer, 12-head model then has 288 / 24 / 12 / 1
  distinct k x n matrices. Default ``headwise``, as in the authors' fairseq code (one ``compress_k``
  and one ``compress_v`` per layer for all heads). For the parameter-free pooling projections sharing
  changes nothing; for ``random`` it decides which fixed matrices are distinct draws.
- ``projection``: learned ``linear`` (init: :func:`~attention_zoo.linformer.projections.scaled_xavier_`),
  ``mean_pool`` / ``max_pool`` / learned ``conv`` with kernel = stride = n / k, or ``random``, the fixed
  N(0, 1/k) JL matrix R of Theorems 1-2 (a buffer, not trained). See :mod:`attention_zoo.linformer.projections`.
- ``k``: one int, or one per layer (the "nonuniform projected dimension", e.g. smaller k in higher
  layers, whose spectra are more skewed, Figure 1 right); indexed by ``context.layer_index``. All heads
  of a layer share k, so a layer stays one batched matmul; ``layerwise`` needs a single k.

Lengths: n = ``max_seq_len``; a shorter input of length m uses the first m columns of E, F (slicing, as
the WMT14 report suggests; windowed projections: :mod:`attention_zoo.linformer.projections`); a longer one raises.
Padding: padded keys and values are zeroed before the projection, and slots that received no real token
(empty pooling windows) are left out of the softmax, so padded content never changes an output and a
right-padded input gives the outputs of the unpadded one (up to summation order). A batch row with no
real token gives zeros. Queries are not projected, so cross-attention works too (Nq != Nk; the base
class bounds both by max_seq_len, although only Nk sizes E and F).

Not causal: every projected key mixes all positions, the future included (public implementations either
refuse causal masking or leak); use ``linformer_causal``. Not exact, except in the identity limit
(``mean_pool`` / ``max_pool`` with k = n). Theorem 2's existence argument needs a vanishing scale on E;
Linformer with random E, F is *not* close to softmax attention - learned projections are what make it
work.
"""

from __future__ import annotations

from typing import ClassVar

from einops import rearrange
from torch import Tensor

from attention_zoo.core import AttentionCore, Geometry
from attention_zoo.linformer.projections import Projection, Sharing, build_projections, check_projected_length
from attention_zoo.masks import sdpa
from attention_zoo.registry import register_attention

DEFAULT_K = 256  # the paper's projected length for n = 512..4096 (Fig. 3, Table 2)


def default_k(max_seq_len: int) -> int:
    """The k of ``k=None``: the paper's 256, capped by the length (k >= n cannot compress)."""
    return min(DEFAULT_K, max_seq_len)


@register_attention("linformer")
class LinformerAttention(
    AttentionCore, approximation="low rank", supports_causal=False,
    requires_max_seq_len=True, supports_double_backward=True, supports_segments=True,
):  # fmt: skip
    """Packed rows (``segments``): E and F are sliced to each document's length, as for a short sequence, so each
    document attends to its own k summaries only (computed by unpacking the documents,
    :func:`~attention_zoo.packing.unpacked_attention`)."""

    example_configs = (
        {"k": 16},
        {"k": 16, "sharing": "none"},
        {"k": 8, "sharing": "kv"},
        {"k": 8, "sharing": "layerwise"},
        {"k": 16, "projection": "mean_pool"},
        {"k": 8, "projection": "max_pool"},
        {"k": 16, "projection": "conv", "sharing": "none"},
        {"k": 8, "projection": "conv", "sharing": "kv"},
        {"k": 8, "projection": "random", "sharing": "none"},
    )
    causal_counterpart: ClassVar[str | None] = "linformer_causal"
    notes: ClassVar[str] = (
        "default k = min(256, max_seq_len); "
        "not causal (use linformer_causal); learned E/F are k x max_seq_len, shorter inputs slice them; "
        "exact only in the identity limit (mean/max pool with k = n)"
    )

    def __init__(
        self,
        geometry: Geometry,
        *,
        k: int | list[int] | None = None,
        sharing: Sharing = "headwise",
        projection: Projection = "linear",
    ) -> None:
        """``k``: projected length (one per layer if a list); None = ``min(256, max_seq_len)``, the paper's
        k = 256 (Fig. 3, Table 2) capped by the length, since k >= n cannot compress; an explicit k larger
        than max_seq_len is an error. ``sharing``, ``projection``: see module doc."""
        super().__init__(geometry)
        if k is None:
            k = default_k(self.max_seq_len)
        layers = self.context.num_layers
        if isinstance(k, list):
            if len(k) != layers:
                raise ValueError(f"k={k} has {len(k)} entries; give one per layer (num_layers={layers}) or one int")
            if sharing == "layerwise" and len(set(k)) > 1:
                raise ValueError(
                    f"sharing='layerwise' uses one k x n matrix for every layer, so k must be one int, got {k}; "
                    "per-layer k works with sharing='none', 'headwise' or 'kv'"
                )
            k = k[self.context.layer_index]
        check_projected_length(projection, k, self.max_seq_len, "k", "max_seq_len")
        self.k, self.sharing, self.projection = k, sharing, projection
        self.key_projection, self.value_projection = build_projections(
            projection, sharing, k, self.max_seq_len, self.heads, self.context, shared_key="linformer_E"
        )

    @classmethod
    def causal_alternative(cls) -> str:
        return "Use 'linformer_causal' (blockwise Linformer that never sees the future) for causal attention."

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, i: query positions, r: projected key slots, d: head dim
        keys, slots = self.key_projection(k, mask)  # E_i K W_i^K: (b, h, r, d)
        values, _ = self.value_projection(v, mask)  # F_i V W_i^V
        allowed = None
        if slots is not None:
            # a row without any valid slot attends to its all-zero slots and so returns zeros, not NaN
            allowed = rearrange(slots | ~slots.any(dim=-1, keepdim=True), "b r -> b 1 1 r")
        return sdpa(q, keys, values, allowed)
