"""Gated DeltaNet (``gated_deltanet``): the gated delta rule, chunked for training and recurrent for decoding.

The reference (``attention_zoo.gated_deltanet.reference``) is the paper's recurrence (Yang et al. 2024,
arXiv:2412.06464, Sec. 3) one position at a time in float64, with S of shape d_v x d_k; it shares no code with
the chunked form. The reference itself is checked against cases worked out by hand from the equations.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.gated_deltanet.attention import DeltaState
from attention_zoo.gated_deltanet.chunked import chunk_gated_delta_rule, recurrent_gated_delta_rule
from attention_zoo.gated_deltanet.reference import gated_delta_rule, gated_deltanet_reference
from attention_zoo.masks import pad_mask

TIGHT = dict(rtol=0.0, atol=1e-10)  # float64, exact up to summation order
HEADS, DIM_HEAD = 2, 8
PARAMETERS = ("w_beta", "b_beta", "w_alpha", "dt_bias", "A_log")


def make(chunk_size: int = 64, dtype: torch.dtype = torch.float64, seed: int = 0) -> az.AttentionCore:
    """A core whose gates spread over (0, 1): random A_log and dt_bias give decays from about 1 down to near 0
    (the initialisation alone keeps α close to 1, which would hide a wrong decay)."""
    torch.manual_seed(seed)
    core = az.create_attention("gated_deltanet", dim_head=DIM_HEAD, heads=HEADS, chunk_size=chunk_size)
    with torch.no_grad():
        core.A_log.copy_(torch.randn(HEADS))
        core.dt_bias.copy_(torch.randn(HEADS))
        core.w_alpha.mul_(3)
        core.w_beta.mul_(3)
    return core.to(dtype)


def inputs(b: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, HEADS, n, DIM_HEAD, generator=generator, dtype=dtype) for _ in range(3))


def reference(core: az.AttentionCore, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    return gated_deltanet_reference(q, k, v, *(getattr(core, p) for p in PARAMETERS), mask=mask)


def gradients(out: Tensor, leaves: list[Tensor], weight: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad((out * weight).sum(), leaves)


# --- the reference against the equations -----------------------------------------------------------------


def unit(*values: float) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def rule(qs: list[Tensor], ks: list[Tensor], vs: list[Tensor], alphas: list[float], betas: list[float]) -> Tensor:
    """:func:`gated_delta_rule` on one sequence given as lists; returns (N, d_v)."""
    stack = lambda ts: torch.stack(ts)[None, None]
    gate = lambda xs: torch.tensor(xs, dtype=torch.float64)[None, None]
    return gated_delta_rule(stack(qs), stack(ks), stack(vs), gate(alphas), gate(betas))[0, 0]


def test_the_reference_follows_a_case_worked_by_hand():
    # d = 2, k_1 = k_2 = e1. S_1 = 0.5 v_1 e1ᵀ = [[0.5, 0], [1, 0]]; S_2 = 0.5 S_1 (I - 0.5 e1 e1ᵀ) + 0.5 v_2 e1ᵀ
    # = 0.5 [[0.25, 0], [0.5, 0]] + [[1.5, 0], [0, 0]] = [[1.625, 0], [0.25, 0]]; o_t = S_t e1 (S_t's first column)
    e1 = unit(1, 0)
    out = rule([e1, e1], [e1, e1], [unit(1, 2), unit(3, 0)], alphas=[1.0, 0.5], betas=[0.5, 0.5])
    torch.testing.assert_close(out, torch.tensor([[0.5, 1.0], [1.625, 0.25]], dtype=torch.float64), **TIGHT)


def test_with_beta_one_the_delta_rule_writes_the_value_exactly_and_keeps_orthogonal_keys():
    """β = 1, α = 1: S_t k_t = v_t for a unit k_t (S (I - k kᵀ) k = 0, then v kᵀ k = v); a later write at an
    orthogonal key leaves what k_1 reads unchanged, and a rewrite at k_1 replaces its value (no sum)."""
    torch.manual_seed(0)
    k1, k2 = unit(0.6, 0.8, 0.0), unit(-0.8, 0.6, 0.0)
    v1, v2, v3 = (torch.randn(3, dtype=torch.float64) for _ in range(3))
    keys = [k1, k2, k1]
    out = rule([k1, k1, k1], keys, [v1, v2, v3], alphas=[1.0] * 3, betas=[1.0] * 3)
    torch.testing.assert_close(out, torch.stack([v1, v1, v3]), **TIGHT)
    out = rule([k1, k2, k2], keys, [v1, v2, v3], alphas=[1.0] * 3, betas=[1.0] * 3)
    torch.testing.assert_close(out[1:], torch.stack([v2, v2]), **TIGHT)


def test_alpha_zero_forgets_and_beta_zero_writes_nothing():
    k1, k2 = unit(1, 0), unit(0, 1)
    v1, v2 = unit(2, 3), unit(5, 7)
    # α_2 = 0: S_2 = β_2 v_2 k_2ᵀ, so k_1 reads nothing any more
    out = rule([k1, k1], [k1, k2], [v1, v2], alphas=[1.0, 0.0], betas=[1.0, 1.0])
    torch.testing.assert_close(out, torch.stack([v1, torch.zeros(2, dtype=torch.float64)]), **TIGHT)
    # β_2 = 0, α_2 = 0.25: S_2 = 0.25 S_1
    out = rule([k1, k1], [k1, k2], [v1, v2], alphas=[1.0, 0.25], betas=[1.0, 0.0])
    torch.testing.assert_close(out[1], 0.25 * v1, **TIGHT)


# --- the chunked form against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize(
    ("chunk_size", "n"),
    [(4, 29), (8, 29), (8, 16), (5, 5), (64, 29), (1, 7)],
    ids=["C4-n29", "C8-n29", "C8-n16", "C5-n5", "C64>n29", "C1-n7"],
)
def test_chunked_equals_the_reference_in_outputs_and_gradients(chunk_size, n, masked):
    core = make(chunk_size)
    q, k, v = (t.requires_grad_(True) for t in inputs(3, n))
    mask = pad_mask(torch.tensor([n, n - 3, n // 2]), n) if masked else None
    if masked:  # and a hole inside the first row
        mask[0, n // 3 : n // 3 + 2] = False
    out = core(q, k, v, mask=mask, causal=True)
    expected = reference(core, q, k, v, mask)
    torch.testing.assert_close(out, expected, **TIGHT)
    leaves = [q, k, v, *(getattr(core, p) for p in PARAMETERS)]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    for name, got, want in zip(
        ["q", "k", "v", *PARAMETERS], gradients(out, leaves, weight), gradients(expected, leaves, weight), strict=True
    ):
        assert want.abs().sum() > 0, f"the reference gives {name} no gradient: the case tests nothing"
        torch.testing.assert_close(got, want, **TIGHT, msg=f"gradient of {name}")


def test_the_gates_spread_over_zero_to_one_in_these_tests():
    """The cases above are only as strong as their gates: some α near 0, some near 1, β across (0, 1)."""
    core = make(8)
    q, k, v = inputs(3, 29)
    log_alpha, beta = core.gates(k, v, None)
    alpha = log_alpha.exp()
    assert alpha.min() < 0.2 and alpha.max() > 0.9
    assert beta.min() < 0.2 and beta.max() > 0.8


def test_chunked_and_recurrent_forms_agree_from_a_nonzero_state():
    generator = torch.Generator().manual_seed(0)
    b, n, d = 2, 23, DIM_HEAD
    q, k, v = (torch.randn(b, HEADS, n, d, generator=generator, dtype=torch.float64) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    log_alpha = -torch.rand(b, HEADS, n, generator=generator, dtype=torch.float64) * 3
    beta = torch.rand(b, HEADS, n, generator=generator, dtype=torch.float64)
    initial = torch.randn(b, HEADS, d, d, generator=generator, dtype=torch.float64)
    out, final = chunk_gated_delta_rule(q, k, v, log_alpha, beta, 5, initial=initial)
    out2, final2 = recurrent_gated_delta_rule(q, k, v, log_alpha, beta, state=initial)
    torch.testing.assert_close(out, out2, **TIGHT)
    torch.testing.assert_close(final, final2, **TIGHT)


# --- padding, decoding, options ------------------------------------------------------------------------------


def test_a_padded_position_changes_nothing_for_the_real_ones():
    """Padding inside a row (β = 0, α = 1 there) gives the real positions the outputs of the row without it."""
    core = make(4)
    q, k, v = inputs(1, 20)
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[0, [0, 6, 7, 8, 15]] = False
    out = core(q, k, v, mask=mask, causal=True)
    real = mask[0]
    compact = core(q[:, :, real], k[:, :, real], v[:, :, real], causal=True)
    torch.testing.assert_close(out[:, :, real], compact, **TIGHT)
    assert not out[:, :, ~real].any()  # a padded position outputs 0


@pytest.mark.parametrize("steps", [[1] * 13, [3, 3, 3, 3, 1], [9, 1, 1, 2], [4, 9]], ids=["1s", "3s", "prefill", "C+"])
def test_decoding_step_by_step_equals_the_causal_forward(steps):
    """Steps shorter than C (the recurrent form) and of C or more positions (the chunked form from the state)."""
    core = make(4)
    n = sum(steps)
    q, k, v = inputs(2, n)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :2] = False  # left padding
    mask[1, 5:7] = False  # a hole
    full = core(q, k, v, mask=mask, causal=True)
    state = core.start_decoding()
    assert isinstance(state, DeltaState)
    outs, start = [], 0
    for t in steps:
        part = slice(start, start + t)
        outs.append(core.decode(q[:, :, part], k[:, :, part], v[:, :, part], state, mask=mask[:, part]))
        start += t
    assert state.length == n and state.memory.shape == (2, HEADS, DIM_HEAD, DIM_HEAD)
    decoded = torch.cat(outs, dim=-2)
    torch.testing.assert_close(decoded[:, :, mask[0] & mask[1]], full[:, :, mask[0] & mask[1]], **TIGHT)
    torch.testing.assert_close(decoded * mask[:, None, :, None], full * mask[:, None, :, None], **TIGHT)


def test_the_state_of_half_inputs_is_float32_and_outputs_follow_float64():
    core64 = make(8)
    core16 = make(8, torch.bfloat16)
    q, k, v = inputs(2, 29)
    half = [t.bfloat16() for t in (q, k, v)]
    out = core16(*half, causal=True)
    assert out.dtype == torch.bfloat16
    expected = core64(*(t.double() for t in half), causal=True)
    torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=3e-2)
    state = core16.start_decoding()
    core16.decode(*(t[:, :, :3] for t in half), state)
    assert state.memory.dtype == torch.float32


def test_float32_agrees_with_float64():
    core64 = make(8)
    core32 = make(8, torch.float32)
    q, k, v = inputs(2, 40)
    mask = pad_mask(torch.tensor([40, 31]), 40)
    out32 = core32(q.float(), k.float(), v.float(), mask=mask, causal=True)
    torch.testing.assert_close(out32.double(), core64(q, k, v, mask=mask, causal=True), rtol=1e-4, atol=1e-5)


def test_bidirectional_calls_are_refused_in_one_line():
    core = make(4)
    q, k, v = inputs(1, 8)
    with pytest.raises(ValueError, match=r"^gated_deltanet is causal only: call it with causal=True[^\n]*$"):
        core(q, k, v, causal=False)


def test_the_initialisation_is_the_authors():
    core = az.create_attention("gated_deltanet", dim_head=DIM_HEAD, heads=64)
    a = core.A_log.exp()
    assert (a > 0).all() and (a <= 16).all() and a.max() > 8  # A ~ U(0, 16]
    dt = torch.nn.functional.softplus(core.dt_bias)
    assert (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 0.1 * (1 + 1e-5)).all()  # dt in [0.001, 0.1]
    bound = 1 / math.sqrt(2 * DIM_HEAD)  # nn.Linear's default over the 2d inputs [k; v]
    assert core.w_beta.shape == core.w_alpha.shape == (64, 2 * DIM_HEAD)
    assert core.w_beta.abs().max() <= bound and core.w_alpha.abs().max() <= bound
    assert az.get_attention_class("gated_deltanet").approximation == "recurrent state"


@pytest.mark.parametrize(
    ("bad", "message"),
    [(0, "chunk_size must be an int >= 1, got 0"), (-2, "chunk_size must be an int >= 1, got -2"),
     (2.5, "option chunk_size=2.5 is not a valid int"), (True, "option chunk_size=True is not a valid int")],
)  # fmt: skip
def test_a_bad_chunk_size_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        az.create_attention("gated_deltanet", dim_head=DIM_HEAD, heads=HEADS, chunk_size=bad)
