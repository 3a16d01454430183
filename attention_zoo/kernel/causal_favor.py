"""Performer's causal product with its feature maps made one span of positions at a time, in forward and backward.

Choromanski et al. 2021, "Rethinking Attention with Performers", arXiv:2009.14794 (https://arxiv.org/abs/2009.14794),
eq. (4) with the causal mask of eq. (2) and the prefix-sum algorithm of App. B.1 / B.3, phi of eq. (5):

    Att^_<->(Q, K, V) = D^-1 (tril(Q' (K')^T) C),  C = [V 1_L],  rows of Q', K': phi(q_i), phi(k_j)

computed as the chunked scan of :func:`~attention_zoo.kernel.products.causal_scan` (one m x (D + 1) state
sum_j phi(K_j) C_j^T carried from chunk to chunk, relative to the running key maximum sigma_i of
:mod:`attention_zoo.kernel.attention`), cut into spans of a few chunks. Each span's phi(Q) and phi(K) are made
from its q, k and W, scanned, and dropped: no (n, m) feature map of the whole sequence ever exists. The (n, m)
maps of every position are m / d times the size of q; mapped fresh at every use, their pages fault on first
touch, a cost that grows faster than n.

Backward (Katharopoulos et al. 2020, Sec. 3.3.1, as :class:`~attention_zoo.kernel.products.CausalProduct`):
with G the gradient of the sums [numerator, denominator],

    grad phi(Q)_i = sum_{j <= i} w_ij (G_i . C_j) phi(K)_j        (the forward's state, applied to G_i)
    grad phi(K)_j = sum_{i >= j} w_ij (G_i . C_j) phi(Q)_i,  grad C_j = sum_{i >= j} w_ij (phi(Q)_i . phi(K)_j) G_i

with w_ij = exp(kappa_j - sigma_i), each key's own log-scale kappa_j relative to query i's running maximum. The
spans are visited once, last to first: each span's features are made again from q, k and W, the two
anti-causal sums continue their reverse scans, and the causal one starts from the forward's state at the span's
start, kept by the forward (one m x (D + 1) state per span: n / span of them, O(n (D + 1)) at a span of m
positions). Kept for backward: q, k, v, W, the key log-scales kappa (n), the output and its denominators, and
those states. With create_graph=True the backward differentiates the unspanned form (features, then
:class:`~attention_zoo.kernel.products.CausalProduct`), so second-order gradients are exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attention_zoo.kernel.products import (
    LOW,
    CausalProduct,
    causal_scan,
    differentiable_backward,
    flat,
    hidden_rows,
    inverse,
    key_features,
    normalised,
    query_features,
    quotient,
    unflat,
)


def scan(a: Tensor, b: Tensor, c: Tensor, scale: Tensor | None, rows: Tensor | None, chunk: int, state, reference,
         reverse: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """:func:`causal_scan` of flat (X, L, .) tensors, continuing ``state`` / ``reference`` (None: from nothing)."""
    head = lambda t: None if t is None else t.unsqueeze(1)
    out, state, reference = causal_scan(
        head(a), head(b), head(c), head(scale), head(rows), chunk, state, reference, reverse=reverse
    )
    return out[:, 0], state, reference


def span_features(q, k, w, s: float, relu: bool, hidden, kappa: Tensor | None):
    """phi(Q) and phi(K) of one span (X, c, m), keys relative to their own log-scale: exp(log phi(K_j) - kappa_j).
    ``kappa`` None (forward): computed here and returned; otherwise the forward's, so the maps are the same."""
    fq, fk = query_features(q, w, relu), key_features(k, w, s, relu, hidden, None)
    if relu:
        return fq, fk, None
    if kappa is None:
        kappa = fk.amax(dim=-1)
        kappa = torch.where(torch.isfinite(kappa), kappa, LOW)
    return fq, fk.sub_(kappa.unsqueeze(-1)).exp_(), kappa


def unspanned(q, k, v, w, s: float, hidden, relu: bool, chunk: int) -> Tensor:
    """:class:`CausalFavor` by autograd-visible operations (what its backward differentiates with create_graph)."""
    pq, pk = q @ w, k @ w
    fq = pq.relu() if relu else torch.exp(pq - pq.detach().amax(dim=-1, keepdim=True))
    if relu:
        fk, kappa = pk.relu(), None
        if hidden is not None:
            fk = fk.masked_fill(hidden, 0.0)
    else:
        log_fk = pk - s * s / 2 * (k * k).sum(dim=-1, keepdim=True)
        if hidden is not None:
            log_fk = log_fk.masked_fill(hidden, -math.inf)
        kappa = log_fk.detach().amax(dim=-1)
        kappa = torch.where(torch.isfinite(kappa), kappa, LOW)
        fk = torch.exp(log_fk - kappa.unsqueeze(-1))
    head = lambda t: None if t is None else t.unsqueeze(1)
    values = F.pad(v, (0, 1), value=1.0)
    return normalised(CausalProduct.apply(head(fq), head(fk), head(values), head(kappa), chunk))[:, 0]


