"""The short causal convolution against its equation, in float64: y_i = x_i + Σ_j w_j ⊙ x_{i-j} + b."""

from __future__ import annotations

import pytest
import torch

from attention_zoo.config import ModelConfig
from attention_zoo.short_convolution import ShortConvolution
from attention_zoo.transformer import TransformerEncoder


def equation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The module docstring's sum written out as loops; ``weight`` (d, K) in Conv1d's order, where tap K - 1 - j
    multiplies x_{i-j} (Conv1d is a cross-correlation)."""
    b, n, d = x.shape
    kernel = weight.shape[1]
    out = x.clone()
    for i in range(n):
        out[:, i] += bias
        for j in range(kernel):
            if i - j >= 0:
                out[:, i] += weight[:, kernel - 1 - j] * x[:, i - j]
    return out


@pytest.mark.parametrize("kernel_size", [1, 3, 4])
def test_matches_the_equation_in_float64(kernel_size: int) -> None:
    torch.manual_seed(0)
    module = ShortConvolution(5, kernel_size).double()
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    weight = module.conv.weight[:, 0]
    torch.testing.assert_close(module(x), equation(x, weight, module.conv.bias), rtol=1e-12, atol=1e-12)


def test_reads_only_the_last_kernel_size_positions() -> None:
    torch.manual_seed(0)
    module = ShortConvolution(4, 3).double()
    x = torch.randn(1, 10, 4, dtype=torch.float64)
    changed = x.clone()
    changed[:, 6] += 1.0
    difference = (module(changed) - module(x)).abs().sum(-1)[0]
    assert difference[:6].max() == 0  # causal: nothing before position 6 moves
    assert (difference[6:9] > 0).all()  # positions 6, 7, 8 read position 6
    assert difference[9] == 0  # K = 3: position 9 reads 7..9 only


def test_padding_reaches_no_real_token() -> None:
    torch.manual_seed(0)
    module = ShortConvolution(4, 3).double()
    x = torch.randn(1, 6, 4, dtype=torch.float64)
    mask = torch.tensor([[False, False, True, True, True, True]])  # left padding
    junk = x.clone()
    junk[:, :2] = 1e6
    torch.testing.assert_close(module(junk, mask)[:, 2:], module(x, mask)[:, 2:], rtol=0, atol=0)


def test_refuses_a_kernel_size_below_one() -> None:
    with pytest.raises(ValueError, match="kernel_size must be >= 1, got 0"):
        ShortConvolution(4, 0)
    with pytest.raises(ValueError, match="short_convolution must be >= 0.*got -1"):
        ModelConfig(vocab_size=16, dim=8, depth=1, heads=2, max_seq_len=8, short_convolution=-1)


def test_encoder_applies_it_and_stays_causal() -> None:
    torch.manual_seed(0)
    sizes = dict(vocab_size=16, dim=8, depth=1, heads=2, max_seq_len=12)
    plain = TransformerEncoder(ModelConfig(**sizes), causal=True)
    assert plain.short_convolution is None
    encoder = TransformerEncoder(ModelConfig(**sizes, short_convolution=3), causal=True).double()
    tokens = torch.randint(0, 16, (2, 12))
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 16
    before, after = encoder(tokens), encoder(changed)
    torch.testing.assert_close(after[:, :8], before[:, :8], rtol=0, atol=0)
    assert not torch.allclose(after[:, 8], before[:, 8])
    with torch.no_grad():
        encoder.short_convolution.conv.weight.zero_()
        encoder.short_convolution.conv.bias.zero_()
        without = TransformerEncoder(ModelConfig(**sizes), causal=True).double()
        without.load_state_dict({k: v for k, v in encoder.state_dict().items() if "short_convolution" not in k})
    torch.testing.assert_close(encoder(tokens), without(tokens), rtol=1e-12, atol=1e-12)
