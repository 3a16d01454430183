"""Nystrom attention against full attention and against its own definitions (float64 references)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.masks import pad_mask
from attention_zoo.nystrom import attention as nystrom
from attention_zoo.nystrom.attention import SoftmaxProduct, iterative_pinv

H, D = 2, 8
F64 = torch.float64


def make(**options) -> az.AttentionCore:
    torch.manual_seed(0)
    return az.create_attention("nystrom", dim_head=D, heads=H, **options).double()


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(b: int, n: int, seed: int = 0, dtype: torch.dtype = F64) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(randn(b, H, n, D, seed=seed + i, dtype=dtype) for i in range(3))


def smooth_qk(b: int, n: int, seed: int) -> tuple[Tensor, Tensor]:
    """Queries and keys that drift along the sequence (random walks), the structure segment means rely on."""
    return tuple(3 * randn(b, H, n, D, seed=seed + i).cumsum(dim=2) / n**0.5 for i in range(2))


def full_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    return az.create_attention("full", dim_head=D, heads=H, backend="math")(q, k, v, mask=mask)


def razavi(a: Tensor, z: Tensor, iterations: int) -> Tensor:
    """The paper's iteration written out term by term, from a given Z_0."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    for _ in range(iterations):
        z = 0.25 * z @ (13 * eye - a @ z @ (15 * eye - a @ z @ (7 * eye - a @ z)))
    return z


def softmax_matrices(b: int, m: int, seed: int, sharpness: float = 1.0) -> Tensor:
    x, y = randn(b, H, m, D, seed=seed), randn(b, H, m, D, seed=seed + 1)
    return (sharpness * x @ y.transpose(-1, -2) / D**0.5).softmax(dim=-1)


# --- m = n: every landmark is one token ---------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 29])
def test_one_token_per_landmark_with_exact_pinv_is_full_attention(n):
    q, k, v = qkv(2, n)
    # F~ = A~ = B~ = S and S S^+ S = S; m > n leaves m - n empty segments, which must drop out
    for m in (n, 2 * n + 3):
        torch.testing.assert_close(
            make(num_landmarks=m, pinv="exact")(q, k, v), full_attention(q, k, v), rtol=0, atol=1e-10
        )


@pytest.mark.parametrize("n", [16, 29])
def test_one_token_per_landmark_with_iterative_pinv_is_full_attention_to_pinv_tolerance(n):
    q, k, v = qkv(2, n)
    reference = full_attention(q, k, v)
    # here A~ = S, condition number ~1e3-1e4 for these inputs: 6 steps (the paper's) leave a few 1e-2,
    # 20 steps converge to float64 round-off
    error = {it: (make(num_landmarks=n, pinv_iterations=it)(q, k, v) - reference).abs().max() for it in (6, 10, 20)}
    assert error[6] < 0.1 and error[10] < error[6] / 3 and error[20] < 1e-9


# --- the approximation improves with m ----------------------------------------------------------------


@pytest.mark.parametrize("inputs", ["gaussian", "smooth"])
def test_error_falls_as_landmarks_grow(inputs):
    n, landmarks, seeds = 64, (4, 8, 16, 32, 64), range(4)
    errors = torch.zeros(len(landmarks))
    for seed in seeds:
        q, k, v = qkv(2, n, seed=10 * seed)
        if inputs == "smooth":
            q, k = smooth_qk(2, n, seed=10 * seed)
        reference = full_attention(q, k, v)
        for i, m in enumerate(landmarks):
            errors[i] += (make(num_landmarks=m)(q, k, v) - reference).norm() / reference.norm() / len(seeds)
    # measured mean relative errors: gaussian 0.73 0.64 0.49 0.38 0.04, smooth 0.43 0.25 0.12 0.07 0.04
    assert (errors[1:] <= errors[:-1] + 0.01).all(), errors
    assert errors[-1] < 0.1 and errors[0] > 3 * errors[-1], errors


def test_exact_pinv_amplifies_errors_on_near_singular_landmarks():
    # an honest negative result the docstring reports: the iteration regularises, the SVD does not
    q, k = smooth_qk(2, 64, seed=0)
    v = randn(2, H, 64, D, seed=2)
    reference = full_attention(q, k, v)
    relative = lambda out: ((out - reference).norm() / reference.norm()).item()
    assert relative(make(num_landmarks=8, pinv="exact")(q, k, v)) > 10 * relative(make(num_landmarks=8)(q, k, v))


# --- landmarks: segment means over real tokens --------------------------------------------------------


