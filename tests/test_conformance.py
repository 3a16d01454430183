"""The conformance suite: every registered mechanism, with each of its ``example_configs`` (small
enough that approximate and chunked paths really run), must pass every test here.

Invariance tests run in float64 so that "unchanged" can be checked to 1e-9 rather than to float32
noise; float32 is checked separately against float64.
"""

from __future__ import annotations

import pytest
import torch

import attention_zoo as az
from attention_zoo.masks import pad_mask
from tests.conformance import MAX_SEQ_LEN, as_dtype, build, case_id, cases, perturbed, qkv

CASES = cases()
EXACT = dict(rtol=0.0, atol=1e-9)  # float64 "unchanged"
LENGTHS = (17, 32, 40)  # several lengths, not all multiples of any block, window or landmark count


def supports(name: str, capability: str) -> bool:
    return getattr(az.get_attention_class(name), capability)


@pytest.fixture(params=CASES, ids=[case_id(c) for c in CASES])
def case(request):
    return request.param


def test_example_configs_fit_the_conformance_shapes(case):
    name, options = case
    assert build(name, options).max_seq_len == MAX_SEQ_LEN


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_shape_and_dtype(case, n, dtype):
    name, options = case
    core = build(name, options, dtype)
    q, k, v = qkv(core, 2, n, dtype=dtype)
    out = core(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()


def test_cross_attention_shapes(case):
    name, options = case
    if not supports(name, "supports_cross_attention"):
        core = build(name, options)
        q, _, _ = qkv(core, 2, 24)
        k = v = torch.randn(2, q.shape[1], 40, q.shape[3], dtype=q.dtype)
        with pytest.raises(ValueError, match="self-attention only"):
            core(q, k, v)
        return
    core = build(name, options)
    q, k, v = qkv(core, 2, 24, nk=40)
    mask = pad_mask(torch.tensor([40, 33]), 40)
    out = core(q, k, v, mask=mask)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_reach_inputs_and_parameters(case, causal):
    name, options = case
    if causal and not supports(name, "supports_causal"):
        pytest.skip(f"{name} does not support causal attention (checked in test_unsupported_causal_raises)")
    core = build(name, options, torch.float32).train()
    q, k, v = qkv(core, 2, 32, dtype=torch.float32)
    leaves = [q] if core.needs_shared_qk else [q, k]
    leaves.append(v)
    for t in leaves:
        t.requires_grad_(True)
    if core.needs_shared_qk:
        k = q
    mask = pad_mask(torch.tensor([32, 25]), 32) if supports(name, "supports_mask") else None
    out = core(q, k, v, mask=mask, causal=causal)
    (out * torch.randn_like(out)).sum().backward()
    for t in leaves:
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    for pname, p in core.named_parameters():
        assert p.grad is not None, f"parameter {pname} gets no gradient"
        assert torch.isfinite(p.grad).all(), f"parameter {pname} has a non-finite gradient"


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_are_finite(case, causal):
    name, options = case
    if not supports(name, "supports_mask") or (causal and not supports(name, "supports_causal")):
        pytest.skip("capability not supported")
    core = build(name, options, torch.float32)
    q, k, v = qkv(core, 3, 32, dtype=torch.float32)
    q.requires_grad_(True)
    if core.needs_shared_qk:
        k = q
    mask = pad_mask(torch.tensor([32, 0, 5]), 32)  # batch item 1 has no real token at all
    out = core(q, k, v, mask=mask, causal=causal)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
def test_padding_invariance(case, n, causal):
    name, options = case
    if not supports(name, "supports_mask") or (causal and not supports(name, "supports_causal")):
        pytest.skip("capability not supported")
    core = build(name, options)
    q, k, v = qkv(core, 3, n)
    lengths = torch.tensor([n, n - 5, n // 2])
    mask = pad_mask(lengths, n)
    out = core(q, k, v, mask=mask, causal=causal)
    out2 = core(*perturbed(core, q, k, v, ~mask), mask=mask, causal=causal)
    for b, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(out2[b, :, :length], out[b, :, :length], **EXACT)


@pytest.mark.parametrize("n", LENGTHS)
def test_no_future_leakage_when_causal(case, n):
    name, options = case
    if not supports(name, "supports_causal"):
        pytest.skip("not causal (see test_unsupported_causal_raises)")
    core = build(name, options)
    q, k, v = qkv(core, 2, n)
    out = core(q, k, v, causal=True)
    for cut in sorted({1, n // 3, n // 2, n - 1}):
        future = torch.arange(n)[None, :].expand(2, n) >= cut
        out2 = core(*perturbed(core, q, k, v, future, seed=cut), causal=True)
        torch.testing.assert_close(out2[:, :, :cut], out[:, :, :cut], **EXACT, msg=f"leak into positions < {cut}")


def test_unsupported_causal_raises(case):
    name, options = case
    if supports(name, "supports_causal"):
        pytest.skip("supports causal")
    core = build(name, options)
    q, k, v = qkv(core, 1, 16)
    with pytest.raises(ValueError, match="does not support causal"):
        core(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_batch_independence(case, causal):
    name, options = case
    if causal and not supports(name, "supports_causal"):
        pytest.skip("not causal")
    core = build(name, options)
    q, k, v = qkv(core, 3, 29)
    mask = pad_mask(torch.tensor([29, 20, 11]), 29) if supports(name, "supports_mask") else None
    out = core(q, k, v, mask=mask, causal=causal)
    for b in range(3):
        alone = core(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], mask=None if mask is None else mask[b : b + 1], causal=causal
        )
        torch.testing.assert_close(alone, out[b : b + 1], **EXACT)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_agrees_with_float64(case, causal):
    name, options = case
    if causal and not supports(name, "supports_causal"):
        pytest.skip("not causal")
    core64 = build(name, options, torch.float64)
    core32 = as_dtype(core64, torch.float32)
    q, k, v = qkv(core64, 2, 32)
    mask = pad_mask(torch.tensor([32, 27]), 32) if supports(name, "supports_mask") else None
    out64 = core64(q, k, v, mask=mask, causal=causal)
    out32 = core32(q.float(), k.float(), v.float(), mask=mask, causal=causal)
    torch.testing.assert_close(out32.double(), out64, rtol=1e-3, atol=1e-4)


def test_too_long_input_raises_when_bounded(case):
    name, options = case
    core = build(name, options)
    q, k, v = qkv(core, 1, MAX_SEQ_LEN + 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        core(q, k, v)
