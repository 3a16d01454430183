"""The chunked products of ``attention_zoo.kernel.products`` against the papers' plain formulas in float64:
Performer's non-causal product (Choromanski et al. 2021, eq. 4 with phi of eq. 5, no stabiliser) chunk by
chunk, its gradients (gradcheck, gradgradcheck) and what it keeps for backward; the anti-causal scan of the
backward; the normalisation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.kernel.products import FavorAttention, causal_scan, normalised
from attention_zoo.masks import pad_mask

F64 = torch.float64


def randn(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def eq_4(w: Tensor, relu: bool, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """D^-1 (Q' (K'^T V)) with phi(x) = h(x) / sqrt(m) f(W x) of eq. (5) at x = S q, y = S k, padded keys
    left out."""
    m, xq, xk = w.shape[0], S * q, S * k
    if relu:
        phi = lambda x: torch.relu(x @ w.T) / math.sqrt(m)
    else:
        phi = lambda x: torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(m)
    a = phi(xq) @ phi(xk).transpose(-1, -2)
    if mask is not None:
        a = a * mask[:, None, None, :]
    return a @ v / a.sum(-1, keepdim=True)


S = 0.7  # x = S q, y = S k (Performer's d^-1/4)


def favor(q, k, v, w, mask, relu, chunk):
    hidden = None if mask is None else ~mask[:, None, :, None]
    return FavorAttention.apply(q, k, v, w, S, hidden, relu, chunk)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("nq, nk", [(11, 11), (5, 11), (11, 4)])
def test_favor_product_is_eq_4_whatever_the_chunk(relu, chunk, nq, nk):
    """Keys of growing size (the running key maximum rises from chunk to chunk) and large queries (|x|^2 / 2
    up to ~20): the stabilisers and the chunking cancel exactly."""
    w = randn(24, 6, seed=0)
    growth = torch.linspace(0.5, 2.5, nk, dtype=F64)[:, None]
    xq, xk, v = randn(2, 3, nq, 6, seed=1, scale=2.0), randn(2, 3, nk, 6, seed=2) * growth, randn(2, 3, nk, 5, seed=3)
    mask = pad_mask(torch.tensor([nk, 2]), nk)
    for m in (None, mask):
        expected = eq_4(w, relu, xq, xk, v, m)
        torch.testing.assert_close(favor(xq, xk, v, w, m, relu, chunk), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("relu", [False, True])
def test_favor_product_gradients_first_and_second_order(relu):
    w = randn(10, 3, seed=0)
    leaves = [
        t.requires_grad_(True)
        for t in (randn(1, 2, 5, 3, seed=1), randn(1, 2, 7, 3, seed=2), randn(1, 2, 7, 2, seed=3))
    ]
    mask = pad_mask(torch.tensor([5]), 7)
    function = lambda *t: favor(*t, w, mask, relu, 2)
    assert torch.autograd.gradcheck(function, leaves)
    assert torch.autograd.gradgradcheck(function, leaves)
    # the chunked backward against autograd of eq. (4)
    weights = randn(1, 2, 5, 2, seed=4)
    got = torch.autograd.grad((function(*leaves) * weights).sum(), leaves)
    expected = torch.autograd.grad((eq_4(w, relu, *leaves, mask) * weights).sum(), leaves)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_nan_key_makes_every_output_nan_and_a_padded_one_nothing():
    w, xq, v = randn(16, 4, seed=0), randn(1, 1, 6, 4, seed=1), randn(1, 1, 9, 4, seed=3)
    xk = randn(1, 1, 9, 4, seed=2)
    xk[0, 0, 7] = math.nan
    assert favor(xq, xk, v, w, None, False, 3).isnan().all()
    mask = torch.arange(9)[None] != 7
    out = favor(xq, xk.nan_to_num(0.0), v, w, mask, False, 3)  # the core zeroes padded keys before
    torch.testing.assert_close(out, eq_4(w, False, xq, xk.nan_to_num(0.0), v, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_noncausal_performer_keeps_no_feature_map_for_backward(kernel):
    """Every tensor saved for backward is O(n (d + 1) + m d), none the (n, m) feature map."""
    n, d, m = 256, 16, 128
    core = az.create_attention("performer", dim_head=d, heads=1, nb_features=m, kernel=kernel)
    q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
    sizes: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        core(q, k, v).sum().backward()
    assert sizes and max(sizes) <= n * (d + 1) < n * m


def test_normalised_is_numerator_over_denominator_with_its_gradients():
    """Rows with a positive denominator: numerator / denominator (and its first and second derivatives);
    a zero denominator gives zeros with zero gradients; NaN stays NaN."""
    sums = randn(2, 3, 6, 5, seed=0).abs().requires_grad_(True)
    kept = torch.ones(2, 3, 6, 1, dtype=F64)
    kept[0, 1, 2] = 0.0
    function = lambda s: normalised(s * torch.cat([torch.ones(2, 3, 6, 4, dtype=F64), kept], -1))
    assert torch.autograd.gradcheck(function, [sums]) and torch.autograd.gradgradcheck(function, [sums])
    out = function(sums)
    torch.testing.assert_close(out[1], sums[1, ..., :-1] / sums[1, ..., -1:], rtol=1e-15, atol=0.0)
    (grad,) = torch.autograd.grad(out.sum(), sums)
    assert not out[0, 1, 2].any() and torch.isfinite(grad).all()
    nan = torch.tensor([[1.0, math.nan]], dtype=F64, requires_grad=True)
    assert normalised(nan).isnan().all()


def test_reverse_scan_is_the_anticausal_sum():
    """out_i = rows_i sum_{j >= i} exp(scale_j - max_{j' >= i} scale_j') (a_i . b_j) c_j, written densely."""
    n, chunk = 12, 4
    a, b, c = randn(2, 3, n, 5, seed=0), randn(2, 3, n, 5, seed=1), randn(2, 3, n, 6, seed=2)
    scale, rows = randn(2, 3, n, seed=3, scale=3.0), randn(2, 3, n, seed=4).exp()
    level = scale.flip(-1).cummax(dim=-1).values.flip(-1)
    weights = torch.exp(scale[..., None, :] - level[..., :, None]) * torch.ones(n, n, dtype=F64).triu()
    expected = rows[..., None] * ((weights * (a @ b.transpose(-1, -2))) @ c)
    got = causal_scan(a, b, c, scale, rows, chunk, reverse=True)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    plain = causal_scan(a, b, c, None, None, chunk, reverse=True)[0]
    torch.testing.assert_close(plain, (a @ b.transpose(-1, -2)).triu() @ c, rtol=1e-12, atol=1e-12)
