"""cosFormer's chunked non-causal product (``cosformer.ChunkedCosformer``) against the paper's formula in float64
(Qin et al. 2022, Sec. 3: s(Q'_i, K'_j) = ReLU(Q_i) ReLU(K_j)^T cos(pi/2 (i - j) / M), O_i = sum_j s V_j / sum_j s),
computed densely: outputs and gradients whatever the chunk, gradcheck and gradgradcheck, and the core taking this
path on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.kernel.cosformer import ChunkedCosformer
from attention_zoo.masks import pad_mask

F64 = torch.float64
M = 30


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def paper(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Sec. 3 densely; queries and keys at 0, 1, ... from the start of both sequences; padded keys left out."""
    i, j = torch.arange(q.shape[-2], dtype=F64)[:, None], torch.arange(k.shape[-2], dtype=F64)[None]
    s = torch.relu(q) @ torch.relu(k).transpose(-1, -2) * torch.cos(math.pi / 2 * (i - j) / M)
    if mask is not None:
        s = s * mask[:, None, None, :]
    den = s.sum(-1, keepdim=True)
    return torch.where(den > 0, s @ v / torch.where(den > 0, den, 1.0), 0.0)


def weights(n: int) -> Tensor:
    angle = torch.arange(n, dtype=F64) * (math.pi / (2 * M))
    return torch.stack([angle.cos(), angle.sin()], dim=-1)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("nq, nk", [(11, 11), (5, 11), (11, 4)])
def test_chunked_product_and_gradients_are_the_papers_whatever_the_chunk(chunk, nq, nk):
    q, k, v = randn(2, 3, nq, 4, seed=1), randn(2, 3, nk, 4, seed=2), randn(2, 3, nk, 5, seed=3)
    mask = pad_mask(torch.tensor([nk, 2]), nk)
    out_weights = randn(2, 3, nq, 5, seed=4)
    for m in (None, mask):
        hidden = None if m is None else ~m[:, None, :, None]
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, expected = ChunkedCosformer.apply(*leaves, weights(nq), weights(nk), hidden, chunk), paper(*leaves, m)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
        got = torch.autograd.grad((out * out_weights).sum(), leaves)
        wanted = torch.autograd.grad((expected * out_weights).sum(), leaves)
        for a, b in zip(got, wanted, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("needed", [(0,), (1,), (2,), (0, 2)])
def test_each_subset_of_inputs_gets_its_gradients_first_and_second_order(needed):
    q, k, v = randn(1, 2, 5, 3, seed=5), randn(1, 2, 7, 3, seed=6), randn(1, 2, 7, 2, seed=7)
    hidden = ~pad_mask(torch.tensor([5]), 7)[:, None, :, None]
    leaves = [t.requires_grad_(i in needed) for i, t in enumerate((q, k, v))]
    function = lambda *t: ChunkedCosformer.apply(*t, weights(5), weights(7), hidden, 2)
    assert torch.autograd.gradcheck(function, leaves)
    assert torch.autograd.gradgradcheck(function, leaves)


def test_core_takes_the_chunked_product_on_the_cpu(monkeypatch):
    """Non-causal on the CPU the core makes the maps chunk by chunk, with the paper's numbers."""
    core = az.create_attention("cosformer", dim_head=4, heads=3, max_seq_len=M).double()
    calls = []
    original = ChunkedCosformer.apply
    monkeypatch.setattr(ChunkedCosformer, "apply", lambda *a: calls.append(1) or original(*a))
    for nq, nk in ((11, 11), (5, 11)):
        q, k, v = randn(2, 3, nq, 4, seed=8), randn(2, 3, nk, 4, seed=9), randn(2, 3, nk, 4, seed=10)
        mask = pad_mask(torch.tensor([nk, 3]), nk)
        calls.clear()
        out, expected = core(q, k, v, mask=mask), paper(q, k, v, mask)
        if nq == nk:  # self-attention: outputs at padded query positions are unspecified
            out, expected = (t * mask[:, None, :, None] for t in (out, expected))
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
        assert calls == [1]
