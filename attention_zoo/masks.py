"""Mask helpers: the one convention of the project is boolean, **True = attend / real token**.

Key-padding masks are ``(B, Nk)``; dense "allowed" masks are ``(B | 1, 1, Nq, Nk)`` and broadcast over
heads. Causal attention is aligned to the end: query ``i`` of ``Nq`` sits at position ``i + Nk - Nq``.
A per-element rule (:data:`MaskMod`) follows FlexAttention's ``mask_mod`` convention.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from einops import einsum, rearrange
from torch import Tensor

from attention_zoo.core import DoubleBackwardError, recomputed_gradients

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, True = query ``q_idx`` may attend key ``kv_idx``; the
#: arguments are broadcastable integer tensors (FlexAttention's convention)
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def causal_allowed(nq: int, nk: int, device: torch.device | str | None = None) -> Tensor:
    """``(Nq, Nk)`` bool, True where key ``j <= i + (Nk - Nq)``."""
    q_pos = torch.arange(nq, device=device) + (nk - nq)
    return q_pos[:, None] >= torch.arange(nk, device=device)[None, :]


def allowed_mask(mask: Tensor | None, causal: bool, nq: int, nk: int, device: torch.device) -> Tensor | None:
    """Dense ``(B | 1, 1, Nq, Nk)`` bool of which keys each query may see; ``None`` if all of them."""
    allowed = None
    if mask is not None:
        allowed = rearrange(mask, "b j -> b 1 1 j")
    if causal:
        tri = rearrange(causal_allowed(nq, nk, device), "i j -> 1 1 i j")
        allowed = tri if allowed is None else allowed & tri
    return allowed


def rows_with_keys(mask: Tensor | None, causal: bool, nq: int, nk: int, device: torch.device) -> Tensor | None:
    """``(B | 1, 1, Nq, 1)`` bool, False for queries that may see no key at all; ``None`` if every query
    sees at least one. Costs O(B N), never a dense mask."""
    if not causal:
        if mask is None:
            return None
        has = rearrange(mask.any(dim=-1), "b -> b 1 1 1")
        return None if bool(has.all()) else has.expand(-1, 1, nq, 1)
    last_key = torch.arange(nq, device=device) + (nk - nq)  # the last key each query may see
    if mask is None:
        has = (last_key >= 0)[None, :]
    else:
        seen_real = mask.cumsum(dim=-1) > 0  # (B, Nk): some real key at or before j
        has = (last_key >= 0)[None, :] & seen_real[:, last_key.clamp(min=0)]
    return None if bool(has.all()) else rearrange(has, "b i -> b 1 i 1")


def masked_softmax(scores: Tensor, allowed: Tensor | None, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` where ``allowed`` is False contributes nothing; rows with nothing allowed
    give zeros (never NaN, and no NaN gradient)."""
    if allowed is None:
        return scores.softmax(dim=dim)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=dim) * allowed.any(dim=dim, keepdim=True)


def masked_attention(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, key_padding: Tensor | None, scale: float,
    sinks: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """softmax(q K^T * scale) V over the keys ``allowed`` (bool, broadcastable to (B, H, Nq, Nk)) that are also real
    (``key_padding`` (B, Nk), True = real, or None); a query with no such key gets zeros. ``sinks`` (H,): a learned
    sink logit per head in the softmax's denominator (:func:`attention_zoo.sinks.sink_softmax`)."""
    # b: batch, h: heads, i: queries, j: keys, d: head dim
    if key_padding is not None:
        allowed = allowed & rearrange(key_padding, "b j -> b 1 1 j")
    scores = einsum(q * scale, k, "b h i d, b h j d -> b h i j")  # scaled before the product: q . k may overflow fp16
    if sinks is None:
        probs = masked_softmax(scores, allowed)
    else:
        from attention_zoo.sinks import sink_softmax  # sinks builds on this module

        probs = sink_softmax(scores, allowed, sinks)
    return einsum(probs, v, "b h i j, b h j d -> b h i d")


def pad_mask(lengths: Tensor, n: int) -> Tensor:
    """``(B, n)`` bool, True for the first ``lengths[b]`` positions (real tokens)."""
    return torch.arange(n, device=lengths.device)[None, :] < rearrange(lengths, "b -> b 1")


#: with no mask, torch's CPU SDPA kernel returns 0 instead of NaN for a query row holding NaN when it has fewer
#: keys than this (torch 2.11-2.13); with a mask it keeps the NaN
SDPA_CPU_NAN_MIN_KEYS = 16


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, *, dropout_p: float = 0.0, is_causal: bool = False
) -> Tensor:
    """``F.scaled_dot_product_attention`` (``attn_mask`` boolean, True = attend) that never hides a NaN query.

    On CPU with fewer than ``SDPA_CPU_NAN_MIN_KEYS`` keys and no mask, the call gets an all-True mask (made
    causal, top-left aligned as ``is_causal`` is, when asked), which takes torch's path that keeps NaN.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    if attn_mask is None and q.device.type == "cpu" and nk < SDPA_CPU_NAN_MIN_KEYS:
        attn_mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        attn_mask, is_causal = (attn_mask.tril() if is_causal else attn_mask), False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _TwiceDifferentiableSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
    )


class _TwiceDifferentiableSDPA(torch.autograd.Function):
    """SDPA with torch's fused backward, and a second-order gradient, which torch's fused kernels lack
    ("derivative for ..._backward is not implemented").

    The forward runs the fused kernel on detached copies of the inputs with grad mode on and keeps that
    small graph: a plain backward differentiates it (the fused backward, nothing recomputed) and then drops
    it. A backward with create_graph=True (or a second backward of a retained graph) recomputes the
    attention by its definition, softmax(q k^T / sqrt(d), masked) v, with autograd, whose gradient is
    differentiable again. Dropout cannot be recomputed (its draw is inside the fused call), so that case is
    refused.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
            )
        ctx.save_for_backward(q, k, v)
        ctx.fused, ctx.attn_mask, ctx.dropout_p, ctx.is_causal = (out, leaves), attn_mask, dropout_p, is_causal
        return out.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        needed = ctx.needs_input_grad[:3]
        # popped: kept on ctx, the fused graph's tensors would live as long as the caller holds the output
        fused = ctx.__dict__.pop("fused", None)
        if fused is not None and not torch.is_grad_enabled():
            out, leaves = fused
            wanted = [t for t, n in zip(leaves, needed, strict=True) if n]
            grads = iter(torch.autograd.grad(out, wanted, grad))
            gradients = [next(grads) if n else None for n in needed]
        else:
            if ctx.dropout_p > 0:
                raise DoubleBackwardError(
                    f"attention dropout (dropout_p={ctx.dropout_p}) cannot be differentiated twice: its random draw "
                    "is inside torch's fused kernel; use dropout 0, or backend='math' for full attention"
                )
            reference = partial(_sdpa_reference, attn_mask=ctx.attn_mask, is_causal=ctx.is_causal)
            gradients = recomputed_gradients(reference, ctx.saved_tensors, needed, grad)
        return (*gradients, None, None, None)


def _sdpa_reference(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """What ``F.scaled_dot_product_attention`` computes (default scale, boolean mask, ``is_causal`` aligned
    top-left as torch aligns it), by autograd-differentiable operations."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    allowed = attn_mask
    if is_causal:
        top_left = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        allowed = top_left if allowed is None else allowed & top_left
    return masked_softmax(scores, allowed) @ v