def loop_landmarks(x: Tensor, mask: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """Segment j of a sequence with L real tokens: the real tokens of rank r with floor(r m / L) = j."""
    means, present = torch.zeros(*x.shape[:2], m, x.shape[3], dtype=x.dtype), torch.zeros(x.shape[0], m, dtype=bool)
    for b in range(x.shape[0]):
        real = mask[b].nonzero().flatten().tolist()
        for j in range(m):
            members = [pos for r, pos in enumerate(real) if r * m // len(real) == j]
            if members:
                means[b, :, j] = x[b, :, members].mean(dim=1)
                present[b, j] = True
    return means, present


@pytest.mark.parametrize(("n", "m"), [(17, 4), (29, 8), (32, 8), (12, 16)])
def test_landmarks_are_segment_means_of_real_tokens(n, m):
    q, k, _ = qkv(3, n)
    mask = pad_mask(torch.tensor([n, n - 5, 3]), n)
    mask[0, 2] = False  # a hole, not only trailing padding
    q_land, k_land, present = make(num_landmarks=m).landmarks(q, k, mask, torch.float64)
    expected_q, expected_present = loop_landmarks(q, mask, m)
    expected_k, _ = loop_landmarks(k, mask, m)
    torch.testing.assert_close(q_land, expected_q, rtol=0, atol=1e-12)
    torch.testing.assert_close(k_land, expected_k, rtol=0, atol=1e-12)
    if present is None:
        assert expected_present.all()
    else:
        assert torch.equal(present, expected_present)


def test_reshape_path_equals_general_path():
    # n divisible by m without a mask uses a reshape; an all-True mask goes through the general path
    q, k, v = qkv(2, 32)
    core = make(num_landmarks=8, conv_kernel_size=3)
    torch.testing.assert_close(core(q, k, v), core(q, k, v, mask=torch.ones(2, 32, dtype=bool)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [{"num_landmarks": 8}, {"num_landmarks": 4, "conv_kernel_size": 5}])
def test_output_does_not_depend_on_how_much_padding_follows(options):
    core = make(**options)
    q, k, v = qkv(1, 19)
    alone = core(q, k, v)
    padded = [torch.cat([t, randn(1, H, 21, D, seed=9)], dim=2) for t in (q, k, v)]
    out = core(*padded, mask=pad_mask(torch.tensor([19]), 40))
    torch.testing.assert_close(out[:, :, :19], alone, rtol=0, atol=1e-12)


def test_sequence_without_real_tokens_gives_zeros():
    q, k, v = qkv(2, 20)
    out = make(num_landmarks=8, conv_kernel_size=3)(q, k, v, mask=pad_mask(torch.tensor([20, 0]), 20))
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


# --- the pseudo-inverse -------------------------------------------------------------------------------


def test_iterative_pinv_is_the_papers_iteration_and_converges():
    a = softmax_matrices(2, 8, seed=0)
    z0 = a.transpose(-1, -2) / (a.sum(-2).amax(-1) * a.sum(-1).amax(-1))[..., None, None]
    torch.testing.assert_close(iterative_pinv(a, 6), razavi(a, z0, 6), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(iterative_pinv(a, 30), torch.linalg.pinv(a), rtol=1e-8, atol=1e-8)


def test_pinv_scale_is_per_matrix():
    # a sharp softmax matrix (large column sums) next to an ordinary one: each must get its own Z_0
    a = torch.cat([softmax_matrices(1, 8, seed=0), softmax_matrices(1, 8, seed=5, sharpness=30)])
    together, alone = iterative_pinv(a, 6), iterative_pinv(a[:1], 6)
    torch.testing.assert_close(together[:1], alone, rtol=0, atol=1e-14)
    # the check has teeth: the reference code's batch-wide max column sum would change the first result
    batch_max = a.sum(-2).amax()
    assert (razavi(a[:1], a[:1].transpose(-1, -2) / batch_max, 6) - alone).abs().max() > 1e-3


def test_batch_result_equals_per_element_results_with_an_extreme_element():
    q, k, v = qkv(3, 29)
    q[1], k[1] = 30 * q[1], 30 * k[1]  # near one-hot softmaxes in element 1
    mask = pad_mask(torch.tensor([29, 29, 20]), 29)
    for core in (make(num_landmarks=8), make(num_landmarks=8, pinv="exact", conv_kernel_size=3)):
        out = core(q, k, v, mask=mask)
        for b in range(3):
            torch.testing.assert_close(
                core(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask=mask[b : b + 1]), out[b : b + 1], rtol=0, atol=1e-12
            )


# --- low precision ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pinv", ["iterative", "exact"])
def test_half_precision_inputs_give_finite_output_in_their_dtype(dtype, pinv):
    core = make(num_landmarks=8, pinv=pinv, conv_kernel_size=3)
    q, k, v = qkv(2, 40)
    mask = pad_mask(torch.tensor([40, 13]), 40)
    reference = core(q, k, v, mask=mask)
    out = core.to(dtype)(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    if pinv == "iterative":  # the exact pseudo-inverse is ill-conditioned here (see the module docstring)
        assert (out.double() - reference).abs().max() < 0.1


def test_pinv_runs_in_float32_under_autocast(monkeypatch):
    seen = []
    monkeypatch.setattr(nystrom, "iterative_pinv", lambda a, it: seen.append(a.dtype) or iterative_pinv(a, it))
    core = az.create_attention("nystrom", dim_head=D, heads=H, num_landmarks=8)
    q, k, v = qkv(2, 40, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = core(q, k, v)
    assert seen == [torch.float32] and out.dtype == torch.float32 and torch.isfinite(out).all()
    q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
    assert core(q16, k16, v16).dtype == torch.bfloat16 and seen[-1] == torch.float32


# --- the blocked product and the convolution skip -----------------------------------------------------


@pytest.mark.parametrize("block_elements", [1 << 18, 1, 60])  # all at once, one head per block, whole elements
def test_softmax_product_matches_autograd(monkeypatch, block_elements):
    monkeypatch.setattr(nystrom, "BLOCK_ELEMENTS", block_elements)
    x, y, u = randn(3, H, 5, D, seed=0), randn(3, H, 6, D, seed=1), randn(3, H, 6, 4, seed=2)
    allowed = pad_mask(torch.tensor([6, 2, 0]), 6)[:, None, None, :]
    leaves = [t.requires_grad_() for t in (x, y, u)]
    out = SoftmaxProduct.apply(x, y, u, allowed)
    scores = (x @ y.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    reference = torch.nan_to_num(scores.softmax(-1)) @ u
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    grad = randn(*out.shape, seed=3)
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(reference, leaves, grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("same_keys", [False, True], ids=["y", "y=x"])
def test_softmax_product_second_order_with_inputs_computed_from_each_other(same_keys):
    """Nystrom's second product takes u = A~^+ (B~ V), computed from its own queries x; a self-attention caller may
    pass one tensor as x and y. The gradient graph that create_graph=True builds must hold each input's own
    partial derivative only (the caller's graph adds the paths between inputs), so first- and second-order
    gradients equal those of the same expression by plain autograd."""
    x, y, w, r = (randn(2, H, 6, D, seed=seed) for seed in range(4))
    mix = randn(2, H, 6, 6, seed=4)
    allowed = pad_mask(torch.tensor([6, 4]), 6)[:, None, None, :]

    def f(product, x: Tensor) -> Tensor:
        return (product(x, x if same_keys else y, mix @ x, allowed) * w).sum()

    def gradient_and_hvp(product) -> tuple[Tensor, Tensor]:
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(f(product, leaf), leaf, create_graph=True)
        (hr,) = torch.autograd.grad((grad * r).sum(), leaf)
        return grad.detach(), hr

    got, want = gradient_and_hvp(SoftmaxProduct.apply), gradient_and_hvp(nystrom.softmax_product)
    for g, expected in zip(got, want, strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("n", "m", "d"), [(10, 4, 8), (64, 16, 16)])
def test_hessian_is_symmetric_at_the_sizes_of_the_report(n, m, d):
    """hvp and vhp of f(q) = sum(core(q, k, v) * w) agree: a scalar function's Hessian is symmetric."""
    torch.manual_seed(0)
    core = az.create_attention("nystrom", dim_head=d, heads=H, num_landmarks=m).double()
    q, k, v, w, r = (randn(1, H, n, d, seed=seed) for seed in range(5))

    def f(q: Tensor) -> Tensor:
        return (core(q, k, v) * w).sum()

    _, hr = torch.autograd.functional.hvp(f, q, r)
    _, rh = torch.autograd.functional.vhp(f, q, r)
    assert (hr - rh).norm() <= 1e-8 * hr.norm()


def test_convolution_skip_is_a_depthwise_conv_on_masked_values_and_is_trained():
    q, k, v = qkv(2, 24)
    mask = pad_mask(torch.tensor([24, 17]), 24)
    with_conv, without = make(num_landmarks=4, conv_kernel_size=3), make(num_landmarks=4)
    out = with_conv(q, k, v, mask=mask)
    masked_v = v * mask[:, None, :, None]
    weight = with_conv.conv.weight[:, 0, :, 0]  # (H, 3): one filter per head along the sequence
    padded = torch.nn.functional.pad(masked_v, (0, 0, 1, 1))
    skip = sum(weight[None, :, t, None, None] * padded[:, :, t : t + 24] for t in range(3))
    torch.testing.assert_close(out, without(q, k, v, mask=mask) + skip, rtol=0, atol=1e-12)
    out.square().sum().backward()
    assert with_conv.conv.weight.grad is not None and with_conv.conv.weight.grad.abs().sum() > 0


# --- what it refuses ----------------------------------------------------------------------------------


def test_causal_is_refused_with_the_reason():
    q, k, v = qkv(1, 16)
    with pytest.raises(ValueError, match="does not support causal.*later tokens"):
        make(num_landmarks=4)(q, k, v, causal=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_landmarks": 0}, "num_landmarks must be an int >= 1, got 0"),
        ({"pinv_iterations": 0}, "pinv_iterations must be >= 1"),
        ({"conv_kernel_size": 4}, "positive odd int"),
        ({"pinv": "svd"}, "'iterative' \\| 'exact'"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        az.create_attention("nystrom", dim_head=D, heads=H, **options)


def test_iterations_with_exact_pinv_are_rejected_not_ignored():
    with pytest.raises(ValueError, match="no effect with pinv='exact'"):
        az.create_attention("nystrom", dim_head=8, heads=2, num_landmarks=4, pinv="exact", pinv_iterations=10)
