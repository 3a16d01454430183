"""Full attention: every backend against an independent float64 reference (a per-query loop)."""

from __future__ import annotations

import math

import pytest
import torch

import attention_zoo as az
from attention_zoo.full import xformers_available
from attention_zoo.masks import pad_mask

BACKENDS = ["math", "sdpa", "auto"]


def loop_reference(q, k, v, mask, causal):
    """softmax(q_i k_j / sqrt(d)) over the allowed j, one query at a time; zeros if none allowed."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    out = torch.zeros(b, h, nq, d, dtype=torch.float64)
    for bi in range(b):
        for i in range(nq):
            keys = [j for j in range(nk) if (mask is None or mask[bi, j]) and (not causal or j <= i + nk - nq)]
            if not keys:
                continue
            scores = q[bi, :, i, None, :].double() @ k[bi, :, keys, :].double().transpose(-1, -2) / math.sqrt(d)
            out[bi, :, i] = (scores.softmax(-1) @ v[bi, :, keys, :].double()).squeeze(-2)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("nq", "nk"), [(13, 13), (5, 13), (13, 5)])
@pytest.mark.parametrize("masked", [False, True])
def test_backend_matches_float64_reference(backend, causal, nq, nk, masked):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, nq, 8), torch.randn(3, 2, nk, 8), torch.randn(3, 2, nk, 8)
    mask = pad_mask(torch.tensor([nk, nk - 3, 0]), nk) if masked else None
    core = az.create_attention("full", dim_head=8, heads=2, backend=backend)
    out = core(q, k, v, mask=mask, causal=causal)
    # float32 kernels against a float64 loop: 1e-5 absolute on O(1) outputs
    torch.testing.assert_close(out.double(), loop_reference(q, k, v, mask, causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero(backend):
    q = k = v = torch.randn(2, 1, 6, 4)
    mask = pad_mask(torch.tensor([6, 0]), 6)
    out = az.create_attention("full", dim_head=4, heads=1, backend=backend)(q, k, v, mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    # causal with Nq > Nk: the first Nq - Nk queries see no key
    out = az.create_attention("full", dim_head=4, heads=1, backend=backend)(q, k[:, :, :4], v[:, :, :4], causal=True)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert (out[:, :, 2:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_scores_that_overflow_before_the_scale_stay_finite(backend):
    """q . k = 64 * 40^2 = 102400 exceeds fp16's 65504, but q . k / sqrt(d) = 12800 does not: the scale comes
    first, as in the exact softmax, so the output is finite (it was NaN with the math backend)."""
    q = k = torch.full((1, 1, 4, 64), 40.0, dtype=torch.float16)
    v = torch.randn(1, 1, 4, 64).half()
    out = az.create_attention("full", dim_head=64, heads=1, backend=backend)(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), loop_reference(q, k, v, None, True), rtol=1e-3, atol=1e-3)


def test_sdpa_backward_is_the_fused_one_and_a_retained_graph_can_be_differentiated_again():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 8, requires_grad=True) for _ in range(3))
    core = az.create_attention("full", dim_head=8, heads=2, backend="sdpa")
    out = core(q, k, v, causal=True)
    first = torch.autograd.grad(out.square().sum(), (q, k, v), retain_graph=True)
    again = torch.autograd.grad(out.square().sum(), (q, k, v))  # the fused graph is gone: recomputed by autograd
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for a, b, c in zip(first, again, torch.autograd.grad(plain.square().sum(), (q, k, v)), strict=True):
        assert torch.equal(a, c)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_sdpa_dropout_refuses_double_backward_in_one_error():
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    core = az.create_attention("full", dim_head=8, heads=2, backend="sdpa", dropout=0.1).train()
    with pytest.raises(az.DoubleBackwardError, match="attention dropout \\(dropout_p=0.1\\).*backend='math'"):
        torch.autograd.grad(core(q, k, v).square().sum(), q, create_graph=True)


def test_math_backend_exposes_probabilities():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 7, 4, dtype=torch.float64), torch.randn(2, 3, 7, 4, dtype=torch.float64)
    core = az.get_attention_class("full")(az.Geometry(dim_head=4, heads=3), backend="math")
    probs = core.attention_probs(q, k, causal=True)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 7, dtype=torch.float64))
    assert torch.equal(probs.triu(1), torch.zeros_like(probs))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    q = k = v = torch.randn(1, 1, 32, 8)
    for backend in ("math", "sdpa"):
        core = az.create_attention("full", dim_head=8, heads=1, backend=backend, dropout=0.5)
        assert torch.equal(core.eval()(q, k, v), core(q, k, v))
        assert not torch.allclose(core.train()(q, k, v), core.eval()(q, k, v))


@pytest.mark.skipif(xformers_available(), reason="xformers is installed here")
def test_xformers_backend_without_xformers_is_a_clear_error():
    with pytest.raises(ValueError, match="needs the xformers package"):
        az.create_attention("full", dim_head=8, heads=1, backend="xformers")


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and xformers_available()), reason="needs CUDA and xformers")
@pytest.mark.parametrize("causal", [False, True])
def test_xformers_matches_reference_on_cuda(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 13, 16) for _ in range(3))
    mask = pad_mask(torch.tensor([13, 9]), 13)
    core = az.create_attention("full", dim_head=16, heads=2, backend="xformers")
    out = core(q.cuda(), k.cuda(), v.cuda(), mask=mask.cuda(), causal=causal).cpu()
    torch.testing.assert_close(out.double(), loop_reference(q, k, v, mask, causal), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_low_precision_on_cuda(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 32) for _ in range(3))
    core = az.create_attention("full", dim_head=32, heads=2)
    out = core(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), causal=True).float().cpu()
    torch.testing.assert_close(out.double(), loop_reference(q, k, v, None, True), rtol=2e-2, atol=2e-2)
