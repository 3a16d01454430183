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
from tests.attention_zoo.registry_cases import (
    MAX_SEQ_LEN,
    as_dtype,
    as_function,
    build,
    case_id,
    cases,
    causal_modes,
    perturbed,
    plain_causal,
    qkv,
    skip_unless_takes,
)

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
    out = core(q, k, v, causal=plain_causal(name))
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()


def test_cross_attention_shapes(case):
    name, options = case
    if not supports(name, "supports_cross_attention"):
        core = build(name, options)
        q, _, _ = qkv(core, 2, 24)
        k = v = torch.randn(2, q.shape[1], 40, q.shape[3], dtype=q.dtype)
        with pytest.raises(ValueError, match="self-attention only"):
            core(q, k, v, causal=plain_causal(name))
        return
    core = build(name, options)
    q, k, v = qkv(core, 2, 24, nk=40)
    mask = pad_mask(torch.tensor([40, 33]), 40)
    out = core(q, k, v, mask=mask)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_reach_inputs_and_parameters(case, causal):
    name, options = case
    skip_unless_takes(name, causal)
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
    skip_unless_takes(name, causal)
    if not supports(name, "supports_mask"):
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
    skip_unless_takes(name, causal)
    if not supports(name, "supports_mask"):
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


def test_causal_only_cores_refuse_bidirectional_calls_and_models(case):
    name, options = case
    if not supports(name, "causal_only"):
        pytest.skip("takes causal=False")
    core = build(name, options)
    q, k, v = qkv(core, 1, 16)
    with pytest.raises(ValueError, match=f"^{name} is causal only: call it with causal=True"):
        core(q, k, v, causal=False)
    with pytest.raises(ValueError, match="is causal only: use it where attention is causal"):
        az.MultiHeadAttention(16, 2, attention=name, attention_options=options, causal=False)
    assert name in az.list_attentions(causal_only=True) and name in az.list_attentions(causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_batch_independence(case, causal):
    name, options = case
    skip_unless_takes(name, causal)
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
    skip_unless_takes(name, causal)
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
        core(q, k, v, causal=plain_causal(name))


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_padding_never_reaches_real_outputs(case, fill):
    name, options = case
    if not supports(name, "supports_mask"):
        pytest.skip("capability not supported")
    core = build(name, options)
    q, k, v = qkv(core, 3, 32)
    lengths = torch.tensor([32, 27, 16])
    mask = pad_mask(lengths, 32)
    padded = ~mask[:, None, :, None]
    poisoned = [t.masked_fill(padded, fill) for t in (q, k, v)]
    if core.needs_shared_qk:
        poisoned[1] = poisoned[0]
    for causal in causal_modes(name):
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


EMPTY_SHAPES = {"B=0": (0, 16, 16), "N=0": (2, 0, 0), "Nk=0": (2, 8, 0), "Nq=0": (2, 0, 8)}


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("shape", EMPTY_SHAPES.values(), ids=EMPTY_SHAPES.keys())
def test_empty_inputs_give_zero_outputs_that_backward_to_zero_gradients(case, shape, masked):
    """An empty batch (the last shard of a distributed epoch), or queries without keys, gives the empty or
    all-zero output, and that output is part of the graph: backward gives zero gradients to q, k, v and to
    every parameter of the core (zeros, not None: DDP waits for a gradient of every parameter). A second-order
    gradient follows ``supports_double_backward`` as for any other input."""
    name, options = case
    b, nq, nk = shape
    if nq != nk and not supports(name, "supports_cross_attention"):
        pytest.skip("self-attention only")
    if masked and not supports(name, "supports_mask"):
        pytest.skip("no padding masks")
    core = build(name, options).train()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(b, core.heads, nq, core.dim_head, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(b, core.heads, nk, core.dim_head, generator=generator, dtype=torch.float64) for _ in "kv")
    leaves = [q, v] if core.needs_shared_qk else [q, k, v]
    for t in leaves:
        t.requires_grad_(True)
    keys = q if core.needs_shared_qk else k
    mask = pad_mask(torch.full((b,), nk // 2), nk) if masked else None
    for causal in causal_modes(name):
        core.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None
        out = core(q, keys, v, mask=mask, causal=causal)
        assert out.shape == q.shape and not out.any()
        (out * torch.randn(out.shape, generator=generator, dtype=out.dtype)).sum().backward()
        for t in leaves:
            torch.testing.assert_close(t.grad, torch.zeros_like(t), rtol=0.0, atol=0.0)
        for pname, p in core.named_parameters():
            assert p.grad is not None, f"parameter {pname} gets no gradient from an empty batch"
            torch.testing.assert_close(p.grad, torch.zeros_like(p), rtol=0.0, atol=0.0)
        out = core(q, keys, v, mask=mask, causal=causal)
        if not supports(name, "supports_double_backward"):
            with pytest.raises(RuntimeError, match=f"attention {name!r} does not support double backward"):
                torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
            continue
        grads = torch.autograd.grad((out + 1).square().sum(), leaves, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() + g.sum() for g in grads), leaves, allow_unused=False)
        for t, g in zip(leaves, second, strict=True):
            torch.testing.assert_close(g, torch.zeros_like(t), rtol=0.0, atol=0.0)


def test_an_empty_decoding_step_backwards_to_zero_gradients(case):
    name, options = case
    if not supports(name, "supports_causal"):
        pytest.skip("not causal")
    core = build(name, options).train()
    q, k, v = (t[:0].requires_grad_(True) for t in qkv(core, 2, 4))
    if core.needs_shared_qk:
        k = q
    out = core.decode(q, k, v, core.start_decoding())
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and v.grad is not None and v.grad.shape == v.shape
    for pname, p in core.named_parameters():
        assert p.grad is not None and not p.grad.any(), f"parameter {pname}: {p.grad}"


def test_inputs_that_break_the_contract_are_refused(case):
    name, options = case
    core = build(name, options)
    q, k, v = qkv(core, 2, 16)
    causal = plain_causal(name)
    with pytest.raises(ValueError, match="floating point"):
        core(q.long(), k.long(), v.long(), causal=causal)
    with pytest.raises(ValueError, match="one head width"):
        core(q, k, torch.randn(2, core.heads, 16, core.dim_head + 1, dtype=q.dtype), causal=causal)
    with pytest.raises(ValueError, match="one device"):
        core(q, k.to("meta"), v, causal=causal)
    if any(p.is_floating_point() for p in core.parameters()):
        with pytest.raises(ValueError, match="build the core in the inputs' dtype"):
            core(q.float(), k.float(), v.float(), causal=causal)


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
    skip_unless_takes(name, causal)
    core = build(name, options)
    mask = pad_mask(torch.tensor([6, 4]), 6) if supports(name, "supports_mask") else None
    attention, inputs = as_function(core, *qkv(core, 2, 6), mask=mask, causal=causal)
    if supports(name, "supports_double_backward"):
        assert torch.autograd.gradgradcheck(attention, inputs, fast_mode=True)
        return
    with pytest.raises(RuntimeError, match=f"attention {name!r} does not support double backward"):
        torch.autograd.grad(attention(*inputs).square().sum(), inputs, create_graph=True)
    assert all(g is not None for g in torch.autograd.grad(attention(*inputs).square().sum(), inputs))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_a_graph_of_the_gradient_for_some_inputs_only_equals_the_plain_gradient(case, causal):
    """create_graph=True when only q and v require grad (k fixed: a frozen key projection): each input gets its own
    gradient, equal to the plain backward's, not another input's or None."""
    name, options = case
    skip_unless_takes(name, causal)
    if not supports(name, "supports_double_backward"):
        pytest.skip("no double backward, or not causal")
    core = build(name, options)
    q, k, v = qkv(core, 2, 6)
    q.requires_grad_(True)
    v.requires_grad_(True)
    mask = pad_mask(torch.tensor([6, 4]), 6) if supports(name, "supports_mask") else None
    plain = torch.autograd.grad(core(q, k, v, mask=mask, causal=causal).square().sum(), (q, v))
    graph = torch.autograd.grad(core(q, k, v, mask=mask, causal=causal).square().sum(), (q, v), create_graph=True)
    for g, expected in zip(graph, plain, strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-9, atol=1e-12)


HESSIAN_N = 12  # several landmarks, blocks and chunks of the example configs; not a multiple of all of them
HESSIAN_EPS = 1e-6  # central differences: truncation ~eps^2 and round-off ~1e-16 / eps
# relative to the norm, not per entry: an ill-conditioned core (Nystrom's exact pseudo-inverse) has Hessian entries
# spanning many orders of magnitude, the small ones carrying the round-off of the large ones, and a large third
# derivative (the central difference's truncation error); a wrong second-order term is off by tens of percent
HESSIAN_RTOL = 1e-5


def assert_close_in_norm(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], what: str) -> None:
    error = sum((a - e).square().sum() for a, e in zip(actual, expected, strict=True)).sqrt()
    scale = sum(e.square().sum() for e in expected).sqrt()
    # plus a floor for a Hessian that is exactly zero (self_only: its output is its values)
    assert error <= HESSIAN_RTOL * scale + 1e-10, f"{what}: error {error:.3g}, {error / scale:.3g} of the norm"


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("shared", [False, True], ids=["q,k,v", "x,x,x"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_hessian_vector_products_are_symmetric_and_match_central_differences(case, causal, shared, masked):
    """For a core with ``supports_double_backward`` and a scalar f(inputs) = sum(core(...) * w) in float64 (B = 2,
    n = 12; ``shared``: self-attention on one tensor, core(x, x, x)): the gradient built with create_graph=True has
    the plain backward's values; the Hessian is symmetric, hvp(f, x, r) == vhp(f, x, r); and H r equals the central
    difference of the plain gradient along r (each to 1e-5 of its norm).

    ``gradgradcheck`` cannot see a wrong gradient graph: it differentiates the graph that create_graph=True builds
    and compares that with finite differences of the same graph's values, never with the plain backward's gradient
    (``gradcheck`` checks that one); a core whose create_graph path computes another, wrong, gradient passes it."""
    name, options = case
    skip_unless_takes(name, causal)
    if not supports(name, "supports_double_backward"):
        pytest.skip("refuses double backward (test_double_backward_is_exact_or_refused_with_one_clear_error)")
    if masked and not supports(name, "supports_mask"):
        pytest.skip("no padding masks")
    core = build(name, options)
    mask = pad_mask(torch.tensor([HESSIAN_N, HESSIAN_N - 3]), HESSIAN_N) if masked else None
    q, k, v = qkv(core, 2, HESSIAN_N)
    attention, inputs = as_function(core, q, k, v, mask=mask, causal=causal)
    if shared:
        inputs = inputs[:1]

        def attention(x: torch.Tensor) -> torch.Tensor:
            return core(x, x, x, mask=mask, causal=causal)

    generator = torch.Generator().manual_seed(1)
    w = torch.randn(q.shape, generator=generator, dtype=q.dtype)
    r = tuple(torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in inputs)

    def f(*tensors: torch.Tensor) -> torch.Tensor:
        return (attention(*tensors) * w).sum()

    def gradient(at: tuple[torch.Tensor, ...], create_graph: bool = False) -> tuple[torch.Tensor, ...]:
        leaves = tuple(t.detach().requires_grad_(True) for t in at)
        return torch.autograd.grad(f(*leaves), leaves, create_graph=create_graph)

    for plain, with_graph in zip(gradient(inputs), gradient(inputs, create_graph=True), strict=True):
        torch.testing.assert_close(
            with_graph.detach(), plain, rtol=1e-9, atol=1e-11, msg=lambda m: f"create_graph: {m}"
        )
    inputs = tuple(t.detach() for t in inputs)
    _, hr = torch.autograd.functional.hvp(f, inputs, r)
    _, rh = torch.autograd.functional.vhp(f, inputs, r)
    assert_close_in_norm(rh, hr, "vhp(f, x, r) against hvp(f, x, r): the Hessian is not symmetric")
    ahead = gradient(tuple(x + HESSIAN_EPS * d for x, d in zip(inputs, r, strict=True)))
    behind = gradient(tuple(x - HESSIAN_EPS * d for x, d in zip(inputs, r, strict=True)))
    difference = tuple((a - b) / (2 * HESSIAN_EPS) for a, b in zip(ahead, behind, strict=True))
    assert_close_in_norm(hr, difference, "Hr against the central difference of the gradient along r")


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_a_second_backward_of_a_retained_graph_adds_the_same_gradients(case, causal):
    """backward(retain_graph=True) then backward again (a core may recompute its forward for the second): the
    gradients double, with one tensor as q, k and v, and the caller's graph before the core is left intact."""
    name, options = case
    skip_unless_takes(name, causal)
    core = build(name, options)
    q, _, _ = qkv(core, 2, 12)
    x = q.clone().requires_grad_(True)
    y = 2 * x  # a node of the caller's graph, which the core's backward must not free or traverse
    out = core(y, y, y, causal=causal)
    loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients(case, causal, reentrant):
    """torch.utils.checkpoint recomputes the forward in backward: every random choice a core makes (Performer's
    feature redraws, LSH rotations, BigBird's random blocks, dropout) must come out the same the second time."""
    name, options = case
    skip_unless_takes(name, causal)
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


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_outputs_and_gradients_do_not_depend_on_the_input_layout(case, causal, batch):
    """The multi-head block hands a core strided views (heads split out of the model width: (B, N, H, D) memory
    read as (B, H, N, D)); a core must give the same outputs and gradients as for contiguous copies, including at
    B = 1, where merging batch and heads keeps the view strided."""
    name, options = case
    skip_unless_takes(name, causal)
    core = build(name, options)
    q, k, v = qkv(core, batch, 24)
    weights = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(5))
    results = []
    for strided in (False, True):
        layout = (lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)) if strided else (lambda t: t.contiguous())
        attention, inputs = as_function(core, q, k, v, mask=None, causal=causal)
        leaves = tuple(t.detach().requires_grad_(True) for t in inputs)
        out = attention(*(layout(t) for t in leaves))
        (out * weights).sum().backward()
        results.append((out.detach(), *(t.grad for t in leaves)))
    for contiguous, strided in zip(*results, strict=True):
        torch.testing.assert_close(strided, contiguous, **EXACT)
