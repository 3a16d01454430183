"""The no-attention control arm: each position's output is its own value vector, and a model built on it mixes
nothing across positions (the property the control exists for)."""

from __future__ import annotations

import pytest
import torch

import attention_zoo as az


def test_output_is_each_positions_own_value_and_padding_gives_zero():
    core = az.create_attention("self_only", dim_head=4, heads=2).double()
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    for causal in (False, True):
        out = core(q, k, v, mask=mask, causal=causal)
        torch.testing.assert_close(out, v * mask[:, None, :, None], rtol=0, atol=0)


def test_queries_and_keys_get_no_gradient():
    core = az.create_attention("self_only", dim_head=4, heads=1).double()
    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    core(q, k, v).pow(2).sum().backward()
    assert q.grad is None or not q.grad.any()
    assert k.grad is None or not k.grad.any()
    torch.testing.assert_close(v.grad, 2 * v.detach())


def test_cross_attention_is_refused():
    core = az.create_attention("self_only", dim_head=4, heads=1)
    with pytest.raises(ValueError, match="self-attention only"):
        core(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))


@pytest.mark.parametrize("causal", [False, True])
def test_an_encoder_on_it_mixes_nothing_across_positions(causal):
    """Changing token j changes the output at j only; under full attention it changes every position's."""
    outputs = {}
    for attention in ("self_only", "full"):
        torch.manual_seed(0)
        config = az.ModelConfig(vocab_size=20, dim=16, depth=2, heads=2, max_seq_len=8, attention=attention)
        model = az.TransformerEncoder(config, causal=causal).eval()
        tokens = torch.randint(0, 20, (1, 8))
        changed = tokens.clone()
        changed[0, 3] = (tokens[0, 3] + 1) % 20
        with torch.no_grad():
            outputs[attention] = (model(tokens) - model(changed)).abs().amax(dim=-1)[0]
    moved = outputs["self_only"] > 0
    assert moved.tolist() == [i == 3 for i in range(8)]
    assert (outputs["full"][4:] > 1e-6).all()  # the check can fail: full attention does carry the change


def test_decoding_equals_the_causal_forward():
    core = az.create_attention("self_only", dim_head=4, heads=2).double()
    q, k, v = (torch.randn(2, 2, 7, 4, dtype=torch.float64) for _ in range(3))
    state = core.start_decoding()
    steps = [core.decode(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], state) for i in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=-2), core(q, k, v, causal=True), rtol=0, atol=0)
