"""Performer's spanned causal product (``attention_zoo.kernel.causal_favor``) against the paper's plain formula in
float64: eq. (4) with the causal mask of eq. (2) and phi of eq. (5), no stabiliser, computed densely; its
gradients (against autograd of that formula, gradcheck, gradgradcheck, every subset of inputs); what it keeps
for backward; and the Performer core taking this path."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.kernel.causal_favor import CausalFavor
from attention_zoo.masks import pad_mask

F64 = torch.float64
S = 0.7  # x = S q, y = S k (Performer's d^-1/4)


def randn(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def causal_eq_4(w: Tensor, relu: bool, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """D^-1 (tril(Q' K'^T) V) with phi(x) = h(x) / sqrt(m) f(W x) of eq. (5) at x = S q, y = S k; padded keys
    left out; a query that sees no key gives 0."""
    m, xq, xk = w.shape[0], S * q, S * k
    if relu:
        phi = lambda x: torch.relu(x @ w.T) / math.sqrt(m)
    else:
        phi = lambda x: torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(m)
    n = q.shape[-2]
    a = phi(xq) @ phi(xk).transpose(-1, -2) * torch.ones(n, n, dtype=torch.bool).tril()
    if mask is not None:
        a = a * mask[:, None, None, :]
    den = a.sum(-1, keepdim=True)
    return torch.where(den > 0, a @ v / torch.where(den > 0, den, 1.0), 0.0)


def case(n: int = 12, seed: int = 0) -> tuple[Tensor, ...]:
    """Keys of growing size (the running key maximum rises from span to span), large queries (|x|^2 / 2 up to
    ~20), and one sequence with its last three keys padded."""
    growth = torch.linspace(0.5, 2.5, n, dtype=F64)[:, None]
    w = randn(10, 3, seed=seed)
    q, k = randn(2, 2, n, 3, seed=seed + 1, scale=2.0), randn(2, 2, n, 3, seed=seed + 2) * growth
    return w, q, k, randn(2, 2, n, 2, seed=seed + 3), pad_mask(torch.tensor([n, n - 3]), n)


def spanned(w, mask, relu, chunk, span):
    hidden = None if mask is None else ~mask[:, None, :, None]
    return lambda q, k, v: CausalFavor.apply(q, k, v, w, S, hidden, relu, chunk, span)


# (chunk, span): one span, spans of one chunk, spans of several chunks, a last span shorter than the others
SPANS = [(2, 12), (2, 2), (3, 6), (2, 8), (4, 8)]


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("chunk, span", SPANS)
def test_output_and_gradients_are_causal_eq_4_whatever_the_spans(relu, chunk, span):
    w, q, k, v, mask = case()
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    weights = randn(2, 2, 12, 2, seed=9)
    for m in (None, mask):
        out, expected = spanned(w, m, relu, chunk, span)(*leaves), causal_eq_4(w, relu, *leaves, m)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
        got = torch.autograd.grad((out * weights).sum(), leaves)
        wanted = torch.autograd.grad((expected * weights).sum(), leaves)
        for a, b in zip(got, wanted, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("needed", [(0,), (1,), (2,), (0, 1), (1, 2), (0, 2)])
def test_each_subset_of_inputs_gets_its_gradients(relu, needed):
    """The backward's three scans run only for what is asked, and each alone is right."""
    w, q, k, v, mask = case(seed=5)
    leaves = [t.requires_grad_(i in needed) for i, t in enumerate((q, k, v))]
    weights = randn(2, 2, 12, 2, seed=9)
    got = torch.autograd.grad((spanned(w, mask, relu, 2, 4)(*leaves) * weights).sum(), [leaves[i] for i in needed])
    full = [t.detach().requires_grad_(True) for t in (q, k, v)]
    wanted = torch.autograd.grad((causal_eq_4(w, relu, *full, mask) * weights).sum(), full)
    for i, a in zip(needed, got, strict=True):
        torch.testing.assert_close(a, wanted[i], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("relu", [False, True])
def test_gradients_first_and_second_order(relu):
    w, q, k, v, mask = case(n=6, seed=2)
    leaves = [t[:1].clone().requires_grad_(True) for t in (q, k, v)]
    function = spanned(w, mask[1:], relu, 2, 4)
    assert torch.autograd.gradcheck(function, leaves)
    assert torch.autograd.gradgradcheck(function, leaves)


def causal_favor_node(out: Tensor):
    """The CausalFavor node of ``out``'s graph."""
    nodes = [out.grad_fn]
    while nodes:
        node = nodes.pop()
        if type(node).__name__ == "CausalFavorBackward":
            return node
        nodes += [next_node for next_node, _ in node.next_functions if next_node is not None]
    raise AssertionError("no CausalFavor in the graph")


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_causal_performer_keeps_no_feature_map_for_backward(kernel):
    """Every tensor saved for backward is O(n (d + 1)) per head, none the (n, m) feature map; the states kept
    at the span starts are one m x (D + 1) per span after the first."""
    n, d, m, heads = 512, 16, 128, 64  # feature_chunk: 2^19 / (64 * 128) = 64 positions per span
    core = az.create_attention("performer", dim_head=d, heads=heads, nb_features=m, kernel=kernel, chunk_size=32)
    q, k, v = (torch.randn(1, heads, n, d, requires_grad=True) for _ in range(3))
    sizes: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        out = core(q, k, v, causal=True)
    assert sizes and max(sizes) <= heads * n * (d + 1) < heads * n * m
    starts = causal_favor_node(out).starts
    assert len(starts) == n // 64 and starts[0] == (None, None)
    assert all(state.shape == (heads, 1, m, d + 1) for state, _ in starts[1:])
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_performer_core_is_causal_eq_4_over_several_spans(kernel):
    """Through the core (nq != nk aligned at the end, padded keys, a chunk that does not divide n), with spans
    forced small by a large batch: the same numbers as the dense formula, and its gradients."""
    d, m, batch, heads = 4, 64, 64, 8  # feature_chunk: 2^19 / (512 * 64) = 16 positions per span
    core = az.create_attention("performer", dim_head=d, heads=heads, nb_features=m, kernel=kernel, chunk_size=3)
    core = core.double().eval()
    w = core.projection(torch.device("cpu"), F64)
    q = randn(batch, heads, 37, d, seed=1).requires_grad_(True)
    k, v = randn(batch, heads, 40, d, seed=2).requires_grad_(True), randn(batch, heads, 40, d, seed=3)
    mask = pad_mask(torch.randint(1, 41, (batch,), generator=torch.Generator().manual_seed(4)), 40)
    out = core(q, k, v, mask=mask, causal=True)
    scale = d**-0.25 / S  # causal_eq_4 scales by S; the core by d^-1/4
    full = torch.cat([torch.zeros(batch, heads, 3, d, dtype=F64), q], dim=-2)  # query i at key position i + 3
    expected = causal_eq_4(w, kernel == "relu", full * scale, k * scale, v, mask)[:, :, 3:]
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
    weights = randn(batch, heads, 37, d, seed=5)
    got = torch.autograd.grad((out * weights).sum(), (q, k))
    wanted = torch.autograd.grad((expected * weights).sum(), (q, k))
    for a, b in zip(got, wanted, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
