"""Sparse attention over a pattern that is a band plus other keys: the band on the band kernel, the rest on
the tiled kernel, one softmax over both.

Child et al. 2019, arXiv:1904.10509, eq. (2): a(x_i, S_i) = softmax(q_i K_{S_i}^T / sqrt(d)) V_{S_i}. Where S_i
is the disjoint union of a band B_i = [i - before, i + after] (Longformer's sliding window, arXiv:2004.05150,
or the strided pattern's window) and the rest R_i (global tokens, strided columns), the softmax over S_i is the
merge of the softmax over each part: with L_B, L_R the log-sum-exps of the row's scores over B_i and R_i,

    L = log(exp(L_B) + exp(L_R)),      O = exp(L_B - L) O_B + exp(L_R - L) O_R.

The band runs :mod:`attention_zoo.sparse.band` (contiguous key windows, no gathers) and the rest
:mod:`attention_zoo.sparse.tiled` (gathered key sets of the rest's layout). Backward: with the final O and L,
each part's share of the gradient is that part's backward, P = exp(S - L) and dS = P * (dO V^T - rowsum(dO * O));
the band kernel keeps its own P_B = exp(S - L_B), so its rows are scaled by exp(L_B - L). A row that sees no key
in either part gets zeros. A learned sink (:mod:`attention_zoo.sinks`) is one more term of L, exp(σ_h), with no value.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attention_zoo.precision import compute_dtype
from attention_zoo.sinks import add_sink, sink_gradient
from attention_zoo.sparse.band import Band, band_backward, band_forward, from_tiles, to_tiles
from attention_zoo.sparse.tiled import TileGroup, tiled_backward, tiled_forward


def band_and_tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    band: Band,
    layout: tuple[TileGroup, ...],
    key_padding: Tensor | None,
    scale: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """softmax(Q K^T * scale) V over the band and the disjoint pairs of ``layout``, real keys only
    (``key_padding`` (B, N), True = real), for (B, H, N, D) self-attention; with ``sinks`` (H,), one more logit per
    head in the denominator (:mod:`attention_zoo.sinks`). Half precision runs in float32."""
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(f"band attention is self-attention: {q.shape[-2]} queries but {k.shape[-2]} keys")
    dtype = q.dtype
    q, k, v = (t.to(compute_dtype(dtype)).contiguous() for t in (q, k, v))
    sinks = None if sinks is None else sinks.to(q.dtype)
    return BandAndTiledAttention.apply(q, k, v, band, layout, key_padding, scale, sinks).to(dtype)


class BandAndTiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, band, layout, key_padding, scale, sinks):
        band_out, saved, band_lse = band_forward(q, k, v, band, key_padding, scale, with_lse=True)
        band_out, band_lse = from_tiles(band, band_out, q.shape), from_tiles(band, band_lse, q.shape)
        rest_out, rest_lse = tiled_forward(q, k, v, layout, key_padding, scale)
        lse = torch.logaddexp(band_lse, rest_lse)
        if sinks is not None:
            lse = add_sink(lse, sinks)
        # -inf - -inf on a row that sees no key in either part: its outputs are 0, its weights too
        band_weight = (band_lse - lse).exp_().nan_to_num_(nan=0.0)[..., None]
        out = band_out * band_weight + rest_out * (rest_lse - lse).exp_().nan_to_num_(nan=0.0)[..., None]
        lse.masked_fill_(lse == -torch.inf, torch.inf)  # so that the backward's exp(S - L) is 0 there
        ctx.save_for_backward(q, k, v, out, lse, band_weight, key_padding, sinks, *saved)
        ctx.band, ctx.layout, ctx.scale = band, layout, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, band_weight, key_padding, sinks, *saved = ctx.saved_tensors
        band, scale = ctx.band, ctx.scale
        grad_out = grad_out.contiguous()
        tiled = (to_tiles(band, t) for t in (out, band_weight))
        grads = band_backward(tuple(saved), band, scale, grad_out, *tiled)
        rest = tiled_backward(q, k, v, ctx.layout, key_padding, scale, grad_out, out, lse)
        grad_sinks = sink_gradient(grad_out, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[7] else None
        return *(a + b for a, b in zip(grads, rest, strict=True)), None, None, None, None, grad_sinks
