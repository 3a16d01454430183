"""Each core's ``approximation`` says what it computes in place of softmax over every key; the three kinds
that claim exact softmax over some keys are checked against a float64 reference written here: ``none`` equals
full attention, ``fixed sparsity`` equals full attention under its pattern's mask, and ``content-selected
sparsity`` equals full attention under the mask of its own selection (MoBA's, from the paper's gate:
``tests/attention_zoo/test_moba.py``'s reference)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.core import APPROXIMATIONS
from attention_zoo.sparse.mask_mods import dense_mask
from tests.attention_zoo.registry_cases import build, case_id, cases, qkv, skip_unless_takes
from tests.attention_zoo.test_moba import reference_selection

EXACT_KINDS = ("none", "fixed sparsity", "content-selected sparsity")
N = 48


def softmax_under(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, sinks: Tensor | None = None
) -> Tensor:
    """softmax(q k^T scale) v over the allowed keys; a query with none gives zeros. ``sinks`` (H,): GPT-OSS's
    learned sink logit per head, one more term exp(sink) in each row's denominator, with no value."""
    scores = torch.where(allowed, q @ k.mT * scale, float("-inf"))
    has_key = allowed.any(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.detach()[None, :, None, None].expand(*scores.shape[:-1], 1)
        return torch.cat([torch.where(has_key, scores, 0.0), sink], dim=-1).softmax(dim=-1)[..., :-1] * has_key @ v
    return torch.where(has_key, scores, 0.0).softmax(dim=-1) * has_key @ v


def allowed_keys(core: az.AttentionCore, q: Tensor, k: Tensor, mask: Tensor, causal: bool) -> Tensor:
    b, h, n, _ = q.shape
    keys = mask[:, None, None, :].expand(b, h, n, n)
    if core.approximation == "none":
        pattern = torch.ones(n, n, dtype=torch.bool)
    elif core.approximation == "fixed sparsity":
        pattern = dense_mask(core.mask_mod(n, causal, q.device), n, q.device)  # the pattern AND j <= i when causal
    else:
        return reference_selection(q, k, mask, causal, core.block_size, core.top_k)
    if causal:
        pattern = pattern & torch.ones(n, n, dtype=torch.bool).tril()
    return keys & pattern


@pytest.mark.parametrize("name", az.list_attentions())
def test_every_core_declares_one_kind(name):
    assert az.get_attention_class(name).approximation in APPROXIMATIONS


def test_registration_refuses_a_core_without_a_kind():
    class Unlabelled(az.AttentionCore):
        def attend(self, q, k, v, *, mask, causal):
            return v

    with pytest.raises(TypeError, match="approximation"):
        az.register_attention("unlabelled-for-this-test")(Unlabelled)
    assert "unlabelled-for-this-test" not in az.list_attentions()


EXACT_CASES = [c for c in cases() if az.get_attention_class(c[0]).approximation in EXACT_KINDS]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", EXACT_CASES, ids=[case_id(c) for c in EXACT_CASES])
def test_exact_kinds_are_full_attention_under_their_keys(case, causal):
    name, options = case
    core = build(name, options)
    skip_unless_takes(name, causal)
    q, k, v = qkv(core, 2, N)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, N - 7 :] = False
    out = core(q, k, v, mask=mask, causal=causal)
    expected = softmax_under(q, k, v, allowed_keys(core, q, k, mask, causal), core.scale, getattr(core, "sinks", None))
    real = mask[:, None, :, None]  # padded queries are outside the contract
    torch.testing.assert_close(out * real, expected * real, rtol=1e-10, atol=1e-10)


def test_the_approximating_kinds_are_not_full_attention():
    """The check above would pass any core if the reference were wrong: a low-rank core fails it."""
    core = build("nystrom", {"num_landmarks": 4})
    q, k, v = qkv(core, 2, N)
    mask = torch.ones(2, N, dtype=torch.bool)
    full = softmax_under(q, k, v, torch.ones(2, 2, N, N, dtype=torch.bool), core.scale)
    assert (core(q, k, v, mask=mask, causal=False) - full).abs().max() > 1e-3
