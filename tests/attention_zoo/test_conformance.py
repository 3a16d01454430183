"""The conformance suite: every registered mechanism, with each of its ``example_configs`` (small
enough that approximate and chunked paths really run), must pass every test here.

Invariance tests run in float64 so that "unchanged" can be checked to 1e-9 rather than to float32
noise; float32 is checked separately against float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import attention_zoo as az
from attention_zoo.masks import pad_mask
from tests.attention_zoo.registry_cases import MAX_SEQ_LEN, as_dtype, as_function, build, case_id, cases, perturbed, qkv

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
        assert t.grad is not None and torch.isfinite(t.grad).all()
        if core.mixes_positions or t is v:
            assert t.grad.abs().sum() > 0
        else:  # the control: softmax over the own key alone is 1 whatever q and k are
            assert not t.grad.any()
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
    """A causal output depends on the positions up to it only: not on later content (a leak) and not on how
    long the whole sequence is (its prefix alone gives the same outputs)."""
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
        prefix = core(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], causal=True)
        torch.testing.assert_close(prefix, out[:, :, :cut], **EXACT, msg=f"prefix of length {cut}")


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


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_padding_never_reaches_real_outputs(case, fill):
    name, options = case
    if not supports(name, "supports_mask"):
        pytest.skip("capability not supported")
    causal_modes = [False, True] if supports(name, "supports_causal") else [False]
    core = build(name, options)
    q, k, v = qkv(core, 3, 32)
    lengths = torch.tensor([32, 27, 16])
    mask = pad_mask(lengths, 32)
    padded = ~mask[:, None, :, None]
    poisoned = [t.masked_fill(padded, fill) for t in (q, k, v)]
    if core.needs_shared_qk:
        poisoned[1] = poisoned[0]
    for causal in causal_modes:
        out = core(q, k, v, mask=mask, causal=causal)
        out2 = core(*poisoned, mask=mask, causal=causal)
        for b, length in enumerate(lengths.tolist()):
            torch.testing.assert_close(out2[b, :, :length], out[b, :, :length], **EXACT)


@pytest.mark.parametrize("chunk", [1, 3])
def test_decoding_equals_the_causal_forward(case, chunk):
    """Step-by-step decoding (with the core's cache, or the recompute fallback) gives the causal forward's
    outputs at every real position, with padding in the sequences (left, right and inside)."""
    name, options = case
    if not supports(name, "supports_causal"):
        pytest.skip("not causal")
    core = build(name, options)
    n = 29
    q, k, v = qkv(core, 3, n)
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[1, 20:] = False  # right padding
    mask[2, 9:12] = False  # a hole
    masks = [mask] if supports(name, "supports_mask") else []
    for m in [None, *masks]:
        full = core(q, k, v, mask=m, causal=True)
        state = core.start_decoding()
        steps = []
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            qs, ks, vs = q[:, :, part], k[:, :, part], v[:, :, part]
            if core.needs_shared_qk:
                ks = qs
            steps.append(core.decode(qs, ks, vs, state, mask=None if m is None else m[:, part]))
        assert state.length == n
        decoded = torch.cat(steps, dim=-2)
        real = torch.ones(3, n, dtype=torch.bool) if m is None else m
        for b in range(3):
            torch.testing.assert_close(decoded[b][:, real[b]], full[b][:, real[b]], rtol=0.0, atol=1e-10)


def test_decoding_state_reorders_like_the_batch(case):
    """Beam search reorders sequences between steps: a reordered state continues the reordered batch."""
    name, options = case
    if not supports(name, "supports_causal"):
        pytest.skip("not causal")
    core = build(name, options)
    q, k, v = qkv(core, 3, 12)
    if core.needs_shared_qk:
        k = q
    state = core.start_decoding()
    core.decode(q[:, :, :7], k[:, :, :7], v[:, :, :7], state)
    index = torch.tensor([2, 0, 0])
    state.reorder(index)
    out = core.decode(q[index, :, 7:], k[index, :, 7:], v[index, :, 7:], state)
    full = core(q[index], k[index], v[index], causal=True)
    torch.testing.assert_close(out, full[:, :, 7:], rtol=0.0, atol=1e-10)


def test_decoding_is_refused_by_non_causal_cores_and_past_max_seq_len(case):
    name, options = case
    core = build(name, options)
    if not supports(name, "supports_causal"):
        with pytest.raises(ValueError, match="not causal"):
            core.start_decoding()
        return
    state = core.start_decoding()
    q, k, v = qkv(core, 1, MAX_SEQ_LEN)
    if core.needs_shared_qk:
        k = q
    core.decode(q, k, v, state)
    with pytest.raises(ValueError, match="max_seq_len"):
        core.decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], state)


@pytest.mark.parametrize("shape", [(0, 16, 16), (2, 0, 0), (2, 8, 0)], ids=["B=0", "N=0", "Nk=0"])
def test_empty_inputs_give_empty_or_zero_outputs(case, shape):
    name, options = case
    b, nq, nk = shape
    if nq != nk and not supports(name, "supports_cross_attention"):
        pytest.skip("self-attention only")
    core = build(name, options)
    q = torch.randn(b, core.heads, nq, core.dim_head, dtype=torch.float64)
    k = v = torch.randn(b, core.heads, nk, core.dim_head, dtype=torch.float64)
    if core.needs_shared_qk:
        k = v = q
    for causal in [False, True] if supports(name, "supports_causal") else [False]:
        out = core(q, k, v, causal=causal)
        assert out.shape == q.shape and not out.any()


def test_inputs_that_break_the_contract_are_refused(case):
    name, options = case
    core = build(name, options)
    q, k, v = qkv(core, 2, 16)
    with pytest.raises(ValueError, match="floating point"):
        core(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="one head width"):
        core(q, k, torch.randn(2, core.heads, 16, core.dim_head + 1, dtype=q.dtype))
    with pytest.raises(ValueError, match="one device"):
        core(q, k.to("meta"), v)
    if any(p.is_floating_point() for p in core.parameters()):
        with pytest.raises(ValueError, match="build the core in the inputs' dtype"):
            core(q.float(), k.float(), v.float())


@pytest.mark.parametrize("bad", [{"dim_head": 8.5}, {"heads": True}, {"max_seq_len": True}, {"max_seq_len": "64"}])
def test_base_arguments_are_type_checked(case, bad):
    name, options = case
    arguments = {"dim_head": 8, "heads": 2, "max_seq_len": MAX_SEQ_LEN, **bad}
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an int"):
        az.create_attention(name, **arguments, **options)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_double_backward_is_exact_or_refused_with_one_clear_error(case, causal):
    """Second-order gradients (a gradient penalty, a Hessian-vector product) through attention: a core that
    claims ``supports_double_backward`` passes ``gradgradcheck``, in both modes (each may have its own custom
    backward); any other refuses create_graph=True with one error naming itself, never a torch-internal error
    and never a silently wrong (first-order-only) result."""
    name, options = case
    if causal and not supports(name, "supports_causal"):
        pytest.skip("not causal")
    core = build(name, options)
    mask = pad_mask(torch.tensor([6, 4]), 6) if supports(name, "supports_mask") else None
    attention, inputs = as_function(core, *qkv(core, 2, 6), mask=mask, causal=causal)
    if supports(name, "supports_double_backward"):
        assert torch.autograd.gradgradcheck(attention, inputs, fast_mode=True)
        return
    with pytest.raises(RuntimeError, match=f"attention {name!r} does not support double backward"):
        torch.autograd.grad(attention(*inputs).square().sum(), inputs, create_graph=True)
    assert all(g is not None for g in torch.autograd.grad(attention(*inputs).square().sum(), inputs))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients(case, causal, reentrant):
    """torch.utils.checkpoint recomputes the forward in backward: every random choice a core makes (Performer's
    feature redraws, LSH rotations, BigBird's random blocks, dropout) must come out the same the second time."""
    name, options = case
    if causal and not supports(name, "supports_causal"):
        pytest.skip("not causal")
    base = build(name, options).train()
    mask = pad_mask(torch.tensor([20, 13]), 20) if supports(name, "supports_mask") else None
    results = []
    for checkpointed in (False, True):
        core = copy.deepcopy(base)
        attention, inputs = as_function(core, *qkv(core, 2, 20), mask=mask, causal=causal)
        for _ in range(2):  # a second step: the state the first left behind must be the same too
            out = checkpoint(attention, *inputs, use_reentrant=reentrant) if checkpointed else attention(*inputs)
            (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()  # reentrant: no .grad()
        results.append(([t.grad for t in (*inputs, *core.parameters())], core.state_dict()))
    (plain, plain_state), (recomputed, recomputed_state) = results
    for a, b in zip(plain, recomputed, strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    assert plain_state.keys() == recomputed_state.keys()
    for key, value in plain_state.items():
        torch.testing.assert_close(recomputed_state[key], value, rtol=0.0, atol=0.0, msg=f"state {key}")


def test_decoding_refuses_a_batch_that_changed_without_reorder(case):
    """A decoding state holds rows of one batch: a step with fewer (or more) sequences than it holds, without
    ``state.reorder(index)`` first, is refused in one line instead of reading other rows' cache."""
    name, options = case
    if not supports(name, "supports_causal"):
        pytest.skip("not causal")
    core = build(name, options)
    q, k, v = qkv(core, 3, 6)
    state = core.start_decoding()
    core.decode(q[:, :, :4], k[:, :, :4], v[:, :, :4], state)
    for rows in (slice(0, 2), [0, 1, 2, 2]):
        step = [t[rows, :, 4:5] for t in (q, k, v)]
        with pytest.raises(ValueError, match=f"{name}.decode: .*{len(q[rows])} sequences.*holds 3.*reorder"):
            core.decode(*step, state)
    state.reorder(torch.tensor([0, 1]))
    assert core.decode(*(t[:2, :, 4:5] for t in (q, k, v)), state).shape == (2, core.heads, 1, core.dim_head)
