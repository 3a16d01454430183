"""The non-causal product of the kernelized cores (:mod:`attention_zoo.kernel.attention`), with its backward.

Katharopoulos et al. 2020, arXiv:2006.16236, eq. 6 (the non-causal form, associativity applied):

    V'_i = phi(Q_i)^T S / phi(Q_i)^T z,   S = sum_j phi(K_j) V_j^T  (m x D),   z = sum_j phi(K_j)  (m)

and its gradients, with G the gradient of V', den_i = phi(Q_i)^T z, G~_i = G_i / den_i and
g_i = -G~_i . V'_i (the denominator's share):

    grad phi(Q_i) = S G~_i + g_i z,   grad S = sum_i phi(Q_i) G~_i^T,   grad z = sum_i g_i phi(Q_i),
    grad phi(K_j) = grad S V_j + grad z,   grad V_j = grad S^T phi(K_j).

Autograd over ``phi(Q) (phi(K)^T [V 1])`` computes the same with (D + 1)-wide products, a padded copy of V and
gradients that reach the feature maps transposed (non-contiguous); the feature maps' backward then runs over
strided memory. Here every matrix product is D wide, z and the denominators are matrix-vector products, and
the gradients come back contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attention_zoo.kernel.products import differentiable_backward, flat, inverse, matrix_vector, normalised


def dense_bidirectional(fq: Tensor, fk: Tensor, v: Tensor) -> Tensor:
    """:func:`bidirectional` with autograd: what its backward differentiates when asked for a graph."""
    return normalised(fq @ (fk.transpose(-1, -2) @ F.pad(v, (0, 1), value=1.0)))


def bidirectional(fq: Tensor, fk: Tensor, v: Tensor) -> Tensor:
    """V' for features ``fq`` (B, H, Nq, m), ``fk`` (B, H, Nk, m) and values ``v`` (B, H, Nk, D): ``(B, H, Nq,
    D)``; 0 where the denominator is <= 0 and NaN where it is NaN, as
    :func:`~attention_zoo.kernel.products.normalised`."""
    return BidirectionalProduct.apply(fq, fk, v)


class BidirectionalProduct(torch.autograd.Function):
    """:func:`bidirectional` with the backward of the module docstring. Saves the features, V, V' and the
    denominators (the inputs autograd would keep anyway, and O(m D) more). With create_graph=True its backward
    differentiates :func:`dense_bidirectional`, so second-order gradients are exact."""

    @staticmethod
    def forward(ctx, fq: Tensor, fk: Tensor, v: Tensor) -> Tensor:
        # x: batch x heads, i / j: query / key positions, f: features, e: value width
        shape, batch = fq.shape[:-1] + v.shape[-1:], fq.shape[0]
        inputs = fq, fk, v
        fq, fk, v = (flat(t) for t in inputs)
        sums = torch.bmm(fk.transpose(1, 2), v)  # S (x, f, e)
        normaliser = matrix_vector(fk.transpose(1, 2), fk.new_ones(fk.shape[1], 1))  # z = phi(K)^T 1 (x, f, 1)
        denominator = matrix_vector(fq, normaliser)  # (x, i, 1)
        none = denominator <= 0  # False for NaN: a NaN denominator stays NaN
        out = torch.bmm(fq, sums).div_(denominator.masked_fill(none, 1.0)).masked_fill_(none, 0.0)
        ctx.save_for_backward(*inputs, sums, normaliser, denominator, out)
        ctx.batch = batch
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        *inputs, sums, normaliser, denominator, out = ctx.saved_tensors
        needs = ctx.needs_input_grad
        unflat = lambda t: t.view(*inputs[0].shape[:2], *t.shape[1:])
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            return differentiable_backward(dense_bidirectional, inputs, needs, grad, 0)
        fq, fk, v = (flat(t) for t in inputs)
        grad = flat(grad)
        scaled = grad * inverse(denominator)  # G~ (0 where the denominator is <= 0)
        share = torch.linalg.vecdot(scaled, out).neg_().unsqueeze(-1)  # g (x, i, 1)
        grad_fq = grad_fk = grad_v = None
        if needs[0]:
            # the normaliser's rank-1 term apart: baddbmm broadcasting its input loops over the batch
            grad_fq = torch.bmm(scaled, sums.transpose(1, 2)).addcmul_(share, normaliser.transpose(1, 2))
        if needs[1] or needs[2]:
            grad_sums = torch.bmm(fq.transpose(1, 2), scaled)  # (x, f, e)
        if needs[1]:
            grad_normaliser = matrix_vector(fq.transpose(1, 2), share)  # (x, f, 1)
            grad_fk = torch.bmm(v, grad_sums.transpose(1, 2)).add_(grad_normaliser.transpose(1, 2))
        if needs[2]:
            grad_v = torch.bmm(fk, grad_sums)
        return tuple(None if t is None else unflat(t) for t in (grad_fq, grad_fk, grad_v))
