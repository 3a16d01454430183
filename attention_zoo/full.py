"""Full softmax attention: the reference every other mechanism is tested against.

Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762; in the notation of Linformer
(Wang et al. 2020, arXiv:2006.04768) eq. (2):

    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) = softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V = P V W_i^V

with the context mapping matrix P in R^{n x n}. O(n^2) time and memory (the ``math`` backend
materialises P; ``sdpa`` and ``xformers`` may use fused kernels that do not).

Backends (option ``backend``):
- ``"math"``: readable reference; :meth:`FullAttention.attention_probs` returns P for analysis.
- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient / math
  kernels chosen by PyTorch per device and dtype).
- ``"xformers"``: ``xformers.ops.memory_efficient_attention``, CUDA tensors only, needs the
  ``xformers`` extra; asking for it without xformers installed raises at construction.
- ``"auto"`` (default): ``sdpa``. SDPA already dispatches to the fastest fused kernel PyTorch has for
  the device and dtype (FlashAttention-2 on recent GPUs); xformers is never picked implicitly because
  it pins its own torch version and is absent from CPU installs.

Every backend returns zeros, never NaN, for a query that may see no key (all keys padded, or causal
with Nq > Nk). Causal attention with Nq != Nk is aligned to the end (query i sees keys
j <= i + Nk - Nq), as in decoding with a key/value cache.

Option ``sink_logit`` (default False): True adds GPT-OSS's learned attention sink (OpenAI 2025, arXiv:2508.10925;
:mod:`attention_zoo.sinks`), one logit σ_h per head (parameter ``sinks``, initialised to 0) in the denominator,
P_ij = exp(s_ij) / (exp(σ_h) + Σ_j exp(s_ij)): the rows of P sum to less than 1 and a query that sees no key
gives 0. ``math`` appends σ_h to the scores; ``sdpa`` runs it as one more key of heads one wider
(:func:`~attention_zoo.sinks.sink_sdpa`); ``xformers`` has no sink and refuses it.

Decoding cache (:meth:`FullAttention.decode`): the keys and values of every position so far, L per
sequence and head after L positions (:class:`attention_zoo.decoding.cache.KeyValueState`, buffers grown
by doubling, so at most 2 L + T slots are allocated). A step of T new queries runs the configured backend
on the T x L' block (L' = L + T), aligned to the end, so every backend decodes exactly as it attends.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor, nn

from attention_zoo import packing
from attention_zoo.core import AttentionCore, DecodingState, Geometry, refuse_double_backward
from attention_zoo.decoding.cache import KeyValueState, builds_graph
from attention_zoo.masks import allowed_mask, masked_softmax, rows_with_keys, sdpa
from attention_zoo.registry import register_attention
from attention_zoo.sinks import sink_sdpa, sink_softmax

Backend = Literal["auto", "math", "sdpa", "xformers"]


def xformers_available() -> bool:
    return importlib.util.find_spec("xformers") is not None


@register_attention("full")
class FullAttention(
    AttentionCore, approximation="none", has_decoding_cache=True, supports_double_backward=True, supports_segments=True
):
    # double backward: math by autograd, sdpa by :func:`attention_zoo.masks.sdpa`'s second-order path; xformers refuses
    example_configs = (
        {"backend": "math"},
        {"backend": "sdpa"},
        {"backend": "math", "sink_logit": True},
        {"backend": "sdpa", "sink_logit": True},
    )

    def __init__(
        self, geometry: Geometry, *, backend: Backend = "auto", dropout: float = 0.0, sink_logit: bool = False
    ) -> None:
        """``dropout`` applies to the attention probabilities P in training mode (0 = off); ``sink_logit``: True
        adds one learned logit per head (parameter ``sinks`` (H,), initialised to 0) to the softmax's denominator,
        GPT-OSS's attention sink (a key with no value: it only takes weight away); False (default): plain softmax."""
        super().__init__(geometry)
        if sink_logit and backend == "xformers":
            raise ValueError("sink_logit=True runs on backend 'auto', 'math' or 'sdpa'; xformers' kernel has no sink")
        if backend == "xformers" and not xformers_available():
            raise ValueError(
                "backend='xformers' needs the xformers package (pip install 'attention-zoo[xformers]', "
                "CUDA only); available here: 'auto', 'math', 'sdpa'"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.backend = "sdpa" if backend == "auto" else backend
        self.dropout = dropout
        self.register_parameter("sinks", nn.Parameter(torch.zeros(self.heads)) if sink_logit else None)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, i: query positions, j: key positions, d: head dim
        if self.backend == "math":
            probs = self.attention_probs(q, k, mask=mask, causal=causal)
            probs = F.dropout(probs, self.dropout, self.training)
            return einsum(probs, v, "b h i j, b h j d -> b h i d")
        nq, nk = q.shape[-2], k.shape[-2]
        dropout = self.dropout if self.training else 0.0
        if self.sinks is not None:  # every query sees the sink: no row without a key to fix up
            fused_causal = causal and mask is None and nq == nk
            allowed = None if fused_causal else allowed_mask(mask, causal, nq, nk, q.device)
            return sink_sdpa(q, k, v, allowed, self.sinks, self.scale, dropout_p=dropout, is_causal=fused_causal)
        has_key = rows_with_keys(mask, causal, nq, nk, q.device)
        if mask is None and (not causal or nq == nk):
            allowed = None  # the kernels' own causal flag (top-left aligned) is exact when Nq == Nk
        else:
            allowed = allowed_mask(mask, causal, nq, nk, q.device)
            if has_key is not None:
                allowed = allowed | ~has_key  # let empty rows see every key, then zero them below
            causal = False
        if self.backend == "sdpa":
            out = sdpa(q, k, v, allowed, dropout_p=dropout, is_causal=causal)
        else:
            out = _xformers_attention(q, k, v, allowed, causal, dropout, self.scale)
            out = refuse_double_backward(out, "full (backend='xformers')")  # xformers' kernels lack it
        return out if has_key is None else out * has_key

    def attend_segments(
        self, q: Tensor, k: Tensor, v: Tensor, *, segments: Tensor, key_segments: Tensor, causal: bool
    ) -> Tensor:
        """Packed rows in one call: softmax over the keys of the query's own document (a document mask, as
        FlexAttention's ``document_mask``), causal within the document; padding queries give 0."""
        nq, nk = q.shape[-2], k.shape[-2]
        query_docs, key_docs = packing.document_ids(segments, nq), packing.document_ids(key_segments, nk)
        allowed = (query_docs[:, :, None] == key_docs[:, None, :]) & (query_docs >= 0)[:, :, None]
        if causal:
            query_at = packing.positions_in_documents(segments, nq)
            key_at = packing.positions_in_documents(key_segments, nk)
            allowed = allowed & (key_at[:, None, :] <= query_at[:, :, None])
        allowed = rearrange(allowed, "b i j -> b 1 i j")
        if self.backend == "math":
            scores = einsum(q * self.scale, k, "b h i d, b h j d -> b h i j")
            probs = masked_softmax(scores, allowed) if self.sinks is None else sink_softmax(scores, allowed, self.sinks)
            return einsum(F.dropout(probs, self.dropout, self.training), v, "b h i j, b h j d -> b h i d")
        dropout = self.dropout if self.training else 0.0
        if self.sinks is not None:  # a padding query sees only the sink: 0
            return sink_sdpa(q, k, v, allowed, self.sinks, self.scale, dropout_p=dropout)
        has_key = allowed.any(dim=-1, keepdim=True)
        allowed = allowed | ~has_key  # let empty rows see every key, then zero them below
        if self.backend == "sdpa":
            out = sdpa(q, k, v, allowed, dropout_p=dropout)
        else:
            out = _xformers_attention(q, k, v, allowed, False, dropout, self.scale)
            out = refuse_double_backward(out, "full (backend='xformers')")
        return out * has_key

    def start_decoding(self) -> KeyValueState:
        self.check_decodable()
        return KeyValueState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        assert isinstance(state, KeyValueState)
        state.in_place = state.in_place and not builds_graph(q, k, v, *self.parameters())
        state.append(k, v, mask)
        keys, values, real = state.cached()
        return self.attend(q, keys, values, mask=None if state.all_real else real, causal=True)

    def attention_probs(self, q: Tensor, k: Tensor, *, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """The context mapping matrix P = softmax(Q K^T / sqrt(d)), ``(B, H, Nq, Nk)``; with ``sink_logit`` each row
        is exp(s_ij) / (exp(σ_h) + Σ_j exp(s_ij)), summing to 1 minus the sink's share."""
        # scaled before the product: q . k itself may overflow fp16 where q . k / sqrt(d) does not
        scores = einsum(q * self.scale, k, "b h i d, b h j d -> b h i j")
        allowed = allowed_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
        return masked_softmax(scores, allowed) if self.sinks is None else sink_softmax(scores, allowed, self.sinks)


def _xformers_attention(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, causal: bool, dropout: float, scale: float
) -> Tensor:
    import xformers.ops as xops

    if q.device.type != "cuda":
        raise ValueError(f"backend='xformers' runs on CUDA tensors only, got {q.device}; use 'sdpa' or 'math'")
    bias = xops.LowerTriangularMask() if causal else None
    if allowed is not None:
        b, h, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        # xformers wants the bias's last dim padded to a multiple of 8 in memory, then sliced
        padded = -(-nk // 8) * 8
        storage = torch.zeros(b, h, nq, padded, dtype=q.dtype, device=q.device)[..., :nk]
        bias = storage.masked_fill_(~allowed.expand(b, h, nq, nk), float("-inf"))
    layout = "b h n d -> b n h d"
    out = xops.memory_efficient_attention(
        rearrange(q, layout), rearrange(k, layout), rearrange(v, layout), attn_bias=bias, p=dropout, scale=scale
    )
    return rearrange(out, "b n h d -> b h n d")
