"""The band kernel (:mod:`attention_zoo.sparse.band`) against softmax attention written from its definition,
query i attends keys i - before .. i + after, in float64: outputs and the three gradients, over lengths that are
and are not multiples of the tile, bands narrower and wider than a tile, one-sided bands, key padding, and rows
that see no key."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from attention_zoo.sparse.band import Band, band_attention

pytestmark = pytest.mark.usefixtures("one_thread")

EXACT = dict(rtol=0.0, atol=1e-12)  # float64; only the summation order differs


def reference(q: Tensor, k: Tensor, v: Tensor, before: int, after: int, real: Tensor | None, scale: float) -> Tensor:
    """Masked softmax over the (n, n) scores; a row with no allowed key gives zeros."""
    n = q.shape[-2]
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    for i in range(n):
        keys = [j for j in range(max(0, i - before), min(n, i + after + 1))]
        for b in range(q.shape[0]):
            seen = [j for j in keys if real is None or real[b, j]]
            if seen:
                scores = q[b, :, i : i + 1] @ k[b, :, seen].mT * scale
                out[b, :, i] = (torch.softmax(scores, dim=-1) @ v[b, :, seen])[:, 0]
    return out


def inputs(b: int, h: int, n: int, d: int, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def output_and_grads(attend, q: Tensor, k: Tensor, v: Tensor) -> list[Tensor]:
    out = attend(q, k, v)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    return [out, *torch.autograd.grad(out, (q, k, v), cotangent)]


@pytest.mark.parametrize(
    ("n", "before", "after", "tile"),
    [
        (n, before, after, tile)
        for n, (before, after), tile in itertools.product(
            [1, 13, 32], [(0, 0), (3, 3), (8, 0), (0, 5), (9, 9), (20, 4)], [4, 8]
        )
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_matches_the_definition(n, before, after, tile, padded):
    q, k, v = inputs(2, 3, n, 4, seed=n + before)
    real = None
    if padded:
        real = torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.3
        real[1] = False  # every row of the second sequence sees no key: zeros, not NaN
    got = output_and_grads(lambda *x: band_attention(*x, Band(before, after, tile), real, 0.3), q, k, v)
    want = output_and_grads(lambda *x: reference(*x, before, after, real, 0.3), q, k, v)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, **EXACT)


def test_values_may_be_wider_than_keys():
    q, k, _ = inputs(2, 2, 21, 4, seed=5)
    v = torch.randn(2, 2, 21, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64, requires_grad=True)
    real = torch.rand(2, 21, generator=torch.Generator().manual_seed(2)) > 0.3
    got = output_and_grads(lambda *x: band_attention(*x, Band(5, 2, 8), real, 0.4), q, k, v)
    want = output_and_grads(lambda *x: reference(*x, 5, 2, real, 0.4), q, k, v)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **EXACT)


def test_a_sequence_never_sees_the_next_one():
    """The (batch, head) sequences share one row buffer; the band's ends reach into the neighbours' rows."""
    q, k, v = inputs(2, 2, 12, 4, seed=3)
    band = Band(before=6, after=6, tile=4)
    got = output_and_grads(lambda *x: band_attention(*x, band, None, 0.5), q, k, v)
    k2, v2 = (t.detach().clone() for t in (k, v))
    k2[:, 1] = 10.0 * torch.randn(k2[:, 1].shape, generator=torch.Generator().manual_seed(4), dtype=k2.dtype)
    v2[:, 1] -= 50.0  # every key and value of head 1 changes
    k2, v2 = k2.requires_grad_(), v2.requires_grad_()
    moved = output_and_grads(lambda *x: band_attention(*x, band, None, 0.5), q, k2, v2)
    for g, m in zip(got, moved, strict=True):
        torch.testing.assert_close(g[:, 0], m[:, 0], **EXACT)  # head 0 unchanged
        assert not torch.allclose(g[:, 1], m[:, 1])


def test_half_precision_is_computed_in_float32():
    q, k, v = (t.detach().float() for t in inputs(1, 2, 40, 8))
    band = Band(before=5, after=5, tile=8)
    expected = band_attention(q, k, v, band, None, 0.35)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = band_attention(*low, band, None, 0.35)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
    torch.testing.assert_close(out.float(), expected, rtol=0.0, atol=3e-2)  # bf16 inputs: 8-bit mantissa


def test_bad_bands_and_cross_attention_are_refused():
    with pytest.raises(ValueError, match="before, after >= 0 and tile >= 1"):
        Band(before=-1, after=2, tile=4)
    with pytest.raises(ValueError, match="tile >= 1"):
        Band(before=1, after=2, tile=0)
    q, k, v = inputs(1, 1, 8, 4)
    with pytest.raises(ValueError, match="8 queries but 5 keys"):
        band_attention(q, k[:, :, :5], v[:, :, :5], Band(2, 2, 4), None, 1.0)
