"""The non-causal kernel product of ``attention_zoo.kernel.bidirectional`` against Katharopoulos et al. 2020's
quadratic form, eq. 4 (V'_i = sum_j phi(Q_i)^T phi(K_j) V_j / sum_j phi(Q_i)^T phi(K_j)), in float64: the
output, its gradients to first and second order, zero and NaN denominators, and gradients that come back
contiguous (the reason the product has its own backward)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from attention_zoo.kernel.bidirectional import bidirectional

F64 = torch.float64


def positive(*shape: int, seed: int) -> Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.05


def eq_4(fq: Tensor, fk: Tensor, v: Tensor) -> Tensor:
    weights = fq @ fk.transpose(-1, -2)  # phi(Q_i)^T phi(K_j), (B, H, Nq, Nk)
    return weights @ v / weights.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize(("nq", "nk", "m", "d"), [(7, 7, 5, 3), (4, 9, 6, 2), (9, 3, 3, 4)])
def test_product_is_the_quadratic_form(nq, nk, m, d):
    fq, fk, v = positive(2, 3, nq, m, seed=0), positive(2, 3, nk, m, seed=1), positive(2, 3, nk, d, seed=2) - 0.5
    torch.testing.assert_close(bidirectional(fq, fk, v), eq_4(fq, fk, v), rtol=1e-12, atol=1e-12)


def test_gradients_are_the_quadratic_forms_to_first_and_second_order():
    inputs = tuple(t.requires_grad_() for t in (positive(2, 2, 5, 4, seed=3), positive(2, 2, 6, 4, seed=4),
                                                positive(2, 2, 6, 3, seed=5) - 0.5))  # fmt: skip
    grad = torch.randn(2, 2, 5, 3, generator=torch.Generator().manual_seed(6), dtype=F64)
    ours = torch.autograd.grad(bidirectional(*inputs), inputs, grad)
    reference = torch.autograd.grad(eq_4(*inputs), inputs, grad)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(bidirectional, inputs)
    assert torch.autograd.gradgradcheck(bidirectional, inputs)


def test_gradients_come_back_contiguous_and_only_where_asked():
    fq, fk = positive(1, 2, 8, 4, seed=7).requires_grad_(), positive(1, 2, 8, 4, seed=8).requires_grad_()
    v = positive(1, 2, 8, 3, seed=9)
    grad_fq, grad_fk = torch.autograd.grad(bidirectional(fq, fk, v).sum(), (fq, fk))
    assert grad_fq.is_contiguous() and grad_fk.is_contiguous()
    assert v.grad is None


def test_a_query_with_no_weight_gives_zeros_with_finite_gradients_and_nan_stays_nan():
    fq, fk, v = positive(1, 1, 4, 3, seed=10), positive(1, 1, 5, 3, seed=11), positive(1, 1, 5, 2, seed=12)
    fq[0, 0, 1] = 0.0  # ReLU features that are all 0: denominator 0
    fq.requires_grad_()
    out = bidirectional(fq, fk, v)
    assert torch.equal(out[0, 0, 1], torch.zeros(2, dtype=F64))
    torch.testing.assert_close(out[0, 0, [0, 2, 3]], eq_4(fq, fk, v)[0, 0, [0, 2, 3]], rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(out.sum(), fq)
    assert torch.isfinite(grad).all()
    fq = fq.detach().clone()
    fq[0, 0, 2, 0] = float("nan")
    out = bidirectional(fq, fk, v)
    assert out[0, 0, 2].isnan().all() and not out[0, 0, [0, 1, 3]].isnan().any()
