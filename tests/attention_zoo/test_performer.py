"""Performer (FAVOR+) against the paper: the features' distribution, unbiasedness over draws, the
1/sqrt(m) error, the dense form of eq. (4) with the same features (so the stabilisers are seen to cancel),
redrawing and seeding. Float64 references; softmax attention from ``full`` (backend ``math``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.core import BuildContext
from attention_zoo.masks import pad_mask

H, D = 2, 8
F64 = torch.float64


def make(**options) -> az.AttentionCore:
    return az.create_attention("performer", dim_head=D, heads=H, **options).double().eval()


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = F64) -> Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)).to(dtype)


def inputs(b: int, nq: int, nk: int, seed: int = 0, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    q, k = randn(b, H, nq, D, seed=seed, scale=scale), randn(b, H, nk, D, seed=seed + 1, scale=scale)
    return q, k, randn(b, H, nk, D, seed=seed + 2)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    return az.create_attention("full", dim_head=D, heads=H, backend="math")(q, k, v, mask=mask, causal=causal)


def relative_error(out: Tensor, reference: Tensor) -> float:
    return float((out - reference).norm() / reference.norm())


def favor_reference(w: Tensor, kernel: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool):
    """Eq. (4) densely, with phi of eq. (5) (softmax: h = exp(-|x|^2/2), f = exp; relu: h = 1, f = ReLU) on
    q d^-1/4, k d^-1/4, and no stabiliser: D^-1 (Q' K'^T masked) V."""
    m = w.shape[0]

    def phi(x: Tensor) -> Tensor:
        x = x * D**-0.25
        if kernel == "relu":
            return torch.relu(x @ w.T) / math.sqrt(m)
        return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(m)

    nq, nk = q.shape[-2], k.shape[-2]
    a = phi(q) @ phi(k).transpose(-1, -2)
    allowed = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq) if causal else torch.ones(nq, nk, dtype=torch.bool)
    allowed = allowed[None, None] if mask is None else allowed[None, None] & mask[:, None, None, :]
    a = a * allowed
    den = a.sum(-1, keepdim=True)
    return torch.where(den > 0, a @ v / torch.where(den > 0, den, 1.0), 0.0)


# --- the features ----------------------------------------------------------------------------------------------


def test_features_are_orthogonal_blocks_of_gaussian_rows():
    """Rows of one d-block are exactly orthogonal; over draws each row is N(0, I_d): E[w w^T] = I."""
    draws = torch.stack([make(nb_features=20, seed=s).projection(torch.device("cpu"), F64) for s in range(400)])
    for block in (slice(0, 8), slice(8, 16), slice(16, 20)):
        gram = draws[:, block] @ draws[:, block].transpose(-1, -2)
        off_diagonal = gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1))
        assert off_diagonal.abs().max() < 1e-10 * gram.abs().max()
    rows = draws.reshape(-1, D)  # 8000 rows
    second_moment = rows.T @ rows / rows.shape[0]
    assert (second_moment - torch.eye(D, dtype=F64)).abs().max() < 0.1  # 4 standard errors of sqrt(2/8000)


def test_features_depend_on_seed_layer_and_draw_only():
    cpu = torch.device("cpu")
    w = make(nb_features=16, seed=5).projection(cpu, F64)
    assert torch.equal(make(nb_features=16, seed=5).projection(cpu, F64), w)
    assert torch.equal(make(nb_features=16, seed=5).projection(cpu, torch.float32), w.float())  # not the dtype
    assert not torch.equal(make(nb_features=16, seed=6).projection(cpu, F64), w)
    other_layer = az.create_attention("performer", dim_head=D, heads=H, nb_features=16, seed=5,
                                      context=BuildContext(layer_index=1, num_layers=2))  # fmt: skip
    assert not torch.allclose(other_layer.projection(cpu, F64), w)


# --- the estimate ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(23, 23), (9, 23), (23, 9)], ids=lambda s: f"nq{s[0]}-nk{s[1]}")
def test_matches_eq_4_with_the_same_features(kernel, causal, shape):
    """The stabilisers (query row maximum, running key maximum) and the chunking cancel exactly: the output is
    eq. (4) computed densely from the same W. Large q and k (|x|^2 / 2 ~ 30) make the stabilisers matter."""
    nq, nk = shape
    core = make(nb_features=24, kernel=kernel, chunk_size=4)
    q, k, v = inputs(3, nq, nk, scale=3.0)
    mask = pad_mask(torch.tensor([nk, nk - 5, 2]), nk)
    w = core.projection(torch.device("cpu"), F64)
    for m in (None, mask):
        out = core(q, k, v, mask=m, causal=causal)
        expected = favor_reference(w, kernel, q, k, v, m, causal)
        if m is not None and nq == nk:  # self-attention: outputs at padded query positions are unspecified
            out, expected = (t * m[:, None, :, None] for t in (out, expected))
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)


def test_mean_over_draws_approaches_softmax_attention():
    """Unbiasedness (Lemma 1): every kernel entry is estimated without bias, so the mean over 200 draws of
    m = 256 features is about sqrt(200) times closer to softmax attention than one draw (the ratio D^-1 A
    adds an O(1/m) bias). Small inputs (|x| ~ 0.5) keep the variance exp(|x + y|^2) / m of Lemma 2 low.
    Stated tolerance: the mean's relative error below 0.005 and below 1/8 of a single draw's (measured:
    0.002 and 0.031)."""
    q, k, v = inputs(1, 16, 16, seed=11, scale=0.3)
    reference = softmax_attention(q, k, v)
    outs = torch.stack([make(nb_features=256, seed=s)(q, k, v) for s in range(200)])
    single = sum(relative_error(o, reference) for o in outs) / len(outs)
    mean = relative_error(outs.mean(dim=0), reference)
    assert mean < 0.005 and mean < single / 8, (mean, single)


def test_error_falls_as_one_over_sqrt_m():
    """Mean relative error over 8 seeds for m = 16 .. 1024 (measured 0.17, 0.079, 0.034, 0.017): the
    log-log slope is -1/2 within 0.15, and 64x more features cut the error by 8x within a factor 1.6."""
    q, k, v = inputs(2, 32, 32, seed=21, scale=0.3)
    reference = softmax_attention(q, k, v)
    ms = [16, 64, 256, 1024]
    errors = [sum(relative_error(make(nb_features=m, seed=s)(q, k, v), reference) for s in range(8)) / 8 for m in ms]
    slope = math.log(errors[-1] / errors[0]) / math.log(ms[-1] / ms[0])
    assert abs(slope + 0.5) < 0.15, (errors, slope)
    assert 8 / 1.6 < errors[0] / errors[-1] < 8 * 1.6, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_inputs_stay_finite_and_accurate(dtype):
    """|x|^2 / 2 ~ 580 (|q| ~ 96 at d = 64): every unstabilised feature exp(w^T x - |x|^2 / 2) underflows in
    float32, so without the query row maximum and the key reference every denominator would be 0. With them
    float32 agrees with float64 (to 1e-4 of max |v|), and in bf16/fp16 every output is finite and, the
    weights being non-negative, a convex combination of the values it sees (up to its own rounding)."""
    core = az.create_attention("performer", dim_head=64, heads=1, nb_features=128, chunk_size=16).eval()
    q, k = (randn(1, 1, 96, 64, seed=s, scale=12.0) for s in range(2))
    v = randn(1, 1, 96, 64, seed=2)
    x = q.float() * 64**-0.25
    assert not torch.exp(x @ core.projection(x.device, torch.float32).T - (x * x).sum(-1, keepdim=True) / 2).any()
    for causal in (False, True):
        out = core.to(dtype)(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal).double()
        assert torch.isfinite(out).all()
        if dtype == torch.float32:
            torch.testing.assert_close(out, core.double()(q, k, v, causal=causal), rtol=0.0, atol=1e-4 * 4)
            continue
        seen = v.to(dtype).double()
        low = seen.cummin(dim=-2).values if causal else seen.amin(dim=-2, keepdim=True)
        high = seen.cummax(dim=-2).values if causal else seen.amax(dim=-2, keepdim=True)
        slack = 2 * torch.finfo(dtype).eps * float(seen.abs().max())  # the output's rounding to dtype
        assert (out >= low - slack).all() and (out <= high + slack).all()


# --- redrawing ---------------------------------------------------------------------------------------------


def test_features_are_redrawn_every_interval_of_training_passes_and_never_in_eval():
    core = make(nb_features=16, redraw_interval=2).train()
    q, k, v = inputs(1, 12, 12)
    passes = [core(q, k, v) for _ in range(5)]  # draws 0, 0, 1, 1, 2
    assert torch.equal(passes[0], passes[1]) and torch.equal(passes[2], passes[3])
    assert not torch.allclose(passes[1], passes[2]) and not torch.allclose(passes[3], passes[4])
    core.eval()
    evaluated = [core(q, k, v) for _ in range(3)]
    assert all(torch.equal(e, passes[4]) for e in evaluated)  # the last training pass's features, unchanged
    assert int(core.training_passes) == 5


def test_redraw_state_is_saved_with_the_model_and_none_never_redraws():
    trained = make(nb_features=16, redraw_interval=1).train()
    q, k, v = inputs(1, 12, 12)
    for _ in range(3):
        trained(q, k, v)
    restored = make(nb_features=16, redraw_interval=1)
    restored.load_state_dict(trained.state_dict())
    torch.testing.assert_close(restored(q, k, v), trained.eval()(q, k, v), rtol=0.0, atol=0.0)
    fixed = make(nb_features=16, redraw_interval=None).train()
    first = fixed(q, k, v)
    assert all(torch.equal(fixed(q, k, v), first) for _ in range(3))


@pytest.mark.parametrize(
    "options, message",
    [({"nb_features": 0}, "nb_features"), ({"redraw_interval": 0}, "redraw_interval"), ({"seed": -1}, "seed"),
     ({"chunk_size": 0}, "chunk_size"), ({"kernel": "cos"}, "kernel")],
)  # fmt: skip
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        az.create_attention("performer", dim_head=D, heads=H, **options)
