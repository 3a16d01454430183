"""The initialisation convention (attention_zoo.init) and what it is for: at initialisation the residual
stream must differ from position to position, or every attention pattern gives nearly the same output."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

import attention_zoo as az
from attention_zoo.init import init_transformer_


def text_byte_ids(n: int, batch: int) -> torch.Tensor:
    """Byte ids of real text: windows of the Python standard library's own source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(path.read_bytes() for path in sorted(stdlib.glob("[a-c]*.py"))[:20])
    assert len(data) > batch * n, "the standard library sources are the fixture"
    starts = torch.linspace(0, len(data) - n - 1, batch).long().tolist()
    return torch.tensor([list(data[s : s + n]) for s in starts])


def position_common_share(x: torch.Tensor) -> float:
    """Energy of each sequence's mean over positions, N·‖mean‖², over the stream's total energy ‖x‖²:
    1 when every position holds the same vector, 1/N for positions that are independent and centred."""
    return (x.mean(1).pow(2).sum() * x.shape[1] / x.pow(2).sum()).item()


@pytest.mark.parametrize("depth", [2, 4, 8])
def test_the_residual_stream_keeps_its_positions_apart_at_initialisation(depth):
    """The legacy init (PyTorch's default Linears with non-zero biases beside N(0, 0.02) embeddings) put nearly
    the same vector at every position; the convention stays near the embeddings' own share."""
    torch.manual_seed(0)
    model = az.TransformerEncoder(az.ModelConfig(vocab_size=256, max_seq_len=512, dim=128, depth=depth, heads=4)).eval()
    tokens = text_byte_ids(512, 2)
    with torch.no_grad():
        x = model.embed(tokens)
        shares = []
        for layer in model.layers:
            x = layer(x)
            shares.append(position_common_share(x))
    assert max(shares) < 0.25, shares


def xavier_std(linear: nn.Linear) -> float:
    """The standard deviation of Xavier-uniform: sqrt(2 / (fan_in + fan_out)) (Glorot & Bengio 2010)."""
    return math.sqrt(2 / (linear.in_features + linear.out_features))


def test_the_convention_is_applied_to_every_block_and_leaves_the_cores_alone():
    depth = 3
    torch.manual_seed(0)
    config = az.ModelConfig(
        vocab_size=100, max_seq_len=256, dim=64, depth=depth, heads=4, attention="linformer:k=16,sharing=layerwise"
    )
    model = az.TransformerEncoder(config)
    for layer in model.layers:
        for linear in (layer.attn.to_q, layer.attn.to_k, layer.attn.to_v, layer.ff[0]):
            assert linear.weight.std().item() == pytest.approx(xavier_std(linear), rel=0.1)
            assert not linear.bias.any()
        for linear in (layer.attn.to_out, layer.ff[3]):
            assert linear.weight.std().item() == pytest.approx(xavier_std(linear) / math.sqrt(2 * depth), rel=0.1)
            assert not linear.bias.any()
        assert torch.equal(layer.attn_norm.weight, torch.ones(64)) and not layer.attn_norm.bias.any()
    # stored at N(0, 1/d), used as sqrt(d) E: unit scale in the stream
    assert model.token_embedding.weight.std().item() == pytest.approx(64**-0.5, rel=0.1)
    assert model.position_embedding.table.weight.std().item() == pytest.approx(64**-0.5, rel=0.1)
    with torch.no_grad():
        assert model.embed(torch.randint(0, 100, (4, 256))).std().item() == pytest.approx(math.sqrt(2), rel=0.1)
    # Linformer's shared E keeps the core's own init: re-running the convention would redraw it if it reached E
    (projection,) = list(model.shared_attention_state.parameters())
    before = projection.detach().clone()
    init_transformer_(model, residual_branches=2 * depth)
    torch.testing.assert_close(projection, before, rtol=0, atol=0)


def test_a_decoder_counts_three_residual_branches_per_layer():
    depth = 2
    torch.manual_seed(0)
    model = az.TransformerDecoder(az.ModelConfig(vocab_size=100, max_seq_len=256, dim=64, depth=depth, heads=4))
    for layer in model.layers:
        for linear in (layer.self_attn.to_out, layer.cross_attn.to_out, layer.ff[3]):
            assert linear.weight.std().item() == pytest.approx(xavier_std(linear) / math.sqrt(3 * depth), rel=0.1)


def test_task_heads_follow_the_convention():
    from tasks.token_prediction import TokenPrediction

    task = TokenPrediction(vocab_size=50, max_seq_len=32, num_classes=50, dim=64)
    assert isinstance(task.head, nn.Linear)
    assert task.head.weight.std().item() == pytest.approx(xavier_std(task.head), rel=0.15)
    assert not task.head.bias.any()


def test_tied_output_logits_have_unit_scale_at_initialisation():
    """Vaswani's output scale: the tied embedding is stored at N(0, 1/d), so h E^T has unit variance."""
    torch.manual_seed(0)
    model = az.Seq2SeqTransformer(az.ModelConfig(vocab_size=500, max_seq_len=32, dim=128, depth=2, heads=4))
    source, target = torch.randint(0, 500, (4, 20)), torch.randint(0, 500, (4, 12))
    with torch.no_grad():
        logits = model(source, None, target)
    assert 0.5 < logits.std().item() < 2.0


def test_init_refuses_a_non_positive_branch_count():
    with pytest.raises(ValueError, match="residual_branches must be >= 1, got 0"):
        init_transformer_(nn.Linear(2, 2), residual_branches=0)
