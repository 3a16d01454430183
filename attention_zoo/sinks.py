"""Learned attention sinks: one logit per head in the softmax's denominator (option ``sink_logit``).

OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925: "each attention head has a learned bias in
the denominator of the softmax" (openai/gpt-oss ``gpt_oss/torch/model.py``, ``sdpa``: the logit S of the head appended
to the scores as one more column, softmax, the column dropped; Hugging Face ``modeling_gpt_oss.py``,
``eager_attention_forward``, the same). For head h with sink logit σ_h and the scores s_ij = q_i k_j / sqrt(d) of the
keys j that query i may see (causal, pattern, padding):

    o_i = Σ_j exp(s_ij) v_j / (exp(σ_h) + Σ_j exp(s_ij))

The sink has no value: it only takes weight from the keys; a query that sees no key outputs 0. With L_i = log Σ_j
exp(s_ij) and L'_i = log(exp(L_i) + exp(σ_h)) it is the softmax output times a gate,

    o_i = g_i softmax(s_i) V,   g_i = exp(L_i - L'_i) = sigmoid(L_i - σ_h),

and, with π_ij = exp(s_ij - L'_i) (row sum g_i), dO the output gradient and δ_i = dO_i o_i, its gradients are

    ∂/∂s_ij = π_ij (dO_i v_j - δ_i),   ∂/∂σ_h = -Σ_i exp(σ_h - L'_i) δ_i   (over the batch and the queries),

i.e. a kernel that keeps P = softmax(s) scales it by g_i, and takes the sink's output o in δ and L' as its
log-sum-exp. Paths: :func:`sink_softmax` where the scores are at hand (math backend, the dense reference through
:func:`~attention_zoo.masks.masked_attention`, decoding caches); :func:`sink_sdpa` for fused SDPA, which returns
no log-sum-exp (the sink as one more key); :func:`add_sink`
and :func:`sink_gradient` for kernels that return L (band, band and tiles, FlexAttention). The logits start at 0
(GPT-OSS's Hugging Face port draws them from N(0, 0.02); the released ones are trained): at first the sink weighs
as much as one key of score 0. :func:`naive_sink_attention` is the float64 reference, a loop over the first equation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attention_zoo.masks import sdpa


def per_head(sinks: Tensor, ndim: int) -> Tensor:
    """The logits (H,) shaped to broadcast over (B, H, ...) tensors of ``ndim`` dimensions."""
    return sinks.view(1, -1, *(1,) * (ndim - 2))


def sink_softmax(scores: Tensor, allowed: Tensor | None, sinks: Tensor) -> Tensor:
    """The weights exp(s_ij) / (exp(σ_h) + Σ_j exp(s_ij)) of scores (B, H, Nq, Nk) over the ``allowed`` keys (bool,
    broadcastable; None: all); a row with no allowed key gets zeros (the sink takes all of it)."""
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    sink = per_head(sinks.to(scores.dtype), scores.ndim)
    shift = torch.maximum(scores.amax(dim=-1, keepdim=True), sink).detach()  # finite: the sink is always there
    weights = (scores - shift).exp()
    return weights / (weights.sum(dim=-1, keepdim=True) + (sink - shift).exp())


def sink_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    sinks: Tensor,
    scale: float,
    *,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> Tensor:
    """o_i by :func:`~attention_zoo.masks.sdpa` (fused kernels, their backward, a second order), the sink as key 0
    of heads one wider: q' = (q scale sqrt(D+1), 1), k'_0 = (0, σ_h sqrt(D+1)), k'_j = (k_j, 0), v'_0 = 0, so that
    SDPA's own scale 1/sqrt(D+1) gives the scores s_ij and σ_h exactly; every query sees key 0. ``allowed``: bool
    (B | 1, 1, Nq, Nk) or None. ``is_causal`` (Nq = Nk, top-left): a zero query is put first, so that query i, now
    row i + 1, sees key 0 and keys 0 .. i."""
    batch, heads, _, dim = q.shape
    root = (dim + 1) ** 0.5
    queries = F.pad(q * (scale * root), (0, 1), value=1.0)
    sink_key = F.pad(rearrange(sinks.to(k.dtype) * root, "h -> 1 h 1 1"), (dim, 0)).expand(batch, heads, 1, dim + 1)
    keys = torch.cat([sink_key, F.pad(k, (0, 1))], dim=-2)
    values = F.pad(v, (0, 1, 1, 0))  # the sink's zero value first, and the extra width
    if is_causal:
        queries = F.pad(queries, (0, 0, 1, 0))
    if allowed is not None:
        allowed = torch.cat([allowed.new_ones(*allowed.shape[:-1], 1), allowed], dim=-1)
    out = sdpa(queries, keys, values, allowed, dropout_p=dropout_p, is_causal=is_causal)
    return out[:, :, int(is_causal) :, :dim]


def add_sink(lse: Tensor, sinks: Tensor) -> Tensor:
    """L' = log(exp(L) + exp(σ_h)) of row log-sum-exps L (B, H, N) (-inf: a row with no key, whose L' is σ_h)."""
    return torch.logaddexp(lse, per_head(sinks.to(lse.dtype), lse.ndim))


def sink_gradient(grad_out: Tensor, out: Tensor, lse_with_sink: Tensor, sinks: Tensor) -> Tensor:
    """∂/∂σ_h = -Σ_i exp(σ_h - L'_i) dO_i o_i over the batch and the queries, for the output ``out`` (B, H, N, D)
    with the sink, its gradient ``grad_out`` and L' (B, H, N) (:func:`add_sink`)."""
    delta = (grad_out * out).sum(dim=-1)
    share = (per_head(sinks.to(delta.dtype), delta.ndim) - lse_with_sink).exp()  # the sink's weight in each row
    return -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)


def naive_sink_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """The reference, in float64, from o_i = Σ_j exp(s_ij) v_j / (exp(σ_h) + Σ_j exp(s_ij)) over the keys j with
    ``allowed`` (bool, broadcastable to (B, H, Nq, Nk)) True: a loop over the queries, explicit sums. Differentiable
    (autograd) in q, k, v and ``sinks`` (H,)."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    allowed = allowed.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    rows = []
    for i in range(q.shape[2]):
        scores = (q[:, :, i, None, :] * k).sum(dim=-1) * scale  # (B, H, Nk)
        shift = torch.maximum(scores.max(dim=-1).values, sinks[None, :]).detach()  # exp(x - c) / exp(y - c) = e^x / e^y
        numerators = torch.where(allowed[:, :, i], (scores - shift[..., None]).exp(), 0.0)
        denominator = (sinks[None, :] - shift).exp() + numerators.sum(dim=-1)
        rows.append((numerators[..., None] * v).sum(dim=-2) / denominator[..., None])
    return torch.stack(rows, dim=2)