class CausalFavor(torch.autograd.Function):
    """Performer's causal output, ``(B, H, L, D)``, for ``q, k`` (B, H, L, d), ``v`` (B, H, L, D) with L a multiple
    of ``span``, itself a multiple of ``chunk``; ``w`` W (m, d), ``s`` = d^-1/4, ``hidden`` (B, 1, L, 1) True at
    padded keys (or None), ``relu`` the kernel. Query i sees keys j <= i. Stabilisers as the causal form of
    :mod:`attention_zoo.kernel.attention`: the query row maximum, each key's own log-scale and the running
    maximum. W gets no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, w, s: float, hidden, relu: bool, chunk: int, span: int) -> Tensor:
        # x: batch x heads, n: positions, f: features, e: value width + 1
        (batch, heads), inputs = q.shape[:2], (q, k, v)
        q, k, values = (flat(t) for t in (q, k, F.pad(v, (0, 1), value=1.0)))
        w = (w.T * s).expand(q.shape[0], -1, -1)
        hidden = hidden_rows(hidden, heads)
        sums = values.new_empty(values.shape)
        kappa = None if relu else q.new_empty(q.shape[:2])
        state, reference, starts = None, None, []
        for i in range(0, q.shape[1], span):
            part = slice(i, i + span)
            fq, fk, scale = span_features(
                q[:, part], k[:, part], w, s, relu, None if hidden is None else hidden[:, part], None
            )
            if kappa is not None:
                kappa[:, part] = scale
            starts.append((state, reference))
            sums[:, part], state, reference = scan(fq, fk, values[:, part], scale, None, chunk, state, reference)
        out, denominator = quotient(sums), sums[..., -1:]
        ctx.starts = starts
        ctx.save_for_backward(*inputs, w, hidden, kappa, out, denominator)
        ctx.s, ctx.relu, ctx.chunk, ctx.span, ctx.batch = s, relu, chunk, span, batch
        return rearrange(out, "(b h) n e -> b h n e", b=batch)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        *inputs, w, hidden, kappa, out, denominator = ctx.saved_tensors
        s, relu, chunk, span, needs = ctx.s, ctx.relu, ctx.chunk, ctx.span, ctx.needs_input_grad[:3]
        none = (None,) * 6
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            dense = lambda *qkv: unflat(unspanned(*(flat(t) for t in qkv), w, s, hidden, relu, chunk), ctx.batch)
            return differentiable_backward(dense, inputs, needs, grad, len(none))
        q, k, v = (flat(t) for t in inputs)
        values = F.pad(v, (0, 1), value=1.0)
        # through the normalisation: d out / d numerator = 1 / den, d out / d den = -out / den (0 where den <= 0)
        g = flat(grad) * inverse(denominator)
        sums_grad = torch.cat([g, (g * out).sum(dim=-1, keepdim=True).neg_()], dim=-1)
        grad_q, grad_k, grad_v = (
            torch.empty_like(t) if need else None for t, need in zip((q, k, v), needs, strict=True)
        )
        # anti-causal weights exp(kappa_j - sigma_i) = exp(kappa_j - sigma_j) exp(sigma_j - sigma_i): a scan with
        # "scale" -sigma_i (its maximum over i >= j is -sigma_j) and rows exp(kappa_j - sigma_j)
        level = None if relu else kappa.cummax(dim=-1).values
        back_scale = None if relu else level.neg()
        back_rows = None if relu else torch.exp(kappa - level)
        key_state = key_reference = value_state = value_reference = None
        for i in reversed(range(0, q.shape[1], span)):
            part = slice(i, i + span)
            hidden_part, kappa_part = (None if t is None else t[:, part] for t in (hidden, kappa))
            scale_part, rows_part = (None if t is None else t[:, part] for t in (back_scale, back_rows))
            fq, fk, _ = span_features(q[:, part], k[:, part], w, s, relu, hidden_part, kappa_part)
            g_sums = sums_grad[:, part]
            if needs[0]:
                state, reference = ctx.starts[i // span]  # sum_j phi(K_j) C_j^T: this scan's state, transposed
                state = None if state is None else state.transpose(-1, -2)
                grad_fq = scan(g_sums, values[:, part], fk, kappa_part, None, chunk, state, reference)[0]
                grad_fq = grad_fq.masked_fill_(fq <= 0, 0.0) if relu else grad_fq.mul_(fq)
                torch.bmm(grad_fq, w.transpose(1, 2), out=grad_q[:, part])
            if needs[1]:
                grad_fk, key_state, key_reference = scan(
                    values[:, part], g_sums, fq, scale_part, rows_part, chunk, key_state, key_reference, reverse=True
                )
                if relu:
                    torch.bmm(grad_fk.masked_fill_(fk <= 0, 0.0), w.transpose(1, 2), out=grad_k[:, part])
                else:  # d phi / d k = phi (s w - s^2 k): the |y|^2 / 2 of every key
                    grad_fk.mul_(fk)
                    rest = k[:, part] * grad_fk.sum(dim=-1, keepdim=True)
                    torch.baddbmm(rest, grad_fk, w.transpose(1, 2), beta=-s * s, out=grad_k[:, part])
            if needs[2]:
                grad_values, value_state, value_reference = scan(
                    fk, fq, g_sums, scale_part, rows_part, chunk, value_state, value_reference, reverse=True
                )
                grad_v[:, part] = grad_values[..., :-1]
        return *(unflat(t, ctx.batch) for t in (grad_q, grad_k, grad_v)), *none
